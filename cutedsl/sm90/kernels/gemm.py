"""Hopper (sm_90a) NVFP4 W4A16 GEMM family: NVFP4 weights dequantized to BF16 in the mainloop.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), L weight groups
(G o-proj groups or E experts; 1 for a dense linear).

Math (per group l):  out[l][m, n] = gs[l] * sum_k a[l][m, k] * (e2m1(w[l][n, k]) * sf[l][n, k // 16])
  a   (M, K, L)    bf16, K-major (token and group strides: any multiples of 8)   activations
  w   (N, K/2, L)  uint8, K-major, the sm90 weight encoding (cutedsl.sm90.weight)
  sf  (N, K/64, L) int32, N-major, 4 e5m3 block-scale codes per word (same docstring)
  gs  (L,)         fp32 global scale (weight_scale_2), applied in the epilogue
  out (N, M, L)    bf16, N-major (token and group strides: any multiples of 8), e.g. a view of
                   a row-major (L, M, N) or (M, L, N) tensor
Split-K (split_k = S > 1): the S CTAs of one output tile are one thread-block cluster (1, 1, S)
along grid.z; each parks its fp32 accumulators in its own shared memory, and after a cluster
barrier CTA s sums slice s of the tile over the S partials through distributed shared memory, in
split order (deterministic), and writes `out`. No global scratch, no counters, no atomics.
MoE mode (`moe=True`): a is (T, K, 1) with the rows of expert e at [offs[e], offs[e+1]) (offs int32
(E+1,) on the device), out is (N, T, 1). The m tiles of all experts are numbered in expert order
(expert e has ceil(rows_e / tile_m) of them); grid.y = min(E, T) + T // tile_m bounds their count,
and CTA y finds its tile y (`moe_tile`: an exclusive scan of the per-expert tile counts over the
CTA's threads) or, past the last tile, exits. Routing never reaches the host, and a decode launch
has no CTA per empty expert (E = 256, T = 96, tile_m 16: 102 CTA rows, not 512).

Swap-AB: the dequantized weights are the WGMMA "A" operand (64 weight rows per warpgroup, the M side
of the instruction) and the tokens are the "B" operand (the N side, 16..256 wide), so a decode
batch of one token wastes nothing but an N=tile_m instruction column block. Accumulators hold
out^T tiles (tile_n weight rows x tile_m tokens).

Register-A (RS) WGMMA: each thread dequantizes exactly the weights of its own A fragment (2 rows x
16 K values per 64-wide K tile: two 8-byte words and two scale words from shared memory) straight
into registers, so dequantized weights never touch shared memory and no barrier separates the
dequantization from the MMA. The fragments are double-buffered: while the WGMMAs of K tile k run,
the threads decode tile k+1 into the other fragment. The K loop is unrolled by whole passes over
the ring, so every stage index, barrier and shared-memory offset and the fragment choice are
compile-time, and each bf16x2 scale word carries two block scales (the multiplies broadcast its
halves as operands; `decode`).

Per CTA (one tile_n x tile_m output tile, one K split, one group), 2*tile_n consumer threads
(tile_n / 64 warpgroups) and, for the decode tiles, one producer warp:
  - the producer warp (`_produce`; without one, warp 0 between its steps) issues TMA loads per
    64-wide K tile: bf16 activations (128B-swizzled, WGMMA layout),
    encoded weight bytes (tile_n x 32 B) and scale words (tile_n x 4 B) into a `stages` ring.
    Each barrier stage (k_per_stage = 2 ring stages for the 128x16 decode tiles, so one wait and
    one release per two K tiles; else 1) has a full and an empty mbarrier, driven by their
    shared::cta addresses (device_utils.mbar_*; the stage index is compile-time in the unrolled
    loop, the phase a loop-carried integer), not cutlass.pipeline's PipelineTmaAsync, which
    re-derives each barrier's address per call.
  - every warpgroup issues 4 RS-WGMMA (64 x tile_m x 16) per K tile and keeps one group in flight.
  - epilogue: acc * gs -> bf16, predicated on the token count. Unsplit dense / grouped tiles
    stage the bf16 tile in the idle ring (`_staged_epilogue`: stmatrix, then 16-byte stores of
    whole token rows; split-K 2: each CTA its token slice, see `_splitk_reduce`). MoE tiles do
    too; split-K 4 / 8 store from registers (measured faster there).
  - the ring is as deep as lets two CTAs share an SM where registers allow (`_compute_stages`).

Fused SwiGLU (`swiglu=True`, unsplit tiles with the staged epilogue; the routed w13): w holds w13
in `cutedsl.sm90.weight.swiglu_row_order` (each 16-row group: 8 gate rows, then the 8 up rows of
the same output columns), out is (N/2, M, L), and out[i] = bf16(swiglu_clamp_f32(g, u, L)) with
g, u = the GEMM's gate and up outputs rounded to bf16: the bits of the unfused GEMM followed by
`cutedsl.sm90.kernels.swiglu` (`_swiglu_epilogue`).

Compile-time: tile_n (64|128), tile_m (16..256, multiple of 8), split_k (1..8, dividing tile_m/2;
dense / grouped only), moe, dtypes, stages, swiglu and its limit (a float > 0 or None).
Runtime: M (or T), the group count, the token and group strides of a and out, offs, pointers,
stream.
Graph safety: no host sync; the grid depends on M/T, N, split_k and L only.
Constraints: N % tile_n == 0, K % (64 * split_k) == 0, K % 64 == 0.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cutedsl.kernels import device_utils as du
from cutedsl.kernels.checks import KernelTarget
from cutedsl.sm90.kernels import decode as dec
from cutedsl.sm90.kernels.swiglu import swiglu_clamp_f32
from cutedsl.sm90.weight import DECODE_BIAS

BK = 64  # logical K per pipeline stage (one 128-byte swizzle atom of bf16)
MAX_SPLIT_K = 8  # a split-K cluster is at most the portable cluster size
SMEM_CAPACITY = 232448  # sm_90 dynamic smem per CTA (227 KiB)


def moe_grid_y(rows, experts, tile_m, min_fn=min):
    """The MoE grid.y: every expert's m tiles, numbered in expert order, number at most
    sum_e ceil(rows_e / tile_m) <= (experts with rows) + rows // tile_m <= min(E, rows) +
    rows // tile_m. `min_fn` is `cutlass.min` in the kernel (the host copy is
    `cutedsl.sm90.tactics.moe_tile_bound`; a CPU test keeps the two equal)."""
    return min_fn(experts, rows) + rows // tile_m


@cute.jit
def moe_tile(mOffs, z, tidx, sched, threads: cutlass.Constexpr, tile_m: cutlass.Constexpr):
    """(expert, m tile) of MoE tile z of a CTA of `threads` threads, in m tiles of `tile_m` rows,
    or (-1, 0) past the last tile. Thread t counts the m tiles of experts [t * per, (t + 1) * per)
    (per = ceil(E / threads)); an exclusive scan of those counts over the CTA (warp `shfl.up`
    scans, warp totals in `sched`: threads / 32 + 2 shared Int32) tells the one thread whose
    experts hold tile z, which walks them and posts the answer at sched[warps], sched[warps + 1].
    Every thread takes part (two CTA barriers)."""
    warps = threads // 32
    lane = tidx % 32
    warp = tidx // 32
    num_e = cute.size(mOffs, mode=[0]) - 1
    per = (num_e + threads - 1) // threads
    e0 = tidx * per
    own = cutlass.Int32(0)
    for i in cutlass.range(per, unroll=1):
        if e0 + i < num_e:
            own += (mOffs[e0 + i + 1] - mOffs[e0 + i] + tile_m - 1) // tile_m
    incl = du.warp_inclusive_scan(own, lane)
    if lane == 31:
        sched[warp] = incl
    if tidx == 0:
        sched[warps] = cutlass.Int32(-1)
    cute.arch.barrier()
    first = incl - own  # exclusive prefix of this thread's tiles
    for w in cutlass.range_constexpr(warps - 1):
        if w < warp:
            first += sched[w]
    if first <= z and z < first + own:
        for i in cutlass.range(per, unroll=1):
            e = e0 + i
            if e < num_e:
                cnt = (mOffs[e + 1] - mOffs[e] + tile_m - 1) // tile_m
                if first <= z and z < first + cnt:
                    sched[warps] = e
                    sched[warps + 1] = z - first
                first += cnt
    cute.arch.barrier()
    grp = sched[warps]
    m_tile = cutlass.Int32(0)
    if grp >= 0:
        m_tile = sched[warps + 1]
    return grp, m_tile


class Sm90Nvfp4W4A16GemmKernel:
    """W4A16 NVFP4 grouped GEMM for sm_90a. `__init__` takes codegen configuration only."""

    def __init__(
        self,
        tile_n: int = 128,
        tile_m: int = 64,
        split_k: int = 1,
        moe: bool = False,
        stages: int | None = None,
        staged_epilogue: bool | None = None,
        producer: bool | None = None,
        k_per_stage: int | None = None,
        swiglu: bool = False,
        swiglu_limit: float | None = None,
    ):
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128, got {tile_n}")
        if tile_m % 8 != 0 or not 8 <= tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {tile_m}")
        err = self.split_error(tile_m, split_k, moe)
        if err:
            raise ValueError(err)
        self.tile_n = tile_n
        self.tile_m = tile_m
        self.split_k = split_k
        self.moe = moe
        self.num_wg = tile_n // 64
        self.consumers = 128 * self.num_wg  # the warpgroups that dequantize and run WGMMA
        # A producer warp (the last) issues the TMA loads; without it warp 0 refills the ring
        # between its steps, waiting for the slowest warp's release, and its warpgroup waits for
        # it. The extra warp costs a CTA per SM where registers bound the CTAs: by default it is
        # on where it did not (H200 2026-12-03: routed decode 1.03-1.08x, dense decode up to
        # 1.09x, outputs bit-identical) and off for
        # 128x32 (74 registers: 3 CTAs of 256 threads per SM, 2 of 288; 0.90-0.92x) and the
        # prefill tiles (128x128: 122 registers, one CTA per SM instead of two).
        if producer is None:
            producer = tile_m == 16 or (tile_m == 32 and tile_n == 64)
        self.producer = producer
        self.load_warp = self.consumers // 32 if self.producer else 0
        self.threads = self.consumers + (32 if self.producer else 0)
        self.stages = stages if stages is not None else self._compute_stages(tile_n, tile_m)
        if self.stages < 2:  # step kt waits for tile kt+1 before it refills a stage
            raise ValueError(f"the ring needs >= 2 stages, got {self.stages}")
        # K tiles per barrier stage: with 2, one full / empty barrier pair covers two K tiles of
        # the ring (one wait and one release per two K tiles); the producer warp loads them. By
        # default only on 128x16, where it measured faster (H200 2026-12-03: routed decode
        # 1.02-1.04x, wq_b up to 1.03x, bit-identical); on the 64-row decode tiles it was
        # mixed (0.98-1.02x: the split-K CTAs' short K loops refill in coarser steps).
        if k_per_stage is None:
            k_per_stage = 2 if (tile_n, tile_m) == (128, 16) and self.producer else 1
        kps = k_per_stage
        if kps not in (1, 2) or self.stages % kps or self.stages // kps < 2:
            raise ValueError(
                f"k_per_stage must be 1 or 2 and split {self.stages} stages into >= 2, got {kps}"
            )
        if kps > 1 and not self.producer:
            raise ValueError("k_per_stage 2 needs the producer warp")
        self.kps = kps
        self.groups = self.stages // kps  # barrier stages
        # Split-K parks the fp32 tile (4 * tile_n * tile_m bytes) in the activation ring.
        if split_k > 1 and self.stages * tile_m * BK * 2 < 4 * tile_n * tile_m:
            raise ValueError(f"split-K needs >= {tile_n // 32} stages, got {self.stages}")
        # The bf16 tile can go out through shared memory (stmatrix, then 16-byte stores of whole
        # token rows) for tiles of a multiple of 16 tokens, or split-K token slices of a
        # multiple of 16 whose staging fits the ring beside the parked fp32 tile.
        # Fused SwiGLU: the tile's rows are (gate, up) pairs of 8-row groups and it stores
        # tile_n / 2 output columns (`_swiglu_epilogue`).
        self.out_cols = tile_n // 2 if swiglu else tile_n
        # Bytes per staged token row: the 8 rows of one `stmatrix` and the 8 lanes of one 16-byte
        # read then hit distinct banks.
        self.pitch = self.out_cols * 2 + 16
        self.stage_off = 0 if split_k == 1 else 4 * tile_n * tile_m  # past the parked tile
        staged_ok = (
            tile_m % (16 * split_k) == 0
            and self.stage_off + tile_m // split_k * self.pitch <= self.stages * tile_m * BK * 2
        )
        # By default only where it measured faster than the register stores (H200 2026-12-03):
        # unsplit, MoE, and split-K 2 (1.01-1.07x). With
        # 4 or 8 splits each CTA's slice is small and the extra CTA barrier and shared-memory pass
        # cost more than they save (0.85-0.98x).
        default = staged_ok and split_k <= 2
        self.staged_epilogue = default if staged_epilogue is None else staged_epilogue
        if self.staged_epilogue and not staged_ok:
            raise ValueError(
                "the staged epilogue needs tile_m % (16 * split_k) == 0 and room in the "
                f"ring for {tile_m // split_k} token rows of {self.pitch} B"
                + (" beside the parked fp32 tile" if split_k > 1 else "")
            )
        if swiglu_limit is not None and not (swiglu and swiglu_limit > 0):
            raise ValueError(f"swiglu_limit {swiglu_limit}: needs swiglu=True and a limit > 0")
        if swiglu and (split_k != 1 or not self.staged_epilogue):
            raise ValueError(
                "the fused SwiGLU needs an unsplit tile with the staged epilogue "
                f"(tile_m % 16 == 0), got tile_m {tile_m}, split_k {split_k}, "
                f"staged_epilogue {self.staged_epilogue}"
            )
        self.swiglu = swiglu
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.buffer_align_bytes = 1024

    @staticmethod
    def _stage_bytes(tile_n: int, tile_m: int) -> int:
        """Bytes of one ring stage (= one stage's TMA transaction): bf16 activations, encoded
        weight bytes, scale words."""
        return tile_m * BK * 2 + tile_n * BK // 2 + tile_n * 4

    @staticmethod
    def _compute_stages(tile_n: int, tile_m: int) -> int:
        """The deepest ring (<= 8 stages) with which two CTAs share an SM, where their registers
        allow it (tile_n 64, or tile_m <= 128: <= 128 registers for 256 threads) and it keeps >= 4
        stages; else the deepest ring that fits. H200 2026-12-03:
        128x128 with 5 stages (two CTAs) is 1.23x faster than with 8 (one) on wq_b at M = 128 and
        1024, and never slower; 64x256 with 3 stages (two CTAs) is 1.15x faster at M = 4096 but
        1.18x slower at M = 256 (a small grid wants depth), hence the >= 4."""
        per_stage = Sm90Nvfp4W4A16GemmKernel._stage_bytes(tile_n, tile_m)
        deepest = max(2, min(8, (SMEM_CAPACITY - 2048) // per_stage))
        shared = min(8, (SMEM_CAPACITY // 2 - 2048) // per_stage)
        if (tile_n == 64 or tile_m <= 128) and shared >= 4:
            return shared
        return deepest

    @staticmethod
    def split_error(tile_m: int, split_k: int, moe: bool) -> str | None:
        """Why the kernel refuses this K split (None if it takes it): a split-K cluster has at
        most MAX_SPLIT_K CTAs, each reducing an equal share of every thread's tile_m / 2
        accumulators, and the MoE never splits."""
        if split_k < 1 or split_k > MAX_SPLIT_K or (tile_m // 2) % split_k:
            return (
                f"split_k must be 1..{MAX_SPLIT_K} and divide tile_m/2 = {tile_m // 2}, "
                f"got {split_k}"
            )
        if moe and split_k != 1:
            return "split-K is for dense / grouped GEMMs, not the MoE"
        return None

    @staticmethod
    def can_implement(n: int, k: int, tile_n: int, split_k: int) -> bool:
        """GPU-free shape check (M is free; the tile's own limits are checked in __init__)."""
        return n % tile_n == 0 and k % BK == 0 and (k // BK) % split_k == 0 and n > 0 and k > 0

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L) bf16 K-major; MoE: (T, K, 1)
        w: cute.Tensor,  # (N, K/2, L) uint8 K-major (sm90 encoding)
        sf: cute.Tensor,  # (N, K/64, L) int32 N-major (e5m3 x 4)
        gs: cute.Tensor,  # (L,) fp32
        out: cute.Tensor,  # (N, M, L) bf16, N-major; MoE: (N, T, 1)
        offs: cute.Tensor,  # (E+1,) int32 expert row starts (MoE); ignored otherwise
        stream: cuda.CUstream,
    ):
        self.out_dtype = out.element_type
        rowmajor = utils.LayoutEnum.ROW_MAJOR
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            rowmajor.sm90_mma_major_mode(),
            rowmajor.sm90_mma_major_mode(),
            cutlass.Float32,
            (self.num_wg, 1, 1),
            tiler_mn=(64, self.tile_m),
            a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
        )
        tile_mnk = (self.tile_n, self.tile_m, BK)
        # Activations: K-major SW128 ring (MMA operand B), written by TMA.
        self.sa_layout = sm90_utils.make_smem_layout_b(
            rowmajor, tile_mnk, cutlass.BFloat16, self.stages
        )
        # Encoded weights (row-major bytes) and scale words (N-major), plain layouts.
        self.sq_layout = cute.make_layout(
            (self.tile_n, BK // 2, self.stages),
            stride=(BK // 2, 1, self.tile_n * BK // 2),
        )
        self.ss_layout = cute.make_layout(
            (self.tile_n, 1, self.stages), stride=(1, self.tile_n, self.tile_n)
        )
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(self.sa_layout, (None, None, 0)), (self.tile_m, BK)
        )
        tma_q, mQ = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s,
            w,
            cute.slice_(self.sq_layout, (None, None, 0)),
            (self.tile_n, BK // 2),
        )
        tma_s, mS = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, sf, cute.slice_(self.ss_layout, (None, None, 0)), (self.tile_n, 1)
        )
        self.tx_bytes = self._stage_bytes(self.tile_n, self.tile_m)

        n_tiles = cute.size(w, mode=[0]) // self.tile_n
        m_tiles = (cute.size(a, mode=[0]) + self.tile_m - 1) // self.tile_m
        groups = cute.size(w, mode=[2])
        grid = (n_tiles, m_tiles, groups * self.split_k)
        if cutlass.const_expr(self.moe):
            rows_t = cute.size(a, mode=[0])
            grid = (n_tiles, moe_grid_y(rows_t, groups, self.tile_m, cutlass.min), 1)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.groups * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.sa_layout)],
                self.buffer_align_bytes,
            ]
            sQ: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sq_layout)], 128
            ]
            sS: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int32, cute.cosize(self.ss_layout)], 128
            ]
            sched: cute.struct.MemRange[cutlass.Int32, self.threads // 32 + 2]  # `moe_tile`

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a,
            mA,
            tma_q,
            mQ,
            tma_s,
            mS,
            gs,
            out,
            offs,
            self.tiled_mma,
            self.sa_layout,
            self.sq_layout,
            self.ss_layout,
        ).launch(
            grid=grid,
            block=[self.threads, 1, 1],
            cluster=[1, 1, self.split_k] if self.split_k > 1 else None,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_s: cute.CopyAtom,
        mS: cute.Tensor,
        mGS: cute.Tensor,
        mC: cute.Tensor,
        mOffs: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sq_layout: cute.Layout,
        ss_layout: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, bidz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tile = bidx
        m_tile = bidy
        grp = bidz // self.split_k
        split = bidz % self.split_k
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sQ = storage.sQ.get_tensor(sq_layout)
        sS = storage.sS.get_tensor(ss_layout)
        sQ_addr = storage.sQ.data_ptr().toint()
        sS_addr = storage.sS.data_ptr().toint()
        park = storage.sA.data_ptr().toint()  # split-K: the fp32 tile, after the mainloop
        sched = storage.sched.get_tensor(cute.make_layout(self.threads // 32 + 2))

        # ---------------------------------------------------------------- rows of this CTA
        row_start = cutlass.Int32(0)
        rows = cutlass.Int32(cute.size(mA, mode=[0]))
        act_l = grp
        has_tile = cutlass.Boolean(True)  # dense / grouped: every CTA has its tile
        if cutlass.const_expr(self.moe):
            grp, m_tile = moe_tile(mOffs, bidy, tidx, sched, self.threads, self.tile_m)
            has_tile = grp >= 0
            act_l = 0
            if has_tile:
                row_start = mOffs[grp]
                rows = mOffs[grp + 1] - row_start

        if has_tile:
            if warp_idx == self.load_warp:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_q)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_s)

            # ------------------------------------------------------------ pipeline barriers
            # Barrier stage g = ring stages [g * kps, (g + 1) * kps): full[g] (1 arrival + the
            # TMA bytes) at full + 8 g; empty[g] (one arrival per consumer warp once it is done
            # with the stages) at empty + 8 g.
            full = mbar.toint()
            empty = full + 8 * self.groups
            if tidx == 0:
                for st in cutlass.range_constexpr(self.groups):
                    cute.arch.mbarrier_init(mbar + st, 1)
                    cute.arch.mbarrier_init(mbar + self.groups + st, self.consumers // 32)
                cute.arch.mbarrier_init_fence()
            cute.arch.barrier()

            # ------------------------------------------------------------ global tiles
            mA_cta = mA
            if cutlass.const_expr(self.moe):
                mA_cta = cute.domain_offset((row_start, 0, 0), mA)
            # (tile_n, BK/2, k_tiles)
            gQ = cute.local_tile(mQ, (self.tile_n, BK // 2), (n_tile, None, grp))
            # (tile_n, 1, k_tiles)
            gS = cute.local_tile(mS, (self.tile_n, 1), (n_tile, None, grp))
            tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
                tma_q,
                0,
                cute.make_layout(1),
                cute.group_modes(sQ, 0, 2),
                cute.group_modes(gQ, 0, 2),
            )
            tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
                tma_s,
                0,
                cute.make_layout(1),
                cute.group_modes(sS, 0, 2),
                cute.group_modes(gS, 0, 2),
            )

            k_tiles_total = cute.size(gQ, mode=[2])
            k_cnt = k_tiles_total // self.split_k
            k_first = split * k_cnt

            # ------------------------------------------------------------ MMA partitions
            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(wg * 128)
            tCsA = thr_mma.partition_B(sA)  # (MMA, MMA_N, MMA_K, STAGE)
            tCrA = tiled_mma.make_fragment_B(tCsA)
            # Register A fragments (MMA, 1, 4): double-buffered dequantized weights.
            a_shape = tiled_mma.partition_shape_A((self.tile_n, BK))
            frag0 = tiled_mma.make_fragment_A(a_shape)
            frag1 = tiled_mma.make_fragment_A(a_shape)
            thr_epi = tiled_mma.get_slice(tidx)
            cC = cute.make_identity_tensor((self.tile_n, self.tile_m))
            tCcC = thr_epi.partition_C(cC)  # (MMA, MMA_M, MMA_N)
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

            # This thread's A-fragment rows (PTX wgmma register layout of A, m64 x k16 per
            # warpgroup): row0 = 16 * warp + lane / 4 and row0 + 8; lane % 4 picks the K pairs.
            lane = tidx % 32
            row0 = wg * 64 + (warp_idx % 4) * 16 + lane // 4
            q_off = row0 * (BK // 2) + (lane % 4) * 8
            s_off = row0 * 4

            rows_left = rows - m_tile * self.tile_m
            # (tile_m, BK, k_tiles)
            gA = cute.local_tile(mA_cta, (self.tile_m, BK), (m_tile, None, act_l))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a,
                0,
                cute.make_layout(1),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
            acc.fill(0.0)
            loads = (mbar, full, k_first, tma_a, tAgA, tAsA, tma_q, tQgQ, tQsQ, tma_s, tSgS, tSsS)
            frags = (frag0, frag1)
            if cutlass.const_expr(self.producer):
                if warp_idx == self.load_warp:
                    self._produce(k_cnt, empty, loads)
                else:
                    self._consume(
                        k_cnt, frags, acc, tiled_mma, tCrA, warp_idx, lane, empty, sQ_addr,
                        sS_addr, q_off, s_off, loads,
                    )  # fmt: skip
            else:
                # K tile j goes to stage j % stages; the first pass needs no empty-barrier wait.
                if warp_idx == 0:
                    for j in cutlass.range(cutlass.min(self.stages, k_cnt), unroll=1):
                        self._load(j, j, loads)
                self._consume(
                    k_cnt, frags, acc, tiled_mma, tCrA, warp_idx, lane, empty, sQ_addr,
                    sS_addr, q_off, s_off, loads,
                )  # fmt: skip

            # ------------------------------------------------------------ epilogue
            scale = mGS[grp] * DECODE_BIAS  # the decode's products are e2m1·sf·2^-19
            mC_cta = mC
            if cutlass.const_expr(self.moe):
                mC_cta = cute.domain_offset((0, row_start, 0), mC)
            gC = cute.local_tile(mC_cta, (self.tile_n, self.tile_m), (n_tile, m_tile, act_l))
            tCgC = thr_epi.partition_C(gC)
            if cutlass.const_expr(self.split_k > 1):
                self._splitk_reduce(
                    acc, tCcC, tCgC, rows_left, scale, park, tidx, split,
                    mC_cta, n_tile, m_tile, act_l,
                )  # fmt: skip
            elif cutlass.const_expr(self.swiglu):
                self._swiglu_epilogue(
                    acc, mC_cta, n_tile, m_tile, act_l, rows_left, scale, park, tidx
                )
            elif cutlass.const_expr(self.staged_epilogue):
                self._staged_epilogue(
                    acc, mC_cta, n_tile, m_tile, act_l, rows_left, scale, park, tidx
                )
            elif self._consumer(tidx):
                for i in cutlass.range_constexpr(cute.size(acc)):
                    if tCcC[i][1] < rows_left:
                        tCgC[i] = (acc[i] * scale).to(self.out_dtype)

    def _consumer(self, tidx):
        """Whether thread `tidx` is a consumer (holds accumulators): a runtime test only when
        the CTA has a producer warp, so the kernels without one compile as before it existed."""
        return tidx < self.consumers if self.producer else True

    @cute.jit
    def _produce(self, k_cnt, empty, loads):
        """The producer warp: K tiles j * kps .. j * kps + kps - 1 into ring stages g * kps ..
        (barrier stage g = j % groups), once the consumers have released the barrier stage's
        previous tiles (from the second pass on)."""
        for j in cutlass.range((k_cnt + self.kps - 1) // self.kps, unroll=1):
            g = j % self.groups
            if j >= self.groups:
                du.mbar_wait(empty + g * 8, ((j // self.groups) + 1) & 1)
            if cutlass.const_expr(self.kps == 1):
                self._load(j, g, loads)
            else:
                with cute.arch.elect_one():
                    if j * 2 + 1 < k_cnt:
                        du.mbar_arrive_expect_tx(loads[1] + g * 8, 2 * self.tx_bytes)
                    else:  # an odd K tile count: the last barrier stage holds one tile
                        du.mbar_arrive_expect_tx(loads[1] + g * 8, self.tx_bytes)
                for h in cutlass.range_constexpr(2):
                    if j * 2 + h < k_cnt:
                        self._copy_tile(j * 2 + h, g * 2 + h, g, loads)

    @cute.jit
    def _consume(
        self, k_cnt, frags, acc, tiled_mma, tCrA, warp_idx, lane, empty, sQ_addr, sS_addr,
        q_off, s_off, loads,
    ):  # fmt: skip
        """The consumer warpgroups' mainloop: unrolled by a whole number of ring passes (U
        steps: stages if even, else twice), so every step's stage and fragment buffer are
        compile-time; tile r * U + i has stage i % stages and full-barrier parity
        ph ^ (i // stages) & 1, where ph is the parity of the pass's first tile (it flips per
        loop iteration only when U = stages)."""
        unroll = self.stages if self.stages % 2 == 0 else 2 * self.stages
        ph = cutlass.Int32(0)
        du.mbar_wait(loads[1], ph)
        self._dequant(frags[0], sQ_addr, sS_addr, 0, q_off, s_off)
        for r in cutlass.range((k_cnt + unroll - 1) // unroll, unroll=1):
            for i in cutlass.range_constexpr(unroll):
                kt = r * unroll + i
                if kt < k_cnt:
                    self._step(
                        kt, k_cnt, i, frags[i % 2], frags[(i + 1) % 2], acc, tiled_mma, tCrA,
                        ph, warp_idx, lane, empty, sQ_addr, sS_addr, q_off, s_off, loads,
                    )  # fmt: skip
            if cutlass.const_expr(unroll == self.stages):
                ph = ph ^ 1
        cute.nvgpu.warpgroup.wait_group(0)

    def _stmatrix_addr(self, base, tidx):
        """This lane's `stmatrix .x4 .trans` address for n8 blocks (0, 1) of a staged token-row
        area at `base`: lane 8q + r addresses column (token) r of matrix q = (row half q % 2,
        n8 block q // 2) of its warp's 16 weight rows."""
        lane = tidx % 32
        q = lane // 8
        row_b = ((tidx // 128) * 64 + ((tidx % 128) // 32) * 16 + (q % 2) * 8) * 2
        return base + ((q // 2) * 8 + lane % 8) * self.pitch + row_b

    @staticmethod
    def _bf16_words(vals, scale):
        """8 fp32 accumulators of n8 blocks (j, j + 1) (element order e + 2 h + 4 jj) -> the 4
        bf16x2 words of `stmatrix .x4` matrices (h = 0, jj = 0), (1, 0), (0, 1), (1, 1)."""
        first = tuple(4 * (mq // 2) + 2 * (mq % 2) for mq in range(4))
        return tuple(du.cvt_bf16x2_f32(vals[i] * scale, vals[i + 1] * scale) for i in first)

    @cute.jit
    def _store_token_rows(self, base, n_tok, tok_first, mC, n_tile, m_tile, act_l, rows_left, tidx):
        """Write staged token rows [0, n_tok) at `base` (pitch self.pitch) to tokens
        m_tile * tile_m + tok_first + t of `mC`: each warpgroup its out_cols / num_wg columns of
        every token as 16-byte stores (64 columns: 8 threads per token, 16 tokens per pass; the
        SwiGLU's 32: 4 threads, 32 tokens); tokens at or past `rows_left` (counted from the
        tile's first token) are skipped."""
        wg_cols = self.out_cols // self.num_wg
        chunks = wg_cols // 8  # 16-byte chunks of a token row per warpgroup
        per_pass = 128 // chunks  # tokens per pass
        pitch = self.pitch
        wg = tidx // 128
        chunk = tidx % chunks
        tok0 = (tidx % 128) // chunks
        n0 = n_tile * self.out_cols + wg * wg_cols + chunk * 8
        ld_base = base + tok0 * pitch + wg * wg_cols * 2 + chunk * 16
        g_base = mC.iterator.toint()
        for it in cutlass.range_constexpr((n_tok + per_pass - 1) // per_pass):
            token = tok_first + it * per_pass + tok0
            if cutlass.const_expr(n_tok % per_pass == 0):
                v = du.ld_shared_v4_b32(ld_base + it * per_pass * pitch)
                if token < rows_left:
                    idx = cute.crd2idx((n0, m_tile * self.tile_m + token, act_l), mC.layout)
                    du.st_global_v4_b32(g_base + cutlass.Int64(idx) * 2, v)
            else:  # a partial pass: threads past the staged rows store nothing
                if it * per_pass + tok0 < n_tok:
                    if token < rows_left:
                        idx = cute.crd2idx((n0, m_tile * self.tile_m + token, act_l), mC.layout)
                        du.st_global_v4_b32(
                            g_base + cutlass.Int64(idx) * 2,
                            du.ld_shared_v4_b32(ld_base + it * per_pass * pitch),
                        )

    @cute.jit
    def _staged_epilogue(self, acc, mC, n_tile, m_tile, act_l, rows_left, scale, park, tidx):
        """acc * scale -> bf16 through shared memory: `stmatrix .trans` turns each warp's 8x8
        (weight row x token) blocks into token rows of the tile at `park` (the activation ring,
        idle now; pitch tile_n * 2 + 16 bytes, so the 8 rows of one store and the 8 lanes of one
        read hit distinct banks), then `_store_token_rows` writes them out.
        Accumulator element i = e + 2 h + 4 j of a thread is (row lane / 4 + 8 h, token
        8 j + 2 (lane % 4) + e) of its warp's 16 x tile_m block (the wgmma C fragment)."""
        st_base = self._stmatrix_addr(park, tidx)
        cute.arch.barrier()  # every warpgroup is past its last WGMMA read of the ring
        if self._consumer(tidx):
            for j in cutlass.range_constexpr(0, self.tile_m // 8, 2):
                vals = tuple(acc[4 * j + v] for v in range(8))
                du.stmatrix_x4_trans(st_base + j * 8 * self.pitch, self._bf16_words(vals, scale))
        cute.arch.barrier()
        if self._consumer(tidx):
            self._store_token_rows(park, self.tile_m, 0, mC, n_tile, m_tile, act_l, rows_left, tidx)

    @cute.jit
    def _swiglu_epilogue(self, acc, mC, n_tile, m_tile, act_l, rows_left, scale, park, tidx):
        """The clamped SwiGLU of the tile: weight rows 16 b + h * 8 + r (h = 0: gate, 1: up) are
        gate and up of output column 8 b + r (`cutedsl.sm90.weight.interleave_swiglu`), so every
        thread holds both halves of its outputs: accumulator i = e + 2 h + 4 j is (row lane / 4 +
        8 h, token 8 j + 2 (lane % 4) + e) of its warp's 16 x tile_m block. Each half is
        acc * scale rounded to bf16 (the value the unfused GEMM stores), then `swiglu_clamp_f32`,
        then bf16; `stmatrix .x2 .trans` turns each warp's 8 columns x 16 tokens into token rows
        at `park` (pitch self.pitch), which `_store_token_rows` writes out."""
        pitch = self.pitch
        lane = tidx % 32
        q = (lane // 8) % 2  # lanes 16..31 repeat lanes 0..15's addresses (.x2 reads 0..15)
        col_b = ((tidx // 128) * 32 + ((tidx % 128) // 32) * 8) * 2
        st_base = park + (q * 8 + lane % 8) * pitch + col_b
        cute.arch.barrier()  # every warpgroup is past its last WGMMA read of the ring
        if self._consumer(tidx):
            for j in cutlass.range_constexpr(0, self.tile_m // 8, 2):
                words = []
                for jj in cutlass.range_constexpr(2):
                    outs = []
                    for e in cutlass.range_constexpr(2):
                        g = du.bf16_round(acc[4 * (j + jj) + e] * scale)
                        u = du.bf16_round(acc[4 * (j + jj) + 2 + e] * scale)
                        outs.append(swiglu_clamp_f32(g, u, self.swiglu_limit))
                    words.append(du.cvt_bf16x2_f32(outs[0], outs[1]))
                du.stmatrix_x2_trans(st_base + j * 8 * pitch, tuple(words))
        cute.arch.barrier()
        if self._consumer(tidx):
            self._store_token_rows(park, self.tile_m, 0, mC, n_tile, m_tile, act_l, rows_left, tidx)

    @cute.jit
    def _splitk_reduce(
        self, acc, tCcC, tCgC, rows_left, scale, park, tidx, split, mC, n_tile, m_tile, act_l
    ):
        """Split-K through distributed shared memory: every CTA of the cluster parks its fp32
        accumulators at `park` (the activation ring, idle now), element i of thread t at word
        i * threads + t in vectors of `vw`; after a cluster barrier CTA `split` owns fragment
        elements [split * E/S, (split+1) * E/S) of every thread, sums them over the S CTAs in
        rank (= split) order (bit-identical on every run) and writes bf16. Those elements are
        tokens [split * tile_m / S, (split+1) * tile_m / S) of the tile; with the staged epilogue
        they go out through `stmatrix` into this CTA's ring past the parked tile and
        `_store_token_rows`, else from registers. A second cluster barrier keeps each CTA's
        shared memory alive until its peers have read it."""
        S = self.split_k
        E = cute.size(acc)
        per = E // S  # elements each CTA reduces (per thread)
        vw = 4 if per % 4 == 0 else (2 if per % 2 == 0 else 1)
        cute.arch.barrier()  # every warpgroup is past its last WGMMA read of the ring
        if self._consumer(tidx):
            for c in cutlass.range_constexpr(E // vw):
                addr = park + ((c * self.consumers + tidx) * vw) * 4
                du.st_shared_f32xn(addr, tuple(acc[c * vw + v] for v in range(vw)))
        cute.arch.cluster_arrive()  # release: the parked tile is visible cluster-wide
        cute.arch.cluster_wait()
        peers = [du.mapa_shared(park, s) for s in range(S)]
        if cutlass.const_expr(self.staged_epilogue):
            n_tok = self.tile_m // S  # this CTA's token slice; per = n_tok / 2 elements, vw = 4
            stage = park + self.stage_off
            st_base = self._stmatrix_addr(stage, tidx)
            # The slice's chunks (vw = 4: chunk c = n8 block c) start at chunk split * per / 4;
            # every partial, this CTA's too, is read through DSMEM, so `split` stays a runtime
            # offset (no per-rank copy of this code).
            c0 = split * (per // 4)
            if self._consumer(tidx):
                for jp in cutlass.range_constexpr(n_tok // 16):
                    vals = self._sum_peers(peers, c0 + 2 * jp, tidx) + self._sum_peers(
                        peers, c0 + 2 * jp + 1, tidx
                    )
                    words = self._bf16_words(vals, scale)
                    du.stmatrix_x4_trans(st_base + jp * 16 * self.pitch, words)
            cute.arch.barrier()
            if self._consumer(tidx):
                self._store_token_rows(
                    stage, n_tok, split * n_tok, mC, n_tile, m_tile, act_l, rows_left, tidx
                )
        elif self._consumer(tidx):
            for c in cutlass.range_constexpr(E // vw):
                if c // (per // vw) == split:
                    off = ((c * self.consumers + tidx) * vw) * 4
                    tot = list(du.ld_shared_cluster_f32xn(peers[0] + off, vw))
                    for s in cutlass.range_constexpr(1, S):
                        part = du.ld_shared_cluster_f32xn(peers[s] + off, vw)
                        tot = [tot[v] + part[v] for v in range(vw)]
                    for v in cutlass.range_constexpr(vw):
                        if tCcC[c * vw + v][1] < rows_left:
                            tCgC[c * vw + v] = (tot[v] * scale).to(self.out_dtype)
        cute.arch.cluster_arrive_relaxed()  # the peers' reads are done before any CTA exits
        cute.arch.cluster_wait()

    def _sum_peers(self, peers, c, tidx):
        """Chunk c (4 fp32 elements, parked at word (c * threads + tidx) * 4) summed over the
        cluster's partials in rank order."""
        off = ((c * self.consumers + tidx) * 4) * 4
        tot = list(du.ld_shared_cluster_f32xn(peers[0] + off, 4))
        for r in range(1, len(peers)):
            part = du.ld_shared_cluster_f32xn(peers[r] + off, 4)
            tot = [tot[v] + part[v] for v in range(4)]
        return tot

    @cute.jit
    def _dequant(self, frag, sQ_addr, sS_addr, stage, q_off, s_off):
        """Decode this thread's 2 rows x 16 K values of one K tile into the A fragment `frag`."""
        f32 = cute.recast_tensor(frag, cutlass.Int32)  # (4 regs, 1, 4 k16 blocks)
        q_base = sQ_addr + stage * (self.tile_n * BK // 2) + q_off
        s_base = sS_addr + stage * (self.tile_n * 4) + s_off
        for rr in cutlass.range_constexpr(2):  # rows row0, row0 + 8
            sw = dec.e5m3x4_to_bf16x2x2(du.ld_shared_b32(s_base + rr * 8 * 4))
            u0, u1 = du.ld_shared_v2_b32(q_base + rr * 8 * (BK // 2))
            for q, u in ((0, u0), (1, u1)):  # K blocks 2q, 2q + 1
                w0, w1, w2, w3 = dec.nvfp4x8_to_bf16x2x4(u, sw[q])
                # fragment reg (v1 = row + 8, v2 = k + 8) + 4 * k16 block
                f32[rr + 0 + 4 * (2 * q)] = w0
                f32[rr + 2 + 4 * (2 * q)] = w1
                f32[rr + 0 + 4 * (2 * q + 1)] = w2
                f32[rr + 2 + 4 * (2 * q + 1)] = w3

    @cute.jit
    def _step(
        self, kt, k_cnt, i, frag, frag_next, acc, tiled_mma, tCrA, ph,
        warp_idx, lane, empty, sQ_addr, sS_addr, q_off, s_off, loads,
    ):  # fmt: skip
        """K tile kt = step i (compile-time) of an unrolled pass whose first tile has parity ph:
        WGMMA on `frag` (decoded earlier) and stage i % stages; once the WGMMAs of tile kt-1 are
        done, release its stage (one arrival per warp), and without a producer warp warp 0 refills
        it with tile kt-1+stages when every warp has (the empty barrier's phase of tile kt-1's
        pass); then wait for tile kt+1 and decode it into `frag_next`."""
        n = self.stages
        st, pst, nst = i % n, (i - 1) % n, (i + 1) % n  # this, the previous and the next stage
        # their barrier stages (the unroll is a multiple of kps, so kt % kps = i % kps)
        pg, ng = pst // self.kps, nst // self.kps
        # parities relative to ph (Python floor division: step -1 is the previous pass)
        pph = ph ^ (((i - 1) // n) & 1)
        nph = ph ^ (((i + 1) // n) & 1)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(BK // 16):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrA[(None, None, kb, st)], acc)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(1)  # tile kt-1 done: frag_next and its stage are free
        if cutlass.const_expr(i % self.kps == 0):  # tile kt-1 ended its barrier stage
            if kt > 0:
                if lane == 0:
                    du.mbar_arrive(empty + pg * 8)
                if cutlass.const_expr(not self.producer):
                    if warp_idx == 0 and kt - 1 + n < k_cnt:
                        du.mbar_wait(empty + pg * 8, pph)
                        self._load(kt - 1 + n, pst, loads)
        if kt + 1 < k_cnt:
            if cutlass.const_expr((i + 1) % self.kps == 0):  # tile kt+1 opens a barrier stage
                du.mbar_wait(loads[1] + ng * 8, nph)
            self._dequant(frag_next, sQ_addr, sS_addr, nst, q_off, s_off)

    @cute.jit
    def _load(self, j, st, loads):
        """TMA loads of this CTA's K tile j into ring stage st, completing full[st] (one
        arrival that expects the stage's bytes; k_per_stage 1)."""
        with cute.arch.elect_one():
            du.mbar_arrive_expect_tx(loads[1] + st * 8, self.tx_bytes)
        self._copy_tile(j, st, st, loads)

    @cute.jit
    def _copy_tile(self, j, st, g, loads):
        """TMA loads of this CTA's K tile j (activations, weight bytes, scale words) into ring
        stage st, counted on the full barrier of barrier stage g."""
        mbar, full, k_first, tma_a, tAgA, tAsA, tma_q, tQgQ, tQsQ, tma_s, tSgS, tSsS = loads
        bar = mbar + g
        k = k_first + j  # global K tile index
        cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, st)], tma_bar_ptr=bar)
        cute.copy(tma_q, tQgQ[(None, k)], tQsQ[(None, st)], tma_bar_ptr=bar)
        cute.copy(tma_s, tSgS[(None, k)], tSsS[(None, st)], tma_bar_ptr=bar)


# ------------------------------------------------------------------------------ fake tensors


def fake_operands(moe: bool, swiglu: bool = False):
    """Fake (a, w, sf, gs, out, offs, stream): dynamic M/T, N, K and group count (the fused
    SwiGLU's out has its own column count, N / 2)."""
    s32 = cute.sym_int32
    m = s32(symbol="M")
    n = s32(divisibility=64, symbol="N")
    k = s32(divisibility=BK, symbol="K")
    kh = s32(divisibility=BK // 2, symbol="K2")
    kt = s32(symbol="K64")
    g = s32(symbol="L")
    la = 1 if moe else g
    # a and out: unit stride along K / N; the token and group strides are free multiples of 8
    # elements (16-byte rows), so wo_a reads its [T, G, D] input and writes [T, G, N] in place
    sam, sal = s32(divisibility=8, symbol="SAM"), s32(divisibility=8, symbol="SAL")
    scm, scl = s32(divisibility=8, symbol="SCM"), s32(divisibility=8, symbol="SCL")
    a = make_fake_tensor(cutlass.BFloat16, (m, k, la), (sam, 1, sal), assumed_align=16)
    w = make_fake_compact_tensor(
        cutlass.Uint8, (n, kh, g), stride_order=(1, 0, 2), assumed_align=16
    )
    sf = make_fake_compact_tensor(
        cutlass.Int32, (n, kt, g), stride_order=(0, 1, 2), assumed_align=16
    )
    gs = make_fake_compact_tensor(cutlass.Float32, (g,), assumed_align=4)
    n_out = s32(divisibility=32, symbol="NO") if swiglu else n
    out = make_fake_tensor(cutlass.BFloat16, (n_out, m, la), (1, scm, scl), assumed_align=16)
    offs = make_fake_compact_tensor(cutlass.Int32, (s32(symbol="E1"),), assumed_align=4)
    return a, w, sf, gs, out, offs, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(
    tile_n: int,
    tile_m: int,
    split_k: int,
    moe: bool,
    *,
    no_jit_engine: bool = False,
    staged_epilogue: bool | None = None,
    stages: int | None = None,
    producer: bool | None = None,
    k_per_stage: int | None = None,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> object:
    """cute.compile one variant from fake tensors (TVM-FFI, env stream); `staged_epilogue`,
    `stages`, `producer` and `k_per_stage` override the kernel's defaults (the GPU tests cover
    both sides of each default), `swiglu` / `swiglu_limit` fuse the clamped SwiGLU into the
    epilogue, `no_jit_engine` compiles without loading (no GPU needed)."""
    kernel = Sm90Nvfp4W4A16GemmKernel(
        tile_n=tile_n,
        tile_m=tile_m,
        split_k=split_k,
        moe=moe,
        stages=stages,
        staged_epilogue=staged_epilogue,
        producer=producer,
        k_per_stage=k_per_stage,
        swiglu=swiglu,
        swiglu_limit=swiglu_limit,
    )
    args = fake_operands(moe, swiglu)
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(kernel, *args, options="--enable-tvm-ffi", **kw)


def check_targets() -> list[KernelTarget]:
    """One target per variant: dense/grouped (same kernel, L groups), split-K, MoE offsets. Every
    one must show register-A WGMMA (HGMMA reading an R operand), the prmt decode and TMA; unsplit
    dense / grouped also the staged epilogue (stmatrix, 16-byte stores); split-K the cluster
    barrier and the distributed-shared-memory loads of the reduction; the fused-SwiGLU MoE
    variants its math and their x2 stores. The n64m16, splitk4 and MoE n128m16 variants have the
    producer warp, the others not."""
    staged = (r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans", r"st\.global\.v4\.b32")
    variants = [
        ("sm90.w4a16_gemm.grouped.n128m256", 128, 256, 1, False, staged),
        ("sm90.w4a16_gemm.grouped.n128m128", 128, 128, 1, False, staged),
        ("sm90.w4a16_gemm.grouped.n64m16", 64, 16, 1, False, staged),
        ("sm90.w4a16_gemm.grouped.splitk4", 64, 16, 4, False,
         (r"barrier\.cluster\.arrive", r"mapa\.shared::cluster",
          r"ld\.shared::cluster\.v2\.f32")),
        ("sm90.w4a16_gemm.grouped.n128m256splitk2", 128, 256, 2, False,
         (r"barrier\.cluster\.arrive", r"ld\.shared::cluster\.v4\.f32", *staged)),
        ("sm90.w4a16_gemm.moe_offs.n128m64", 128, 64, 1, True,
         (*staged, r"shfl\.sync\.up\.b32")),
        ("sm90.w4a16_gemm.moe_offs.n128m16", 128, 16, 1, True,
         (*staged, r"shfl\.sync\.up\.b32")),
        ("sm90.w4a16_gemm.moe_offs.n128m192", 128, 192, 1, True,  # the MoE prefill tile
         (*staged, r"shfl\.sync\.up\.b32")),
    ]  # fmt: skip
    # The fused SwiGLU (routed w13): the bf16 rounding of gate and up, expf's range reduction,
    # the IEEE division, the clamps (limit 10) and the x2 transposing store.
    fused = (
        r"cvt\.rn\.bf16\.f32",
        r"cvt\.f32\.bf16",
        r"fma\.rn\.f32\s+%f\d+, %f\d+, 0fBFB8AA3B",
        r"ex2\.approx",
        r"div\.rn\.f32",
        r"stmatrix\.sync\.aligned\.m8n8\.x2\.trans",
        r"st\.global\.v4\.b32",
        r"shfl\.sync\.up\.b32",
    )
    swiglu = [
        ("sm90.w4a16_gemm.moe_swiglu.n128m16", 128, 16, 10.0,
         (*fused, r"setp\.ge\.f32\s+%p\d+, %f\d+, 0f41200000")),
        ("sm90.w4a16_gemm.moe_swiglu.n64m32", 64, 32, 10.0, fused),
        ("sm90.w4a16_gemm.moe_swiglu.n128m192.nolimit", 128, 192, None, fused),
    ]  # fmt: skip
    common = (r"wgmma\.mma_async", r"shf\.l\.wrap\.b32", r"mul\.rn\.bf16x2", r"prmt\.b32",
              r"cp\.async\.bulk\.tensor")  # fmt: skip
    sass = (r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+, gdesc",)
    out = [
        KernelTarget(
            name=name,
            arch="sm_90a",
            compile=(
                lambda tn=tn, tm=tm, sk=sk, moe=moe: compile_kernel(
                    tn, tm, sk, moe, no_jit_engine=True
                )
            ),
            ptx_patterns=(*common, *extra),
            sass_patterns=sass,
            # `_compute_stages` gives 128x128 the ring of two CTAs per SM: 2 x 256 threads must
            # fit the 64K registers
            max_registers=128 if (tn, tm) == (128, 128) else None,
        )
        for name, tn, tm, sk, moe, extra in variants
    ]
    out += [
        KernelTarget(
            name=name,
            arch="sm_90a",
            compile=(
                lambda tn=tn, tm=tm, lim=lim: compile_kernel(
                    tn, tm, 1, True, swiglu=True, swiglu_limit=lim, no_jit_engine=True
                )
            ),
            ptx_patterns=(*common, *extra),
            sass_patterns=sass,
        )
        for name, tn, tm, lim, extra in swiglu
    ]
    return out
