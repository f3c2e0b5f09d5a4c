"""MoE routing and combine, SIMT CuTeDSL kernels (arch-agnostic: compiled for sm_90a and sm_100a).

Legend: M tokens, topk experts per token, T = M*topk assignments (j = m*topk + s), E experts
(E <= MAX_E), H hidden size.

Route (`MoeRouteKernel`, one CTA of THREADS threads looping over T):
  ids  (T,)         int32  topk_ids flattened; a value < 0 or >= E is "not local"
  offs (E+1,)       int32  out: offs[x] = #local assignments to experts < x (exclusive prefix sum of
                           the per-expert counts); offs[E] = number of local assignments
  tok  (T,)         int32  out: token of each sorted row. Rows [offs[x], offs[x+1]) hold the
                           assignments to expert x, rows [offs[E], T) the non-local ones: every
                           row is written, tok is a valid token index everywhere (a gather of
                           x[tok] never reads out of bounds)
  inv  (topk, M)    int32  out: inv[s, m] = the sorted row of assignment (m, s), -1 if not local
Phases: zero the shared counters; histogram (shared-memory atomics, warp-aggregated with
`match.any.sync`: one atomic per distinct expert per warp); block-wide exclusive scan of the E
counts (warp `shfl.sync.up` scans, then one warp scans the 32 warp totals); scatter, the counters
now cursors (again one aggregated atomic per expert per warp, lanes ranked by `%lanemask_lt`).
Non-local assignments share one extra bucket E whose cursor starts at offs[E].
The order of rows inside an expert is not stable (warps race for the cursor): GEMM rows are
independent, and the combine sums each token's contributions in slot order, so the MoE output is
still the same bit for bit on every run.

Combine (`MoeCombineKernel`, one CTA of COMBINE_THREADS threads per token and per
COMBINE_THREADS x VEC columns, VEC = 8 bf16 columns (16 B) per thread; the slots SLOTS at a time,
their index, weight and row loads issued before their sum, so a thread waits for about two
memory latencies per SLOTS slots, not two per slot):
  y    (R, H)       bf16   the expert outputs in sorted-row order (R >= every inv value); rows of
                           non-local assignments are never read (they may hold garbage)
  w    (M, topk)    fp32   topk_weights
  inv  (topk, M)    int32  from the route kernel
  out  (M, H)       bf16   out[m] = bf16( sum_{s = 0..topk-1, inv[s, m] >= 0} w[m, s] * y[inv[s, m]] )
The sum is fp32, in slot order s = 0, 1, ..., each step a separately rounded multiply and add
(`mul.rn.f32` then `add.rn.f32`: no FMA contraction), starting from +0. This is exactly the torch
statement `acc = acc + w[:, s, None] * y[inv[s]].float()` (`cutedsl.sm90.routing.combine` on the CPU), and it
has no atomics: deterministic.

Compile-time: nothing (THREADS, VEC, the arch). Runtime: T, M, topk, E, H, R (tensor extents),
pointers, stream (the TVM-FFI environment stream). One compile serves every routing and size.
Graph safety: no host sync; the route grid is one CTA, the combine grid is M x ceil(H / (VEC x
COMBINE_THREADS)) CTAs.
Constraints: 1 <= E <= MAX_E; H % 8 == 0; y and out 16-byte aligned with contiguous rows;
every tensor compact (row-major); T < 2**31.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.cutlass_dsl import T, dsl_user_op

from cutedsl.kernels.checks import KernelTarget
from cutedsl.kernels.device_utils import asm, f32_rn, warp_inclusive_scan

THREADS = 1024  # route: one CTA
WARPS = THREADS // 32
MAX_E = THREADS  # one expert count per thread in the scan
COMBINE_THREADS = 128
VEC = 8  # bf16 per 16-byte access
SLOTS = 8  # combine: slots whose loads are issued together (a topk <= 8 in one group)


# ------------------------------------------------------------------------------ device helpers


@dsl_user_op
def _match_any(v, *, loc=None, ip=None) -> Int32:
    """Mask of the lanes of this warp holding the same 32-bit value (all lanes must call)."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip)]
    return Int32(
        asm(
            T.i32(),
            ops,
            "match.any.sync.b32 $0, $1, 0xffffffff;",
            "=r,r",
            side_effects=True,
            loc=loc,
            ip=ip,
        )  # fmt: skip
    )


@dsl_user_op
def _lanemask_lt(*, loc=None, ip=None) -> Int32:
    """Bits of the lanes below this one."""
    return Int32(asm(T.i32(), [], "mov.u32 $0, %lanemask_lt;", "=r", loc=loc, ip=ip))


