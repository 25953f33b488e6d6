#!/usr/bin/env python3
"""The loops of a cubin's kernels, with their instruction counts by opcode.

Reads the SASS of a CUDA cubin on a machine without a GPU or a CUDA 13
disassembler, and prints, for each kernel, its register count, its size and
every loop (a backward branch and the code it jumps back over) with the
number of instructions of each opcode in it. Or compares two cubins kernel
by kernel (--compare): which kernels' machine code differs.

  sass_loops.py [--kernel REGEX]... [--modifiers] [--nvdisasm PATH] CUBIN
  sass_loops.py --compare [--kernel REGEX]... [--rename REGEX REPL]... A.cubin B.cubin

Make the cubin with the flags of the build (kernels/cuda/CMakeLists.txt):
  /usr/local/cuda/bin/nvcc -O3 -DNDEBUG -arch=sm_90 -cubin -lineinfo \\
      --expt-relaxed-constexpr -std=c++17 -I. -o /tmp/attend.cubin \\
      kernels/cuda/attend_kernels.cu

The disassembler: CUDA 13's toolkit here has nvcc and ptxas but no nvdisasm.
Debian 12's non-free nvidia-cuda-toolkit (CUDA 11.8) has one that decodes
sm_90 code; it can be had without installing the package (or its ~1 GB of
dependencies):
  printf 'Types: deb\\nURIs: http://deb.debian.org/debian\\nSuites: bookworm\\n'\\
'Components: non-free\\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\\n' \\
      > /tmp/nonfree.sources
  o='-oDir::Etc::SourceList=/tmp/nonfree.sources -oDir::Etc::SourceParts=/dev/null
     -oDir::State::Lists=/tmp/nvd/lists'
  mkdir -p /tmp/nvd/lists/partial && cd /tmp/nvd && apt-get $o update &&
      apt-get $o download nvidia-cuda-toolkit && dpkg -x nvidia-cuda-toolkit_*.deb x
  # then: --nvdisasm /tmp/nvd/x/usr/bin/nvdisasm, or NVDISASM=... in the environment
CUDA 11.8's nvdisasm refuses the ELF header that CUDA 12.8+ writes (ABI
version 8, a new e_flags layout): this script disassembles a copy whose
header says the same architecture the old way (ABI version 7). The code
itself is not touched. Cubins with the old header go through unchanged;
other ELF files and architectures above sm_90 (unknown to CUDA 11.8) are
refused.

What a loop is here: an address that some direct branch (BRA, any predicate
or form) jumps back to, excluding a branch to itself (the trap loop at a
kernel's end); the loop runs from there to its last backward branch (a
loop with several back edges is one loop). Nested loops are listed each
with their own counts, inner ones inside the outer ones' counts. Branch
targets are read from the encoding.

Instructions CUDA 11.8's nvdisasm cannot decode (some of the opcodes CUDA
12+ emits for sm_90, e.g. 0x836 and 0x848) are counted too, as ?836 etc. (the
low 12 bits of their encoding), so loop sizes are whole; the kernel's line
says how many there are.
"""

import argparse
import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

EM_CUDA = 190
OLD_ABI = 7
NEW_ABI = 8
MAX_SM = 90  # the newest architecture CUDA 11.8's nvdisasm decodes


class CubinError(Exception):
    pass


def cubin_arch(data):
    """(abi_version, sm) of a CUDA ELF, or raises CubinError."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise CubinError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        raise CubinError("an ELF file for machine %d, not a CUDA cubin (%d)" % (machine, EM_CUDA))
    abi = data[8]
    (flags,) = struct.unpack_from("<I", data, 48)
    if abi == OLD_ABI:
        return abi, flags & 0xFF
    if abi == NEW_ABI:
        return abi, (flags >> 8) & 0xFF
    raise CubinError("a cubin of unknown ELF ABI version %d (known: 7, 8)" % abi)


def old_style_header(data):
    """A copy of the cubin whose header CUDA 11.8's nvdisasm reads."""
    abi, sm = cubin_arch(data)
    if sm > MAX_SM:
        raise CubinError("a cubin for sm_%d: CUDA 11.8's nvdisasm decodes up to sm_%d" % (sm, MAX_SM))
    if abi == OLD_ABI:
        return bytes(data)
    out = bytearray(data)
    out[7] = 0x33  # ELFOSABI_CUDA of ABI version 7
    out[8] = OLD_ABI
    # EF_CUDA_SM, EF_CUDA_TEXMODE_UNIFIED | EF_CUDA_64BIT_ADDRESS, EF_CUDA_VIRTUAL_SM.
    struct.pack_into("<I", out, 48, sm | 0x500 | (sm << 16))
    return bytes(out)


