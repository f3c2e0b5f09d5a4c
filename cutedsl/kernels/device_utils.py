"""Device helpers shared by the CuTeDSL kernels (inline PTX through `llvm.inline_asm`).

Everything here is a `@dsl_user_op` on 32-bit integer registers, so the kernels can move raw bits
through shared memory and registers without CuTe layouts getting in the way; `warp_inclusive_scan`
is the one `cute.jit` helper (a warp's inclusive prefix sum). The SM90 weight decode built on
`asm` lives with its kernel (`cutedsl.sm90.kernels.decode`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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


def asm_i32xn(
    n: int, args: list, text: str, in_constraints: str, *, side_effects=False, loc=None, ip=None
) -> tuple[Int32, ...]:
    """Inline PTX with `n` 32-bit outputs ($0..$n-1) and 32-bit inputs ($n..)."""
    ops = [Int32(a).ir_value(loc=loc, ip=ip) for a in args]
    ty = ir.Type.parse("!llvm.struct<(" + ",".join(["i32"] * n) + ")>")
    cons = ",".join(["=r"] * n) + ("," + in_constraints if in_constraints else "")
    res = asm(ty, ops, text, cons, side_effects=side_effects, loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n))


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
    return asm_i32xn(
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
def f32_rn(op: str, a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`op`.rn.f32 of a and b (op: mul, add or sub), rounded to nearest on its own: the explicit
    rounding keeps ptxas from contracting a product and a following add into one fma (PTX ISA,
    `mul`: "mul/add sequences with no rounding modifiers may be optimized to use fused-multiply-add
    instructions")."""
    if op not in ("mul", "add", "sub"):
        raise ValueError(f"f32_rn: op {op!r}: expected mul, add or sub")
    ops = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(asm(T.f32(), ops, f"{op}.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip))


@dsl_user_op
def cvt_bf16x2_f32(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded (RN) to one bf16x2 word, `lo` in the low half."""
    ops = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    text = "cvt.rn.bf16x2.f32 $0, $1, $2;"  # the first source goes to the upper half
    return Int32(asm(T.i32(), ops, text, "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def bf16_round(x: Float32, *, loc=None, ip=None) -> Float32:
    """x rounded (RN) to bf16 and widened back to fp32 (exact): the value a bf16 store of x and
    a later fp32 load of it give."""
    ops = [Float32(x).ir_value(loc=loc, ip=ip)]
    text = "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }"
    return Float32(asm(T.f32(), ops, text, "=f,f", loc=loc, ip=ip))


@dsl_user_op
def stmatrix_x2_trans(addr: Int32, words: tuple, *, loc=None, ip=None) -> None:
    """`stmatrix .x2 .trans`: `stmatrix_x4_trans` for two 8x8 matrices (lanes 0..15 give the
    addresses: lane 8q + r the one of column r of matrix q)."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    ops += [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    text = "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [$0], {$1, $2};"
    asm(None, ops, text, "r,r,r", side_effects=True, loc=loc, ip=ip)


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
    return asm_i32xn(
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
