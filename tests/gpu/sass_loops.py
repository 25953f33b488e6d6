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

What a loop is here: a branch (BRA, any predicate) to an address at or
before its own, excluding a branch to itself (the trap loop at a kernel's
end). Its body is [target, branch]; nested loops are listed each with their
own counts, inner ones inside the outer ones' counts.
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
        name, _stype, _flags, _addr, off, size, _link, info = struct.unpack_from("<IIQQQQII", data, base)
        if off + size > len(data) and _stype != 8:  # SHT_NOBITS takes no file space
            raise CubinError("truncated ELF file (a section past its end)")
        rows.append((name, off, size, info))
    str_off = rows[shstrndx][1]
    out = {}
    for name, off, size, info in rows:
        end = data.index(b"\0", str_off + name)
        out[data[str_off + name:end].decode("ascii", "replace")] = (off, size, info)
    return out


EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL, EIFMT_HVAL, EIFMT_BVAL = 4, 3, 2


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
            elif fmt == EIFMT_HVAL:
                p += 4
            else:
                p += 2
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
INSN_RE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$")
PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")
BRANCH_RE = re.compile(r"^BRA(\.[A-Z.]+)?\s+`\((\.L_x_\d+)\)")


def parse_sass(text):
    """{kernel: [(address, opcode with modifiers, branch target label or None)],
    label addresses} from nvdisasm's output."""
    kernels = collections.OrderedDict()
    labels = {}
    current = None
    pending = []
    for line in text.splitlines():
        m = SECTION_RE.match(line)
        if m:
            current = m.group(1)
            kernels[current] = []
            pending = []
            continue
        if current is None:
            continue
        m = LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSN_RE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        body = PRED_RE.sub("", m.group(2).strip())
        if not body:
            continue
        for label in pending:
            labels[(current, label)] = addr
        pending = []
        opcode = body.split()[0].rstrip(";")
        b = BRANCH_RE.match(body)
        kernels[current].append((addr, opcode, b.group(2) if b else None))
    return kernels, labels


def find_loops(kernel, insns, labels):
    """[(start, end)] address ranges of the loops of one kernel, by start."""
    loops = set()
    for addr, _op, target in insns:
        if target is None:
            continue
        dest = labels.get((kernel, target))
        if dest is not None and dest < addr:
            loops.add((dest, addr))
    return sorted(loops, key=lambda r: (r[0], -r[1]))


def opcode_counts(insns, start, end, modifiers):
    counts = collections.Counter()
    for addr, op, _t in insns:
        if start <= addr <= end:
            counts[op if modifiers else op.split(".")[0]] += 1
    return counts


def disassemble(path, nvdisasm):
    with open(path, "rb") as f:
        data = f.read()
    fixed = old_style_header(data)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(fixed)
        tmp.flush()
        res = subprocess.run([nvdisasm, "-c", tmp.name], capture_output=True, text=True)
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


def report(path, nvdisasm, patterns, modifiers, out):
    data, text = disassemble(path, nvdisasm)
    regs = {k: r for k, (_b, r) in kernel_texts(data).items()}
    kernels, labels = parse_sass(text)
    names = demangle(kernels.keys())
    shown = 0
    for kernel, insns in kernels.items():
        if not selected(kernel, names[kernel], patterns):
            continue
        shown += 1
        out.write("== %s\n   %d registers, %d instructions\n" % (names[kernel], regs.get(kernel, 0), len(insns)))
        loops = find_loops(kernel, insns, labels)
        if not loops:
            out.write("   no loops\n")
        for i, (start, end) in enumerate(loops):
            depth = sum(1 for s, e in loops if s <= start and end <= e and (s, e) != (start, end))
            counts = opcode_counts(insns, start, end, modifiers)
            out.write("   loop %d [0x%x, 0x%x] depth %d: %d instructions\n      %s\n"
                      % (i + 1, start, end, depth, sum(counts.values()), format_counts(counts)))
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
                         "before pairing them (repeatable), e.g. --rename '(SplitKernel<.*), false>\\(' '\\1>(' "
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
        report(args.cubin[0], nvdisasm, patterns, args.modifiers, sys.stdout)
        return 0
    except (OSError, CubinError) as e:
        sys.stderr.write("sass_loops: %s\n" % e)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
