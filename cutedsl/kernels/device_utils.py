"""Device helpers shared by the CuTeDSL kernels (inline PTX through `llvm.inline_asm`).

Everything here is a `@dsl_user_op` that takes and returns 32-bit integer registers, so the kernels
can move raw bits through shared memory without CuTe layouts getting in the way.

NVFP4 -> BF16 (sm_90a has no `cvt ... e2m1x2`, research/cutedsl.md §4b): a byte-permute LUT.
`prmt.b32` picks 4 bytes out of an 8-byte pool with 3-bit indices, so one prmt looks up the high
bytes and one the low bytes of the BF16 images of up to 4 e2m1 magnitudes {0,.5,1,1.5,2,3,4,6};
a third prmt interleaves them into a bf16x2 word and the sign bits are moved into bit 15/31 with
one integer multiply. The block scale (e4m3, exact in bf16) is applied with `mul.rn.bf16x2`; the
product of an e2m1 value and an e4m3 value has at most 6 significant bits, so it is exact in BF16.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# BF16 images of the e2m1 magnitudes 0..7: high bytes 00 3F 3F 3F 40 40 40 40, low bytes
# 00 00 80 C0 00 40 80 C0 (0x0000, 0x3F00=.5, 0x3F80=1, 0x3FC0=1.5, 0x4000=2, 0x4040=3, 0x4080=4,
# 0x40C0=6). prmt pool = {a: bytes 0-3, b: bytes 4-7}.
_LUT_HI_A = 0x3F3F3F00
_LUT_HI_B = 0x40404040
_LUT_LO_A = 0xC0800000
_LUT_LO_B = 0xC0804000


def asm(
    ret_type,
    operands: list,
    text: str,
    constraints: str,
    *,
    side_effects: bool = False,
    loc=None,
    ip=None,
):
    """One inline-PTX statement (AT&T dialect): `operands` are IR values, `ret_type` an IR type or
    None. The one place our kernels call `llvm.inline_asm`."""
    return llvm.inline_asm(
        ret_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _asm_i32(args: list, text: str, constraints: str, *, loc=None, ip=None) -> Int32:
    ops = [Int32(a).ir_value(loc=loc, ip=ip) for a in args]
    return Int32(asm(T.i32(), ops, text, constraints, loc=loc, ip=ip))


@dsl_user_op
def fp4x2_to_bf16x2_scaled(
    q: Int32, byte_idx: int, scale_bf16x2: Int32, *, loc=None, ip=None
) -> Int32:
    """Decode byte `byte_idx` (0..3, compile-time) of `q` = two e2m1 codes (low nibble = the element
    at the lower K index) into a bf16x2 word (low half = low nibble), each times `scale_bf16x2`."""
    sh = 8 * byte_idx
    text = (
        "{\n"
        ".reg .b32 x, t, h, l, s, ha, hb, la, lb;\n"
        f"shr.u32 x, $1, {sh};\n"
        "and.b32 t, x, 0x77;\n"
        f"mov.b32 ha, {_LUT_HI_A};\n"
        f"mov.b32 hb, {_LUT_HI_B};\n"
        f"mov.b32 la, {_LUT_LO_A};\n"
        f"mov.b32 lb, {_LUT_LO_B};\n"
        "prmt.b32 h, ha, hb, t;\n"
        "prmt.b32 l, la, lb, t;\n"
        "prmt.b32 t, l, h, 0x5140;\n"
        "and.b32 s, x, 0x88;\n"
        "mul.lo.u32 s, s, 0x01001000;\n"
        "and.b32 s, s, 0x80008000;\n"
        "or.b32 t, t, s;\n"
        "mul.rn.bf16x2 $0, t, $2;\n"
        "}"
    )
    return _asm_i32([q, scale_bf16x2], text, "=r,r,r", loc=loc, ip=ip)


@dsl_user_op
def e4m3_to_bf16x2(byte: Int32, *, loc=None, ip=None) -> Int32:
    """The e4m3 code in the low byte of `byte` as bf16, in both halves of a bf16x2 word (exact)."""
    text = (
        "{\n"
        ".reg .b16 c, h0, h1, b;\n"
        ".reg .b32 hh;\n"
        ".reg .f32 f;\n"
        "cvt.u16.u32 c, $1;\n"
        "and.b16 c, c, 0xFF;\n"
        "cvt.rn.f16x2.e4m3x2 hh, c;\n"
        "mov.b32 {h0, h1}, hh;\n"
        "cvt.f32.f16 f, h0;\n"
        "cvt.rn.bf16.f32 b, f;\n"
        "mov.b32 $0, {b, b};\n"
        "}"
    )
    return _asm_i32([byte], text, "=r,r", loc=loc, ip=ip)


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """32-bit load from a shared-memory byte address (4-byte aligned)."""
    return _asm_i32([addr], "ld.shared.b32 $0, [$1];", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def ld_shared_u8(addr: Int32, *, loc=None, ip=None) -> Int32:
    """One byte from a shared-memory byte address, zero-extended."""
    return _asm_i32([addr], "ld.shared.u8 $0, [$1];", "=r,r", loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4_b32(
    addr: Int32, v0: Int32, v1: Int32, v2: Int32, v3: Int32, *, loc=None, ip=None
) -> None:
    """16-byte store to a shared-memory byte address (16-byte aligned)."""
    asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, v0, v1, v2, v3)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
