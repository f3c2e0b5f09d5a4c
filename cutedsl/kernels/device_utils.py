"""Device helpers shared by the CuTeDSL kernels (inline PTX through `llvm.inline_asm`).

Everything here is a `@dsl_user_op` on 32-bit integer registers, so the kernels can move raw bits
through shared memory and registers without CuTe layouts getting in the way; `warp_inclusive_scan`
is the one `cute.jit` helper (the routing kernel's and the MoE GEMM's scans).

NVFP4 -> BF16 on sm_90a (no `cvt ... e2m1x2` there, research/cutedsl.md §4b) uses the sm90 weight
encoding of `cutedsl.sm90` (documented there; `cutedsl.sm90.decode_emulated` is the host model of
the two functions below):
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
The kernel uses the `_s2` / `x2` forms: two scale images per word, each half broadcast in the
multiply's operand. They give the same products; the host model mirrors the one-scale forms and
a CPU test checks that the two forms' scale images agree.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

BF16X2_MASK = 0x81C081C0  # sign bit and 3 magnitude bits of each bf16 half
ROT = (0, 4, 10, 6)  # left rotation of pair p; pair 3 takes e1 (bits 8 / 24) from ROT3_E1 instead
ROT3_E1 = 14
MASK3 = 0x80C080C0  # pair 3: sign, e0, m from ROT[3]
MASK3_E1 = 0x01000100  # pair 3: e1 from ROT3_E1
SCALE_HI = 0x07  # prmt'd above each e5m3 code: exponent + 224 after << 4
DECODE_BIAS = 2.0**19  # e2m1 · scale = the decoded bf16 product · DECODE_BIAS


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
    """(One scale per word: kernels before 2026-12-03's `_s2` form, kept so A/B runs against
    them still build; `cutedsl.sm90.decode_emulated` models these bit operations.)
    Decode one sm90-encoded word of 8 e2m1 codes into 4 bf16x2 words (pair p = 0..3, low half =
    the lower K index), pairs 0-1 times `scale_lo`, pairs 2-3 times `scale_hi` (bf16x2 scale words
    from `e5m3x4_to_bf16x2x4`): 9 integer ops and 4 bf16x2 multiplies."""
    m = f"{BF16X2_MASK:#x}"
    text = (
        "{\n"
        ".reg .b32 t, u;\n"
        f"and.b32 t, $4, {m};\n"
        "mul.rn.bf16x2 $0, t, $5;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[1]};\n"
        f"and.b32 t, t, {m};\n"
        "mul.rn.bf16x2 $1, t, $5;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[2]};\n"
        f"and.b32 t, t, {m};\n"
        "mul.rn.bf16x2 $2, t, $6;\n"
        f"shf.l.wrap.b32 t, $4, $4, {ROT[3]};\n"
        f"shf.l.wrap.b32 u, $4, $4, {ROT3_E1};\n"
        f"and.b32 u, u, {MASK3_E1:#x};\n"
        f"lop3.b32 t, u, t, {MASK3:#x}, 0xF8;\n"  # u | (t & MASK3)
        "mul.rn.bf16x2 $3, t, $6;\n"
        "}"
    )
    return _asm_i32xn(4, [w, scale_lo, scale_hi], text, "r,r,r", loc=loc, ip=ip)


@dsl_user_op
def nvfp4x8_to_bf16x2x4_s2(w: Int32, scales: Int32, *, loc=None, ip=None) -> tuple[Int32, ...]:
    """`nvfp4x8_to_bf16x2x4` with both block scales in one bf16x2 word (`e5m3x4_to_bf16x2x2`):
    pairs 0-1 times its low half, pairs 2-3 times its high half, each half broadcast in the
    multiply's operand (no instruction of its own in SASS)."""
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
    return _asm_i32xn(4, [w, scales], text, "r,r", loc=loc, ip=ip)


