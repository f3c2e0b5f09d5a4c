"""Device helpers shared by the CuTeDSL kernels (inline PTX through `llvm.inline_asm`).

Everything here is a `@dsl_user_op` on 32-bit integer registers, so the kernels can move raw bits
through shared memory and registers without CuTe layouts getting in the way.

NVFP4 -> BF16 on sm_90a (no `cvt ... e2m1x2` there, research/cutedsl.md §4b) uses the sm90 weight
encoding of `cutedsl.sm90` (documented there; `cutedsl.sm90.decode_emulated` is the host model of
the two functions below):
- one 32-bit word W holds 8 e2m1 codes as 4 bf16x2 pairs p = 0..3: the magnitudes of pair p in
  nibbles 2p / 2p+1 (bits 0-2), their signs at bits 15-4p / 31-4p (bit 3 of the nibbles);
- `prmt.b32` looks the 3-bit magnitudes up in an 8-entry byte table (two prmts give the high and
  the low bytes of 4 bf16 images, two more interleave them into 2 bf16x2 words), the signs land on
  bits 15/31 with one shift and one `lop3`; the table holds e2m1 · 2^117;
- a block scale is an 8-bit "e5m3" code (5-bit exponent biased so that every e4m3 value, the
  subnormal ones included, is a *normal* bf16 after `<< 4`): its bf16 image is scale · 2^-117;
- `mul.rn.bf16x2` of the two is exactly e2m1 · scale (at most 6 significant bits, normal range).
"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# bf16 images of e2m1 magnitude m = 0..7 times 2^117 (value 0, .5, 1, 1.5, 2, 3, 4, 6): high and low
# bytes, packed 4 per word for prmt (pool a = entries 0-3, b = entries 4-7). Derived and checked
# against the values in cutedsl.sm90 (E2M1_LUT_*); kept literal here so the PTX is readable.
LUT_HI_A = 0x7A7A7900
LUT_HI_B = 0x7B7B7A7A
LUT_LO_A = 0x40008000
LUT_LO_B = 0x4000C080


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


def _asm_i32xn(
    n: int, args: list, text: str, in_constraints: str, *, side_effects=False, loc=None, ip=None
) -> tuple[Int32, ...]:
    """Inline PTX with `n` 32-bit outputs ($0..$n-1) and 32-bit inputs ($n..)."""
    ops = [Int32(a).ir_value(loc=loc, ip=ip) for a in args]
    ty = ir.Type.parse("!llvm.struct<(" + ",".join(["i32"] * n) + ")>")
    cons = ",".join(["=r"] * n) + ("," + in_constraints if in_constraints else "")
    res = asm(ty, ops, text, cons, side_effects=side_effects, loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def nvfp4x8_to_bf16x2x4(
    w: Int32, scale_lo: Int32, scale_hi: Int32, *, loc=None, ip=None
) -> tuple[Int32, Int32, Int32, Int32]:
    """Decode one sm90-encoded word of 8 e2m1 codes into 4 bf16x2 words (pair p = 0..3, low half =
    the lower K index), pairs 0-1 times `scale_lo`, pairs 2-3 times `scale_hi` (bf16x2 scale words
    from `e5m3x4_to_bf16x2x4`)."""
    text = (
        "{\n"
        ".reg .b32 ha, hb, la, lb, sel, h, l, t, s;\n"
        f"mov.b32 ha, {LUT_HI_A};\n"
        f"mov.b32 hb, {LUT_HI_B};\n"
        f"mov.b32 la, {LUT_LO_A};\n"
        f"mov.b32 lb, {LUT_LO_B};\n"
        "and.b32 sel, $4, 0x7777;\n"
        "prmt.b32 h, ha, hb, sel;\n"
        "prmt.b32 l, la, lb, sel;\n"
        "prmt.b32 t, l, h, 0x5140;\n"
        "lop3.b32 t, t, $4, 0x80008000, 0xF8;\n"
        "mul.rn.bf16x2 $0, t, $5;\n"
        "prmt.b32 t, l, h, 0x7362;\n"
        "shl.b32 s, $4, 4;\n"
        "lop3.b32 t, t, s, 0x80008000, 0xF8;\n"
        "mul.rn.bf16x2 $1, t, $5;\n"
        "shr.b32 sel, $4, 16;\n"
        "and.b32 sel, sel, 0x7777;\n"
        "prmt.b32 h, ha, hb, sel;\n"
        "prmt.b32 l, la, lb, sel;\n"
        "prmt.b32 t, l, h, 0x5140;\n"
        "shl.b32 s, $4, 8;\n"
        "lop3.b32 t, t, s, 0x80008000, 0xF8;\n"
        "mul.rn.bf16x2 $2, t, $6;\n"
        "prmt.b32 t, l, h, 0x7362;\n"
        "shl.b32 s, $4, 12;\n"
        "lop3.b32 t, t, s, 0x80008000, 0xF8;\n"
        "mul.rn.bf16x2 $3, t, $6;\n"
        "}"
    )
    return _asm_i32xn(4, [w, scale_lo, scale_hi], text, "r,r,r", loc=loc, ip=ip)


@dsl_user_op
def e5m3x4_to_bf16x2x4(s: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """The 4 e5m3 scale codes (bytes 0..3 of `s`) as bf16x2 words, each code in both halves:
    code << 4 is the bf16 image of scale · 2^-117."""
    text = (
        "{\n"
        ".reg .b32 z, t;\n"
        "mov.b32 z, 0;\n"
        "prmt.b32 t, $4, z, 0x4040;\n"
        "shl.b32 $0, t, 4;\n"
        "prmt.b32 t, $4, z, 0x4141;\n"
        "shl.b32 $1, t, 4;\n"
        "prmt.b32 t, $4, z, 0x4242;\n"
        "shl.b32 $2, t, 4;\n"
        "prmt.b32 t, $4, z, 0x4343;\n"
        "shl.b32 $3, t, 4;\n"
        "}"
    )
    return _asm_i32xn(4, [s], text, "r", loc=loc, ip=ip)


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """32-bit load from a shared-memory byte address (4-byte aligned). Volatile (side effects), so
    it stays after the mbarrier wait that makes the data visible."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    return Int32(
        asm(T.i32(), ops, "ld.shared.b32 $0, [$1];", "=r,r", side_effects=True, loc=loc, ip=ip)
    )


@dsl_user_op
def ld_shared_v2_b32(addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """64-bit load (two 32-bit words) from a shared-memory byte address (8-byte aligned); volatile
    like `ld_shared_b32`."""
    return _asm_i32xn(
        2, [addr], "ld.shared.v2.b32 {$0, $1}, [$2];", "r", side_effects=True, loc=loc, ip=ip
    )
