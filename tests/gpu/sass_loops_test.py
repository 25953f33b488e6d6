#!/usr/bin/env python3
"""Tests of sass_loops.py: the header rewrite, the ELF reading, the loop
finder on nvdisasm-shaped text, and (where nvcc and an nvdisasm are present)
a real cubin end to end."""

import io
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_loops  # noqa: E402


def elf_header(machine=190, abi=8, flags=0x6005A04):
    h = bytearray(64)
    h[:4] = b"\x7fELF"
    h[4], h[5], h[6], h[7], h[8] = 2, 1, 1, 0x41, abi
    struct.pack_into("<HHI", h, 16, 2, machine, 1)
    struct.pack_into("<I", h, 48, flags)
    return bytes(h)


def elf_with_sections(secs):
    """A minimal ELF64 (CUDA machine) holding `secs` [(name, sh_type, info, payload)]
    after a null section and .shstrtab."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n, _t, _i, _p in secs)
    body = bytearray()
    offsets = []
    base = 64
    for _n, _t, _i, payload in secs:
        offsets.append(base + len(body))
        body += payload
    str_off = base + len(body)
    body += names
    shoff = base + len(body)
    table = bytearray(64)  # null section
    name_at = len(b"\0.shstrtab\0")
    table += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, str_off, len(names), 0, 0, 1, 0)
    for (n, t, info, payload), off in zip(secs, offsets):
        table += struct.pack("<IIQQQQIIQQ", name_at, t, 0, 0, off, len(payload), 0, info, 1, 0)
        name_at += len(n) + 1
    h = bytearray(elf_header())
    struct.pack_into("<Q", h, 40, shoff)
    struct.pack_into("<HHH", h, 58, 64, 2 + len(secs), 1)
    return bytes(h) + bytes(body) + bytes(table)


def bra(addr, target, text):
    """A BRA line pair with the encoding of a jump from addr to target."""
    off = target - (addr + 16)
    hi = off >> 10
    w0 = 0x947 | (((off >> 2) & 0xFF) << 16) | ((hi & ((1 << 30) - 1)) << 34)
    w1 = ((hi >> 30) & ((1 << 18) - 1)) | 0x000FEA0000000000
    return insn(addr, text, w0, w1)


def insn(addr, text, w0=0x000000000000781C, w1=0x000FE20003F0E170):
    return ("        /*%04x*/                   %s ;   /* 0x%016x */\n"
            "                                                      /* 0x%016x */\n" % (addr, text, w0, w1))


def undecoded(w0, w1=0x000FD80000000000):
    return ("                                                      /* 0x%016x */\n"
            "                                                      /* 0x%016x */\n" % (w0, w1))


SASS = (
    '\t.headerflags\t@"EF_CUDA_SM90"\n'
    "//--------------------- .text._Z3twoPf --------------------------\n"
    '\t.section\t.text._Z3twoPf,"ax",@progbits\n'
    "_Z3twoPf:\n"
    + insn(0x00, "MOV R1, c[0x0][0x28]")
    + ".L_x_1:\n"
    + insn(0x10, "FFMA R2, R2, R3, R4")
    + ".L_x_2:\n"
    + insn(0x20, "IMMA.16832.U8.S8 R4, R8, R12, R4")
    + insn(0x30, "FFMA R2, R2, R3, R4")
    + bra(0x40, 0x20, "@P0 BRA `(.L_x_2)")
    + undecoded(0xFFFFFD00001E7836)  # 0x50: not decoded by CUDA 11.8's nvdisasm
    + bra(0x60, 0x10, "@!P1 BRA.U `(.L_x_1)")
    + bra(0x70, 0x90, "BRA `(.L_x_3)")
    + insn(0x80, "EXIT")
    + ".L_x_3:\n"
    + bra(0x90, 0x90, "BRA `(.L_x_3)")
    + "//--------------------- .text._Z3onePf --------------------------\n"
    '\t.section\t.text._Z3onePf,"ax",@progbits\n'
    + ".L_x_5:\n"
    + insn(0x00, "FADD R1, R1, R2")
    + bra(0x10, 0x00, "@P0 BRA `(.L_x_5)")
    + bra(0x20, 0x00, "@P1 BRA.DIV UR4, `(.L_x_5)")
    + insn(0x30, "EXIT")
    + ".L_x_4:\n"
    + bra(0x40, 0x40, "BRA `(.L_x_4)")
)


class HeaderTest(unittest.TestCase):
    def test_new_header_is_rewritten_to_the_old_form(self):
        data = elf_header() + b"code"
        self.assertEqual(sass_loops.cubin_arch(data), (8, 90))
        out = sass_loops.old_style_header(data)
        self.assertEqual(out[7], 0x33)
        self.assertEqual(out[8], 7)
        self.assertEqual(struct.unpack_from("<I", out, 48)[0], 0x5A055A)
        self.assertEqual(sass_loops.cubin_arch(out), (7, 90))
        self.assertEqual(out[64:], b"code")  # the rest untouched
        self.assertEqual(out[:7], data[:7])

    def test_old_header_goes_through_unchanged(self):
        data = elf_header(abi=7, flags=0x5A055A) + b"x"
        self.assertEqual(sass_loops.old_style_header(data), data)

    def test_refusals(self):
        with self.assertRaisesRegex(sass_loops.CubinError, "not a CUDA cubin"):
            sass_loops.cubin_arch(elf_header(machine=62))
        with self.assertRaisesRegex(sass_loops.CubinError, "not an ELF"):
            sass_loops.cubin_arch(b"\0" * 64)
        with self.assertRaisesRegex(sass_loops.CubinError, "ABI version 9"):
            sass_loops.cubin_arch(elf_header(abi=9))
        with self.assertRaisesRegex(sass_loops.CubinError, "sm_100"):
            sass_loops.old_style_header(elf_header(flags=(100 << 8) | 4))


class ElfTest(unittest.TestCase):
    def test_text_sections_and_register_counts(self):
        # .nv.info: an EIATTR_REGCOUNT record (symbol 5: 168 registers) after
        # a short one; the text section names symbol 5 in sh_info.
        info = (bytes([3, 0x1B, 0xFF, 0]) + bytes([2, 0x5F, 3, 0])  # 2-byte and 1-byte values
                + bytes([4, 0x2F]) + struct.pack("<HII", 8, 5, 168))
        data = elf_with_sections([(".nv.info", 0x70000000, 0, info),
                                  (".text._Z1kv", 1, 5, b"\x01\x02\x03\x04")])
        texts = sass_loops.kernel_texts(data)
        self.assertEqual(texts, {"_Z1kv": (b"\x01\x02\x03\x04", 168)})

    def test_truncated_file_is_refused(self):
        data = elf_with_sections([(".text._Z1kv", 1, 0, b"abcd")])
        with self.assertRaisesRegex(sass_loops.CubinError, "truncated"):
            sass_loops.kernel_texts(data[:-10])

    def test_compare(self):
        a = elf_with_sections([(".text._Z1av", 1, 0, b"aaaa"), (".text._Z1bv", 1, 0, b"bbbb")])
        b = elf_with_sections([(".text._Z1av", 1, 0, b"aaaa"), (".text._Z1bv", 1, 0, b"bbbc")])
        with tempfile.TemporaryDirectory() as d:
            pa, pb = os.path.join(d, "a.cubin"), os.path.join(d, "b.cubin")
            for path, blob in ((pa, a), (pb, b)):
                with open(path, "wb") as f:
                    f.write(blob)
            out = io.StringIO()
            self.assertEqual(sass_loops.compare(pa, pb, [], out), 1)
            self.assertIn("1 kernels identical, 1 differ", out.getvalue())
            self.assertIn("differs", out.getvalue())
            out = io.StringIO()
            self.assertEqual(sass_loops.compare(pa, pa, [], out), 0)
            # Renamed, the second cubin's kernel_v2 pairs with the first's kernel
            # (names c++filt leaves as they are).
            pc, pe = os.path.join(d, "c.cubin"), os.path.join(d, "e.cubin")
            for path, secs in ((pc, [(".text.kernel", 1, 0, b"kkkk")]),
                               (pe, [(".text.kernel_v2", 1, 0, b"kkkk"), (".text.other", 1, 0, b"o")])):
                with open(path, "wb") as f:
                    f.write(elf_with_sections(secs))
            out = io.StringIO()
            ren = [(re.compile("_v2$"), "")]
            self.assertEqual(sass_loops.compare(pc, pe, [re.compile("^kernel$")], out, ren), 0)
            self.assertIn("1 kernels identical, 0 differ", out.getvalue())
            with self.assertRaisesRegex(sass_loops.CubinError, "maps two kernels"):
                sass_loops.compare(pc, pe, [], io.StringIO(), [(re.compile(".*"), "same")])


class LoopTest(unittest.TestCase):
    def test_nested_loops_undecoded_instructions_and_the_trap_loop(self):
        kernels = sass_loops.parse_sass(SASS)
        self.assertEqual(list(kernels), ["_Z3twoPf", "_Z3onePf"])
        insns = kernels["_Z3twoPf"]
        self.assertEqual([i.addr for i in insns], [16 * k for k in range(10)])
        self.assertEqual(insns[5].opcode, "?836")
        # Targets from the encodings, the forward one and the one to itself too.
        self.assertEqual(insns[4].target, 0x20)
        self.assertEqual(insns[6].target, 0x10)
        self.assertEqual(insns[7].target, 0x90)
        self.assertEqual(insns[9].target, 0x90)
        # The outer loop (0x10..0x60) and the inner one (0x20..0x40); the
        # forward branch and the branch to itself are not loops.
        loops = sass_loops.find_loops(insns)
        self.assertEqual(loops, [(0x10, 0x60, 1), (0x20, 0x40, 1)])
        inner = sass_loops.opcode_counts(insns, 0x20, 0x40, False)
        self.assertEqual(inner, {"IMMA": 1, "FFMA": 1, "BRA": 1})
        outer = sass_loops.opcode_counts(insns, 0x10, 0x60, True)
        self.assertEqual(outer["IMMA.16832.U8.S8"], 1)
        self.assertEqual(outer["FFMA"], 2)
        self.assertEqual(outer["BRA.U"], 1)
        self.assertEqual(outer["?836"], 1)
        self.assertEqual(sum(outer.values()), 6)

    def test_two_back_edges_make_one_loop(self):
        kernels = sass_loops.parse_sass(SASS)
        self.assertEqual(sass_loops.find_loops(kernels["_Z3onePf"]), [(0x00, 0x20, 2)])

    def test_branch_offsets_both_ways(self):
        for addr, target in ((0x70, 0x480), (0x370, 0x110), (0x10, 0x123450), (0x900000, 0x20)):
            lines = bra(addr, target, "BRA `(.L_x_9)").splitlines()
            w0 = int(lines[0].split("0x")[-1].split()[0], 16)
            w1 = int(lines[1].split("0x")[-1].split()[0], 16)
            self.assertEqual(addr + 16 + sass_loops.branch_offset(w0, w1), target)
        # Two encodings nvdisasm printed, with their labels' addresses.
        self.assertEqual(0x70 + 16 + sass_loops.branch_offset(0x0000000400008947, 0x000FEA0003800000),
                         0x480)
        self.assertEqual(0x370 + 16 + sass_loops.branch_offset(0xFFFFFFFC00641947, 0x000FEC000383FFFF),
                         0x110)

    def test_a_label_far_from_the_encoded_target_is_reported(self):
        text = ('\t.section\t.text._Z1kv,"ax",@progbits\n' + ".L_x_7:\n" + insn(0x00, "NOP")
                + insn(0x10, "NOP") + insn(0x20, "NOP") + insn(0x30, "NOP")
                + bra(0x40, 0x30, "@P0 BRA `(.L_x_7)"))
        warnings = []
        kernels = sass_loops.parse_sass(text, warnings.append)
        self.assertEqual(len(warnings), 1)
        self.assertIn("encoded target 0x30, label 0x0", warnings[0])
        self.assertEqual(kernels["_Z1kv"][4].target, 0x00)  # the label wins


NVCC = "/usr/local/cuda/bin/nvcc"
KERNEL = r"""
__global__ void axpy_loop(float* y, const float* x, float a, int n) {
  for (int i = threadIdx.x; i < n; i += 32) y[i] = fmaf(a, x[i], y[i]);
}
"""


class RealCubinTest(unittest.TestCase):
    def test_a_compiled_loop_is_found(self):
        nvdisasm = sass_loops.find_nvdisasm(None)
        if not os.path.exists(NVCC) or nvdisasm is None:
            self.skipTest("needs %s and an nvdisasm (see sass_loops.py --help)" % NVCC)
        with tempfile.TemporaryDirectory() as d:
            src, cubin = os.path.join(d, "k.cu"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(KERNEL)
            subprocess.run([NVCC, "-O3", "-arch=sm_90", "-cubin", "-Xptxas", "-O3", "-o", cubin, src],
                           check=True, capture_output=True)
            out = io.StringIO()
            self.assertEqual(sass_loops.report(cubin, nvdisasm, [], False, out), 1)
            text = out.getvalue()
            self.assertIn("axpy_loop(float*, float const*, float, int)" if shutil.which("c++filt")
                          else "_Z9axpy_loop", text)
            self.assertRegex(text, r"\d+ registers")
            self.assertIn("loop 1", text)
            self.assertRegex(text, r"FFMA \d+")
            self.assertRegex(text, r"LDG \d+")


if __name__ == "__main__":
    unittest.main()
