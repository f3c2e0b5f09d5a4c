"""NVFP4 -> BF16 in registers on sm_90a, for the W4A16 GEMM's mainloop (no `cvt ... e2m1x2` there).

The weights come in the SM90 encoding of `cutedsl.sm90.weight` (documented there, with its
constants; `cutedsl.sm90.weight.decode_emulated` is the host model of these bit operations):
- one 32-bit word W holds 8 e2m1 codes as 4 bf16x2 pairs p = 0..3. Pair p is W rotated left by
  ROT[p] and masked with BF16X2_MASK: each code's sign lands on bit 15 (31) and its 3 magnitude bits
  e1 e0 m on bits 8..6 (24..22), the low exponent bits and the top mantissa bit of a bf16. That bf16
  is e2m1 · 2^-126 (code 1 = 0.5 is the bf16 subnormal 2^-127). Pair 3 takes e1 from a second
  rotation (no fourth disjoint rotation exists);
- a block scale is an 8-bit "e5m3" code (value 2^E (1 + m/8), code (E+10) << 3 | m); `prmt` with
  the constant byte 0x07 then `<< 4` gives the bf16 2^(E+107) (1 + m/8) = scale · 2^107 (a zero
  scale's 16 codes are stored as 0, so its bf16 image never matters);
- `mul.rn.bf16x2` of the two is exactly e2m1 · scale · 2^-19 (at most 6 significant bits, normal
  range); the epilogue multiplies by the global scale · 2^19 (DECODE_BIAS).
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from cutedsl.kernels.device_utils import asm_i32xn
from cutedsl.sm90.weight import BF16X2_MASK, MASK3, MASK3_E1, ROT, ROT3_E1, SCALE_HI


@dsl_user_op
def nvfp4x8_to_bf16x2x4(w: Int32, scales: Int32, *, loc=None, ip=None) -> tuple[Int32, ...]:
    """Decode one sm90-encoded word `w` of 8 e2m1 codes into 4 bf16x2 words (pair p = 0..3, low
    half = the lower K index) times their block scales: `scales` holds both blocks' scale images
    (`e5m3x4_to_bf16x2x2`), pairs 0-1 take its low half, pairs 2-3 its high half, each half
    broadcast in the multiply's operand (no instruction of its own in SASS). 9 integer ops and 4
    bf16x2 multiplies."""
    m = f"{BF16X2_MASK:#x}"
    text = (
        "{\n"
        ".reg .b32 t, u, sl, sh;\n"
        ".reg .b16 h0, h1;\n"
        "mov.b32 {h0, h1}, $5;\n"
        "mov.b32 sl, {h0, h0};\n"
        "mov.b32 sh, {h1, h1};\n"
        f"and.b32 t, $4, {m};\n"
        "mul.rn.bf16x2 $0, t, sl;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[1]};\n"
        f"and.b32 t, t, {m};\n"
        "mul.rn.bf16x2 $1, t, sl;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[2]};\n"
        f"and.b32 t, t, {m};\n"
        "mul.rn.bf16x2 $2, t, sh;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[3]};\n"
        f"shf.l.wrap.b32 u, $4, $4, {ROT3_E1};\n"
        f"and.b32 u, u, {MASK3_E1:#x};\n"
        f"lop3.b32 t, u, t, {MASK3:#x}, 0xF8;\n"
        "mul.rn.bf16x2 $3, t, sh;\n"
        "}"
    )
    return asm_i32xn(4, [w, scales], text, "r,r", loc=loc, ip=ip)


@dsl_user_op
def e5m3x4_to_bf16x2x2(s: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """The 4 e5m3 scale codes of `s` (bytes 0..3) as two bf16x2 words (codes 0, 1 and codes 2, 3;
    the lower code in the low half): (0x07 << 8 | code) << 4 is the bf16 image of scale · 2^107,
    and one `<< 4` shifts both halves (the low half's top nibble is 0)."""
    hi = SCALE_HI * 0x01010101
    text = (
        "{\n"
        ".reg .b32 k, t;\n"
        f"mov.b32 k, {hi:#x};\n"
        "prmt.b32 t, $2, k, 0x4140;\n"
        "shl.b32 $0, t, 4;\n"
        "prmt.b32 t, $2, k, 0x4342;\n"
        "shl.b32 $1, t, 4;\n"
        "}"
    )
    return asm_i32xn(2, [s], text, "r", loc=loc, ip=ip)