def sections(data):
    """{name: (offset, size, info)} of an ELF64 file's sections."""
    (shoff,) = struct.unpack_from("<Q", data, 40)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 58)
    if shoff == 0 or shnum == 0:
        return {}
    if shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise CubinError("truncated ELF file (section table past its end)")
    rows = []
    for i in range(shnum):
        base = shoff + i * shentsize
        name, stype, _flags, _addr, off, size, _link, info = struct.unpack_from("<IIQQQQII", data, base)
        if off + size > len(data) and stype != 8:  # SHT_NOBITS takes no file space
            raise CubinError("truncated ELF file (a section past its end)")
        rows.append((name, off, size, info))
    str_off = rows[shstrndx][1]
    out = {}
    for name, off, size, info in rows:
        end = data.index(b"\0", str_off + name)
        out[data[str_off + name:end].decode("ascii", "replace")] = (off, size, info)
    return out


EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 4  # (format, attribute, u16 size, size bytes); the other formats take 4 bytes


def register_counts(data, secs):
    """{symbol index: registers} from the .nv.info sections' EIATTR_REGCOUNT
    records (where CUDA 12.8+ keeps them; older cubins have them in the text
    section's sh_info too)."""
    out = {}
    for name, (off, size, _info) in secs.items():
        if not name.startswith(".nv.info"):
            continue
        p, end = off, off + size
        while p + 2 <= end:
            fmt, attr = data[p], data[p + 1]
            if fmt == EIFMT_SVAL:
                (n,) = struct.unpack_from("<H", data, p + 2)
                if attr == EIATTR_REGCOUNT and n == 8:
                    sym, regs = struct.unpack_from("<II", data, p + 4)
                    out[sym] = regs
                p += 4 + n
            else:
                p += 4
    return out


def kernel_texts(data):
    """{mangled kernel name: (code bytes, registers)} of a cubin."""
    secs = sections(data)
    regs = register_counts(data, secs)
    out = {}
    for name, (off, size, info) in secs.items():
        if name.startswith(".text."):
            out[name[len(".text."):]] = (data[off:off + size], regs.get(info & 0xFFFFFF, info >> 24))
    return out


def demangle(names):
    """{mangled: readable} through c++filt when it is there (else unchanged)."""
    names = list(names)
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    res = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True)
    lines = res.stdout.splitlines()
    if res.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


SECTION_RE = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
LABEL_RE = re.compile(r"^(\.L_x_\d+):")
HEX_RE = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")
INSN_RE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*/\* 0x[0-9a-f]{16} \*/")
PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")
# BRA, BRA.U, BRA.DIV UR4, ... : a direct branch to a label.
BRANCH_RE = re.compile(r"^BRA(\.[A-Z0-9.]+)?\s+(?:[^`]*,\s*)?`\((\.L_x_\d+)\)")


class Insn(collections.namedtuple("Insn", "addr opcode target")):
    """One instruction: its address, its opcode with modifiers ('?836' for one
    this nvdisasm cannot decode: the low 12 bits of its encoding), and for a
    direct branch the address it jumps to (else None)."""


def branch_offset(w0, w1):
    """The byte offset (from the next instruction) of a Volta-to-Hopper BRA,
    from its two encoding words: offset bits 2-9 in bits 16-23, offset bits
    10 and up (signed) in bits 34-81. Checked against nvdisasm's labels."""
    v = w0 | (w1 << 64)
    hi = (v >> 34) & ((1 << 48) - 1)
    if hi >= 1 << 47:
        hi -= 1 << 48
    return (hi << 10) | (((v >> 16) & 0xFF) << 2)