@dsl_user_op
def e5m3x4_to_bf16x2x2(s: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """The 4 e5m3 scale codes of `s` as two bf16x2 words (codes 0, 1 and codes 2, 3; the lower
    code in the low half): the same bf16 images as `e5m3x4_to_bf16x2x4`, two per word (one
    `<< 4` shifts both halves: the low half's top nibble is 0)."""
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
    return _asm_i32xn(2, [s], text, "r", loc=loc, ip=ip)


@dsl_user_op
def e5m3x4_to_bf16x2x4(s: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """The 4 e5m3 scale codes (bytes 0..3 of `s`) as bf16x2 words, each code in both halves:
    (0x07 << 8 | code) << 4 is the bf16 image of scale · 2^107."""
    hi = SCALE_HI * 0x01010101
    text = (
        "{\n"
        ".reg .b32 k, t;\n"
        f"mov.b32 k, {hi:#x};\n"
        "prmt.b32 t, $4, k, 0x4040;\n"
        "shl.b32 $0, t, 4;\n"
        "prmt.b32 t, $4, k, 0x4141;\n"
        "shl.b32 $1, t, 4;\n"
        "prmt.b32 t, $4, k, 0x4242;\n"
        "shl.b32 $2, t, 4;\n"
        "prmt.b32 t, $4, k, 0x4343;\n"
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


def _vec(n: int) -> str:
    if n not in (1, 2, 4):
        raise ValueError(f"vector width {n}: expected 1, 2 or 4")
    return "" if n == 1 else f".v{n}"


def _regs(first: int, n: int) -> str:
    regs = ", ".join(f"${first + i}" for i in range(n))
    return regs if n == 1 else "{" + regs + "}"


@dsl_user_op
def st_shared_f32xn(addr: Int32, vals: tuple, *, loc=None, ip=None) -> None:
    """Store 1, 2 or 4 fp32 values to a shared-memory byte address (aligned to their size)."""
    n = len(vals)
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in vals]
    text = f"st.shared{_vec(n)}.f32 [$0], {_regs(1, n)};"
    asm(None, ops, text, "r" + ",f" * n, side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mapa_shared(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of byte `addr` of this CTA's shared memory in cluster CTA
    `rank` (the same offset in that CTA's window)."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)]
    text = "mapa.shared::cluster.u32 $0, $1, $2;"
    return Int32(asm(T.i32(), ops, text, "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def ld_shared_cluster_f32xn(addr: Int32, n: int, *, loc=None, ip=None) -> tuple[Float32, ...]:
    """Load 1, 2 or 4 fp32 values from a shared::cluster address (`mapa_shared`); volatile, so it
    stays after the cluster barrier that makes the data visible."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    text = f"ld.shared::cluster{_vec(n)}.f32 {_regs(0, n)}, [${n}];"
    cons = ",".join(["=f"] * n) + ",r"
    if n == 1:
        return (Float32(asm(T.f32(), ops, text, cons, side_effects=True, loc=loc, ip=ip)),)
    ty = ir.Type.parse("!llvm.struct<(" + ",".join(["f32"] * n) + ")>")
    res = asm(ty, ops, text, cons, side_effects=True, loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n))


@dsl_user_op
def cvt_bf16x2_f32(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded (RN) to one bf16x2 word, `lo` in the low half."""
    ops = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    text = "cvt.rn.bf16x2.f32 $0, $1, $2;"  # the first source goes to the upper half
    return Int32(asm(T.i32(), ops, text, "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def stmatrix_x4_trans(addr: Int32, words: tuple, *, loc=None, ip=None) -> None:
    """`stmatrix .x4 .trans`: word q of every lane is its (row lane / 4, columns 2 (lane % 4) + 0..1)
    bf16 pair of 8x8 matrix q; lane 8q + r gives the 16-byte-aligned shared address that receives
    column r of matrix q (its 8 rows, 16 contiguous bytes)."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    ops += [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    text = "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};"
    asm(None, ops, text, "r,r,r,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_v4_b32(addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """128-bit load (four 32-bit words) from a shared-memory byte address (16-byte aligned);
    volatile, so it stays after the barrier that makes the data visible."""
    return _asm_i32xn(
        4,
        [addr],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v4_b32(addr: Int64, words: tuple, *, loc=None, ip=None) -> None:
    """128-bit store of four 32-bit words to a global byte address (16-byte aligned)."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)]
    ops += [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    text = "st.global.v4.b32 [$0], {$1, $2, $3, $4};"
    asm(None, ops, text, "l,r,r,r,r", side_effects=True, loc=loc, ip=ip)


# mbarriers by 32-bit shared::cta address: computed once per CTA, so a pipeline step costs the
# mbarrier instruction and an address add (cutlass.pipeline re-derives each barrier's address from
# the CTA's shared window on every call).


@dsl_user_op
def mbar_wait(addr: Int32, parity: Int32, *, loc=None, ip=None) -> None:
    """Block until the phase of parity `parity` of the mbarrier at `addr` has completed
    (`try_wait.parity` loop; acquire: what the phase's arrivals and TMA bytes wrote is visible)."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)]
    text = (
        "{\n.reg .pred p;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
        "@!p bra LAB_WAIT;\n}"
    )
    asm(None, ops, text, "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_arrive(addr: Int32, *, loc=None, ip=None) -> None:
    """One arrival on the mbarrier at `addr` (release: this thread's prior accesses are done)."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    asm(None, ops, "mbarrier.arrive.shared::cta.b64 _, [$0];", "r", side_effects=True, loc=loc,
        ip=ip)  # fmt: skip


@dsl_user_op
def mbar_arrive_expect_tx(addr: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """One arrival on the mbarrier at `addr` that also expects `nbytes` of TMA transactions."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    text = f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {nbytes};"
    asm(None, ops, text, "r", side_effects=True, loc=loc, ip=ip)


@cute.jit
def warp_inclusive_scan(v: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum of `v` over the lanes of a warp (5 `shfl.sync.up` steps; all 32 lanes
    must take part)."""
    incl = v
    for d in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << d, mask_and_clamp=0)
        if lane >= (1 << d):
            incl = incl + up
    return incl