@dsl_user_op
def _lowest_lane(mask, *, loc=None, ip=None) -> Int32:
    """Index of the lowest set bit of a non-zero mask."""
    ops = [Int32(mask).ir_value(loc=loc, ip=ip)]
    text = "{\n.reg .b32 t;\nneg.s32 t, $1;\nand.b32 t, t, $1;\nbfind.u32 $0, t;\n}"
    return Int32(asm(T.i32(), ops, text, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def _popc(v, *, loc=None, ip=None) -> Int32:
    ops = [Int32(v).ir_value(loc=loc, ip=ip)]
    return Int32(asm(T.i32(), ops, "popc.b32 $0, $1;", "=r,r", loc=loc, ip=ip))


# ------------------------------------------------------------------------------ route


class MoeRouteKernel:
    """Group the T assignments by expert (see the module docstring). No codegen configuration."""

    @cute.jit
    def __call__(
        self,
        ids: cute.Tensor,  # (T,) int32
        offs: cute.Tensor,  # (E+1,) int32
        tok: cute.Tensor,  # (T,) int32
        inv: cute.Tensor,  # (topk, M) int32, row-major
        stream,
    ):
        @cute.struct
        class SharedStorage:
            cnt: cute.struct.MemRange[
                Int32, MAX_E + 1
            ]  # counts, then cursors (bucket E: non-local)
            wsum: cute.struct.MemRange[Int32, WARPS]

        self.shared_storage = SharedStorage
        self.kernel(ids, offs, tok, inv).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.jit
    def _key(self, ids: cute.Tensor, j: Int32, t: Int32, e: Int32) -> Int32:
        """Bucket of assignment j: its expert, E if not local, -1 past the end."""
        key = Int32(-1)
        if j < t:
            v = ids[j]
            key = e
            if v >= 0 and v < e:
                key = v
        return key

    @cute.kernel
    def kernel(self, ids: cute.Tensor, offs: cute.Tensor, tok: cute.Tensor, inv: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        t = ids.shape[0]
        e = offs.shape[0] - 1
        topk = inv.shape[0]

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        cnt = storage.cnt.get_tensor(cute.make_layout(MAX_E + 1))
        wsum = storage.wsum.get_tensor(cute.make_layout(WARPS))

        # ---- zero the counters
        for x in range(tidx, e + 1, THREADS):
            cnt[x] = Int32(0)
        cute.arch.barrier()

        # ---- histogram: one shared atomic per distinct bucket per warp
        for j0 in range(0, t, THREADS):
            key = self._key(ids, j0 + tidx, t, e)
            peers = _match_any(key)
            if key >= 0 and lane == _lowest_lane(peers):
                cute.arch.atomic_add((cnt.iterator + key).llvm_ptr, _popc(peers), scope="cta")
        cute.arch.barrier()

        # ---- exclusive scan of the E counts (one per thread)
        v = Int32(0)
        if tidx < e:
            v = cnt[tidx]
        incl = warp_inclusive_scan(v, lane)
        if lane == 31:
            wsum[warp] = incl
        cute.arch.barrier()
        if warp == 0:
            wsum[lane] = warp_inclusive_scan(wsum[lane], lane)  # inclusive warp totals
        cute.arch.barrier()
        base = Int32(0)
        if warp > 0:
            base = wsum[warp - 1]
        total = wsum[WARPS - 1]
        if tidx < e:  # each thread reads and rewrites only its own counter
            offs[tidx] = base + incl - v
            cnt[tidx] = base + incl - v
        if tidx == 0:
            offs[e] = total
            cnt[e] = total  # the non-local rows follow the local ones
        cute.arch.barrier()

        # ---- scatter: the leader of each bucket in the warp takes a block of rows
        lt = _lanemask_lt()
        for j0 in range(0, t, THREADS):
            j = j0 + tidx
            key = self._key(ids, j, t, e)
            peers = _match_any(key)
            leader = _lowest_lane(peers)
            first = Int32(0)
            if key >= 0 and lane == leader:
                first = cute.arch.atomic_add(
                    (cnt.iterator + key).llvm_ptr, _popc(peers), scope="cta"
                )
            first = cute.arch.shuffle_sync(first, leader)
            if key >= 0:
                row = first + _popc(peers & lt)
                m = j // topk
                tok[row] = m
                sr = row
                if key == e:
                    sr = Int32(-1)
                inv[(j - m * topk, m)] = sr


# ------------------------------------------------------------------------------ combine


class MoeCombineKernel:
    """out[m] = sum_s w[m, s] * y[inv[s, m]] in fp32, slot order (see the module docstring)."""

    @cute.jit
    def __call__(
        self,
        y: cute.Tensor,  # (R, H) bf16
        w: cute.Tensor,  # (M, topk) fp32
        inv: cute.Tensor,  # (topk, M) int32
        out: cute.Tensor,  # (M, H) bf16
        stream,
    ):
        m = out.shape[0]
        chunks = (out.shape[1] // VEC + COMBINE_THREADS - 1) // COMBINE_THREADS
        self.kernel(y, w, inv, out).launch(
            grid=[m, chunks, 1], block=[COMBINE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, y: cute.Tensor, w: cute.Tensor, inv: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, chunk, _ = cute.arch.block_idx()
        topk = inv.shape[0]
        c = chunk * COMBINE_THREADS + tidx  # this thread's 16-byte column vector
        if c < out.shape[1] // VEC:
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            acc.fill(0.0)
            ry = [
                cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
                for _ in range(SLOTS)
            ]
            for s0 in range(0, topk, SLOTS):
                # SLOTS slots at a time: their inv / w loads, then their row loads, all issued
                # before the sum (an invalid slot loads row 0 and is left out of the sum)
                rs, wts, ok = [], [], []
                for i in cutlass.range_constexpr(SLOTS):
                    s = cutlass.min(s0 + i, topk - 1)
                    r = inv[(s, row)]
                    rs.append(r)
                    wts.append(w[(row, s)])
                    ok.append((s0 + i < topk) & (r >= 0))
                for i in cutlass.range_constexpr(SLOTS):
                    r = cutlass.max(rs[i], 0)
                    cute.autovec_copy(cute.local_tile(y[(r, None)], (VEC,), (c,)), ry[i])
                for i in cutlass.range_constexpr(SLOTS):
                    if ok[i]:
                        yv = ry[i].load().to(Float32)
                        for j in cutlass.range_constexpr(VEC):
                            acc[j] = f32_rn("add", acc[j], f32_rn("mul", wts[i], yv[j]))
            ro = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
            ro.store(acc.load().to(cutlass.BFloat16))
            cute.autovec_copy(ro, cute.local_tile(out[(row, None)], (VEC,), (c,)))


# ------------------------------------------------------------------------------ compile


def _fake_route():
    s32 = cute.sym_int32
    t, e1, k, m = s32(symbol="T"), s32(symbol="E1"), s32(symbol="K"), s32(symbol="M")
    ids = make_fake_compact_tensor(Int32, (t,), assumed_align=4)
    offs = make_fake_compact_tensor(Int32, (e1,), assumed_align=4)
    tok = make_fake_compact_tensor(Int32, (t,), assumed_align=4)
    inv = make_fake_compact_tensor(Int32, (k, m), stride_order=(1, 0), assumed_align=4)
    return ids, offs, tok, inv, make_fake_stream(use_tvm_ffi_env_stream=True)


def _fake_combine():
    s32 = cute.sym_int32
    r, h, k, m = (
        s32(symbol="R"),
        s32(divisibility=VEC, symbol="H"),
        s32(symbol="K"),
        s32(symbol="M"),
    )
    y = make_fake_compact_tensor(cutlass.BFloat16, (r, h), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(Float32, (m, k), stride_order=(1, 0), assumed_align=4)
    inv = make_fake_compact_tensor(Int32, (k, m), stride_order=(1, 0), assumed_align=4)
    out = make_fake_compact_tensor(cutlass.BFloat16, (m, h), stride_order=(1, 0), assumed_align=16)
    return y, w, inv, out, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_route(*, no_jit_engine: bool = False) -> object:
    """cute.compile the route kernel from fake tensors (every extent dynamic; TVM-FFI, env stream)."""
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(MoeRouteKernel(), *_fake_route(), options="--enable-tvm-ffi", **kw)


def compile_combine(*, no_jit_engine: bool = False) -> object:
    """cute.compile the combine kernel from fake tensors (every extent dynamic; TVM-FFI, env stream)."""
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(MoeCombineKernel(), *_fake_combine(), options="--enable-tvm-ffi", **kw)


def check_targets() -> list[KernelTarget]:
    """Both kernels for both archs. Route: the warp match, the shared-memory atomics and the scan
    shuffles; combine: 16-byte loads/stores and the unfused fp32 multiply-add."""
    route_ptx = (r"match\.any\.sync\.b32", r"atom\.shared(\.cta)?\.add", r"shfl\.sync\.up",
                 r"shfl\.sync\.idx", r"lanemask_lt")  # fmt: skip
    combine_ptx = (r"ld\.global(\.\w+)*\.v4\.(b32|u32)", r"st\.global(\.\w+)*\.v4\.(b32|u32)",
                   r"mul\.rn\.f32", r"add\.rn\.f32")  # fmt: skip
    out = []
    for arch in ("sm_90a", "sm_100a"):
        out.append(KernelTarget(
            name=f"moe.route.{arch}", arch=arch,
            compile=lambda: compile_route(no_jit_engine=True),
            ptx_patterns=route_ptx, sass_patterns=(r"MATCH\.ANY", r"ATOMS\.(ADD|POPC\.INC)"),
        ))  # fmt: skip
        out.append(KernelTarget(
            name=f"moe.combine.{arch}", arch=arch,
            compile=lambda: compile_combine(no_jit_engine=True),
            ptx_patterns=combine_ptx, sass_patterns=(r"LDG\.E\.128", r"STG\.E\.128"),
        ))  # fmt: skip
    return out