def parse_sass(text, warn=None):
    """{kernel: [Insn]} from `nvdisasm -c -hex` output. CUDA 11.8's nvdisasm
    leaves out the instructions it cannot decode (some of CUDA 12+'s sm_90
    opcodes: 0x836, 0x848, ...), printing only their two encoding words; they
    are kept here, at their addresses, under their opcode bits. Branch
    targets come from the encoding, not from the labels (nvdisasm omits or
    misplaces labels at undecoded instructions); a target that disagrees with
    its label by more than one instruction is reported through `warn`."""
    kernels = collections.OrderedDict()
    current = None
    pending, labels = [], {}
    insns, raw = [], []  # raw: [w0, w1, branch label] per instruction
    expect_second = False
    next_addr = 0

    def finish():
        if current is None:
            return
        out = []
        for (addr, opcode), (w0, w1, label) in zip(insns, raw):
            target = None
            if label is not None and w1 is not None:
                target = addr + 16 + branch_offset(w0, w1)
                at = labels.get(label)
                if at is not None and abs(at - target) > 16:
                    if warn:
                        warn("branch at 0x%x in %s: encoded target 0x%x, label 0x%x (taking the label)"
                             % (addr, current, target, at))
                    target = at
            out.append(Insn(addr, opcode, target))
        kernels[current] = out

    for line in text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            finish()
            current = m.group(1)
            pending, labels, insns, raw = [], {}, [], []
            expect_second, next_addr = False, 0
            continue
        if current is None:
            continue
        m = LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        h = HEX_RE.search(line)
        if not h:
            continue
        word = int(h.group(1), 16)
        m = INSN_RE.match(line)
        if m:
            addr = int(m.group(1), 16)
            body = PRED_RE.sub("", m.group(2).strip())
            opcode = body.split()[0].rstrip(";") if body else "?"
            b = BRANCH_RE.match(body)
            label = b.group(2) if b else None
        elif expect_second:
            raw[-1][1] = word  # the second word of the instruction before
            expect_second = False
            continue
        else:
            addr, opcode, label = next_addr, "?%03x" % (word & 0xFFF), None  # undecoded
        for name in pending:
            labels[name] = addr
        pending = []
        insns.append((addr, opcode))
        raw.append([word, None, label])
        expect_second = True
        next_addr = addr + 16
    finish()
    return kernels


def find_loops(insns):
    """[(head, end, back_edges)] of one kernel's loops, by head: each address
    some backward branch jumps to (not a branch to itself) is a loop head,
    ending at its last backward branch."""
    ends = collections.defaultdict(list)
    for insn in insns:
        if insn.target is not None and insn.target < insn.addr:
            ends[insn.target].append(insn.addr)
    return sorted((head, max(e), len(e)) for head, e in ends.items())


def opcode_counts(insns, start, end, modifiers):
    counts = collections.Counter()
    for insn in insns:
        if start <= insn.addr <= end:
            counts[insn.opcode if modifiers else insn.opcode.split(".")[0]] += 1
    return counts


def disassemble(path, nvdisasm):
    with open(path, "rb") as f:
        data = f.read()
    fixed = old_style_header(data)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(fixed)
        tmp.flush()
        res = subprocess.run([nvdisasm, "-c", "-hex", tmp.name], capture_output=True, text=True)
    if res.returncode != 0:
        raise CubinError("nvdisasm failed: " + res.stderr.strip())
    return data, res.stdout


def find_nvdisasm(given):
    for cand in (given, os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 "/usr/local/cuda/bin/nvdisasm"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def selected(name, readable, patterns):
    return not patterns or any(p.search(readable) or p.search(name) for p in patterns)


def format_counts(counts):
    return "  ".join("%s %d" % (op, n) for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def report(path, nvdisasm, patterns, modifiers, out, warn=None):
    data, text = disassemble(path, nvdisasm)
    texts = kernel_texts(data)
    kernels = parse_sass(text, warn)
    names = demangle(kernels.keys())
    shown = 0
    for kernel, insns in kernels.items():
        if not selected(kernel, names[kernel], patterns):
            continue
        shown += 1
        code, regs = texts.get(kernel, (b"", 0))
        undecoded = sum(1 for i in insns if i.opcode.startswith("?"))
        out.write("== %s\n   %d registers, %d instructions" % (names[kernel], regs, len(insns)))
        if undecoded:
            out.write(" (%d not decoded by this nvdisasm: counted as ?OPC, the encoding's low 12 bits)"
                      % undecoded)
        out.write("\n")
        if code and len(insns) * 16 != len(code) and warn:
            warn("%s: %d instructions read, the .text section holds %d"
                 % (names[kernel], len(insns), len(code) // 16))
        loops = find_loops(insns)
        if not loops:
            out.write("   no loops\n")
        for i, (start, end, edges) in enumerate(loops):
            depth = sum(1 for s, e, _n in loops if s <= start and end <= e and (s, e) != (start, end))
            counts = opcode_counts(insns, start, end, modifiers)
            out.write("   loop %d [0x%x, 0x%x] depth %d, %d back edge%s: %d instructions\n      %s\n"
                      % (i + 1, start, end, depth, edges, "" if edges == 1 else "s",
                         sum(counts.values()), format_counts(counts)))
    if shown == 0:
        out.write("no kernel matches\n")
    return shown


def compare(path_a, path_b, patterns, out, renames=()):
    """Pairs the two cubins' kernels by readable name (after `renames`, [(regex,
    replacement)], on the second cubin's names: a template that gained a
    defaulted parameter, say) and says which differ. Returns how many do."""
    texts = []
    for p in (path_a, path_b):
        with open(p, "rb") as f:
            data = f.read()
        cubin_arch(data)
        texts.append(kernel_texts(data))
    names = demangle(sorted(set(texts[0]) | set(texts[1])))
    a = {names[k]: v for k, v in texts[0].items()}
    b = {}
    for k, v in texts[1].items():
        readable = names[k]
        for pattern, repl in renames:
            readable = pattern.sub(repl, readable)
        if readable in b:
            raise CubinError("--rename maps two kernels of %s to %s" % (path_b, readable))
        b[readable] = v
    same = differ = 0
    for k in sorted(set(a) | set(b)):
        if not selected(k, k, patterns):
            continue
        if k not in a or k not in b:
            out.write("only in %s: %s\n" % (path_a if k in a else path_b, k))
            differ += 1
        elif a[k][0] != b[k][0]:
            out.write("differs (%d / %d bytes, %d / %d registers): %s\n"
                      % (len(a[k][0]), len(b[k][0]), a[k][1], b[k][1], k))
            differ += 1
        else:
            same += 1
    out.write("%d kernels identical, %d differ\n" % (same, differ))
    return differ


def main(argv):
    ap = argparse.ArgumentParser(
        description=__doc__,
        epilog="See the top of this file for how to make the cubin and get nvdisasm.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubin", nargs="+", help="the cubin (two with --compare)")
    ap.add_argument("--kernel", action="append", default=[], metavar="REGEX",
                    help="only kernels whose readable or mangled name matches (repeatable)")
    ap.add_argument("--modifiers", action="store_true",
                    help="count opcodes with their modifiers (IMMA.16832.U8.S8, not IMMA)")
    ap.add_argument("--nvdisasm", help="the disassembler (default: $NVDISASM, then PATH)")
    ap.add_argument("--compare", action="store_true",
                    help="compare the machine code of two cubins' kernels (needs no nvdisasm)")
    ap.add_argument("--rename", nargs=2, action="append", default=[], metavar=("REGEX", "REPL"),
                    help="with --compare: rewrite the second cubin's readable kernel names "
                         "(demangled by c++filt when it is on PATH) before pairing them "
                         "(repeatable), e.g. --rename '(SplitKernel<.*), false>\\(' '\\1>(' "
                         "for a template that gained a defaulted parameter")
    args = ap.parse_args(argv)
    try:
        patterns = [re.compile(p) for p in args.kernel]
        renames = [(re.compile(p), r) for p, r in args.rename]
    except re.error as e:
        ap.error("bad pattern: %s" % e)
    try:
        if args.compare:
            if len(args.cubin) != 2:
                ap.error("--compare takes two cubins")
            return 1 if compare(args.cubin[0], args.cubin[1], patterns, sys.stdout, renames) else 0
        if len(args.cubin) != 1:
            ap.error("one cubin (two only with --compare)")
        nvdisasm = find_nvdisasm(args.nvdisasm)
        if nvdisasm is None:
            sys.stderr.write("sass_loops: no nvdisasm found (--nvdisasm, $NVDISASM or PATH); "
                             "see --help's file for how to get CUDA 11.8's\n")
            return 2
        report(args.cubin[0], nvdisasm, patterns, args.modifiers, sys.stdout,
               warn=lambda msg: sys.stderr.write("sass_loops: warning: %s\n" % msg))
        return 0
    except (OSError, CubinError) as e:
        sys.stderr.write("sass_loops: %s\n" % e)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
