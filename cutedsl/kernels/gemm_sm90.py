"""Hopper (sm_90a) NVFP4 W4A16 GEMM family: NVFP4 weights dequantized to BF16 in the mainloop.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), L weight groups
(G o-proj groups or E experts; 1 for a dense linear).

Math (per group l):  out[l][m, n] = gs[l] * sum_k a[l][m, k] * (e2m1(w[l][n, k]) * sf[l][n, k // 16])
  a   (M, K, L)    bf16, K-major                     activations
  w   (N, K/2, L)  uint8, K-major, element 2i in the low nibble of byte i
  sf  (N, K/16, L) uint8 (e4m3 codes), N-major (prepared: cutedsl.sm90.prepare_nvfp4_weight)
  gs  (L,)         fp32 global scale (weight_scale_2), applied in the epilogue
  out (N, M, L)    bf16 view of a row-major (L, M, N) tensor (split_k == 1), or fp32 with
                   split_k > 1 (partial sums are added atomically into a zeroed fp32 buffer).
MoE mode (`moe=True`): a is (T, K, 1) with the rows of expert e at [offs[e], offs[e+1]) (offs int32
(E+1,) on the device), out is (N, T, 1); grid.y covers ceil(T / tile_m) tiles for every expert and
CTAs past their expert's row count exit at once, so routing never reaches the host.

Swap-AB: the dequantized weights are the WGMMA "A" operand (64 weight rows per warpgroup, the M side
of the instruction) and the tokens are the "B" operand (the N side, 8..256 wide), so a decode
batch of one token wastes nothing but an N=tile_m instruction column block. Accumulators hold
out^T tiles (tile_n weight rows x tile_m tokens).

Per CTA (one tile_n x tile_m output tile, one K split, one group), 2*tile_n threads:
  - warp 0 issues TMA loads per 64-wide K tile: bf16 activations (128B-swizzled, WGMMA layout),
    packed weight bytes (tile_n x 32 B) and scale bytes (4 x tile_n B) into a `stages`-deep ring.
  - every thread dequantizes 32 weights of its row per K tile (byte-permute LUT, device_utils)
    into a double-buffered bf16 smem tile in the K-major SW128 layout WGMMA reads, then its
    warpgroup issues 4 SS-WGMMA (64 x tile_m x 16) and keeps one WGMMA group in flight, so the
    dequant of tile k+1 overlaps the tensor cores on tile k.
  - epilogue: acc * gs -> bf16 (or fp32 atomics for split-K), predicated on the token count.

Compile-time: tile_n (64|128), tile_m (8..256, multiple of 8), split_k, moe, dtypes, stages.
Runtime: M (or T), the group count and strides, offs, pointers, stream.
Graph safety: no host sync; the grid depends on M/T, N, split_k and L only.
Constraints: N % tile_n == 0, K % (64 * split_k) == 0, K % 64 == 0.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from cutedsl.kernels import device_utils as du
from cutedsl.kernels.checks import KernelTarget

BK = 64  # logical K per pipeline stage (one 128-byte swizzle atom of bf16)
SMEM_CAPACITY = 232448  # sm_90 dynamic smem per CTA (227 KiB)


class Sm90Nvfp4W4A16GemmKernel:
    """W4A16 NVFP4 grouped GEMM for sm_90a. `__init__` takes codegen configuration only."""

    def __init__(
        self,
        tile_n: int = 128,
        tile_m: int = 64,
        split_k: int = 1,
        moe: bool = False,
        stages: int | None = None,
    ):
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128, got {tile_n}")
        if tile_m % 8 != 0 or not 8 <= tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in [8, 256], got {tile_m}")
        if split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {split_k}")
        self.tile_n = tile_n
        self.tile_m = tile_m
        self.split_k = split_k
        self.moe = moe
        self.num_wg = tile_n // 64
        self.threads = 128 * self.num_wg
        self.stages = stages if stages is not None else self._compute_stages(tile_n, tile_m)
        self.buffer_align_bytes = 1024

    @staticmethod
    def _compute_stages(tile_n: int, tile_m: int) -> int:
        per_stage = tile_m * BK * 2 + tile_n * BK // 2 + tile_n * BK // 16
        fixed = 2 * tile_n * BK * 2 + 2048
        return max(2, min(8, (SMEM_CAPACITY - fixed) // per_stage))

    @staticmethod
    def can_implement(n: int, k: int, tile_n: int, split_k: int) -> bool:
        """GPU-free shape check (M is free)."""
        return n % tile_n == 0 and k % BK == 0 and (k // BK) % split_k == 0 and n > 0 and k > 0

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L) bf16 K-major; MoE: (T, K, 1)
        w: cute.Tensor,  # (N, K/2, L) uint8 K-major
        sf: cute.Tensor,  # (N, K/16, L) uint8 (e4m3 codes) N-major
        gs: cute.Tensor,  # (L,) fp32
        out: cute.Tensor,  # (N, M, L) bf16|fp32 N-major; MoE: (N, T, 1)
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
        )
        tile_mnk = (self.tile_n, self.tile_m, BK)
        # Dequantized weights: K-major SW128, double-buffered (MMA operand A).
        self.sw_layout = sm90_utils.make_smem_layout_a(rowmajor, tile_mnk, cutlass.BFloat16, 2)
        # Activations: K-major SW128 ring (MMA operand B), written by TMA.
        self.sa_layout = sm90_utils.make_smem_layout_b(
            rowmajor, tile_mnk, cutlass.BFloat16, self.stages
        )
        # Packed weights (row-major bytes) and scales (N-major bytes), plain layouts.
        self.sq_layout = cute.make_layout(
            (self.tile_n, BK // 2, self.stages),
            stride=(BK // 2, 1, self.tile_n * BK // 2),
        )
        self.ss_layout = cute.make_layout(
            (self.tile_n, BK // 16, self.stages),
            stride=(1, self.tile_n, self.tile_n * BK // 16),
        )
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(self.sa_layout, (None, None, 0)), (self.tile_m, BK)
        )
        tma_q, mQ = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, w, cute.slice_(self.sq_layout, (None, None, 0)), (self.tile_n, BK // 2)
        )
        tma_s, mS = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, sf, cute.slice_(self.ss_layout, (None, None, 0)), (self.tile_n, BK // 16)
        )
        self.tx_bytes = self.tile_m * BK * 2 + self.tile_n * BK // 2 + self.tile_n * BK // 16

        n_tiles = cute.size(w, mode=[0]) // self.tile_n
        m_tiles = (cute.size(a, mode=[0]) + self.tile_m - 1) // self.tile_m
        groups = cute.size(w, mode=[2])
        grid = (n_tiles, m_tiles, groups * self.split_k)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.sa_layout)],
                self.buffer_align_bytes,
            ]
            sW: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.sw_layout)],
                self.buffer_align_bytes,
            ]
            sQ: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sq_layout)], 128
            ]
            sS: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.ss_layout)], 128
            ]

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
            self.sw_layout,
            self.sq_layout,
            self.ss_layout,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

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
        sw_layout: cute.ComposedLayout,
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

        # ---------------------------------------------------------------- rows of this CTA
        row_start = cutlass.Int32(0)
        rows = cutlass.Int32(cute.size(mA, mode=[0]))
        act_l = grp
        if cutlass.const_expr(self.moe):
            row_start = mOffs[grp]
            rows = mOffs[grp + 1] - row_start
            act_l = 0
        rows_left = rows - m_tile * self.tile_m

        if rows_left > 0:
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_q)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_s)

            # ------------------------------------------------------------ smem + pipeline
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
            consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32)
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=producer_group,
                consumer_group=consumer_group,
                tx_count=self.tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
            sW = storage.sW.get_tensor(sw_layout.outer, swizzle=sw_layout.inner)
            sQ = storage.sQ.get_tensor(sq_layout)
            sS = storage.sS.get_tensor(ss_layout)
            sW_addr = storage.sW.data_ptr().toint()
            sQ_addr = storage.sQ.data_ptr().toint()
            sS_addr = storage.sS.data_ptr().toint()

            # ------------------------------------------------------------ global tiles
            mA_cta = mA
            if cutlass.const_expr(self.moe):
                mA_cta = cute.domain_offset((row_start, 0, 0), mA)
            # (tile_m, BK, k_tiles)
            gA = cute.local_tile(mA_cta, (self.tile_m, BK), (m_tile, None, act_l))
            # (tile_n, BK/2, k_tiles)
            gQ = cute.local_tile(mQ, (self.tile_n, BK // 2), (n_tile, None, grp))
            # (tile_n, BK/16, k_tiles)
            gS = cute.local_tile(mS, (self.tile_n, BK // 16), (n_tile, None, grp))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a,
                0,
                cute.make_layout(1),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
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
            tCsW = thr_mma.partition_A(sW)  # (MMA, MMA_M, MMA_K, 2)
            tCsA = thr_mma.partition_B(sA)  # (MMA, MMA_N, MMA_K, STAGE)
            tCrW = tiled_mma.make_fragment_A(tCsW)
            tCrA = tiled_mma.make_fragment_B(tCsA)
            # The warpgroup slice above addresses the smem operands (WGMMA descriptors); the
            # accumulator's element -> (weight row, token) map is per thread.
            thr_epi = tiled_mma.get_slice(tidx)
            cC = cute.make_identity_tensor((self.tile_n, self.tile_m))
            tCcC = thr_epi.partition_C(cC)  # (MMA, MMA_M, MMA_N)
            acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            num_kb = cute.size(tCrW, mode=[2])

            # ------------------------------------------------------------ prologue loads
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(self.stages, k_cnt), unroll=1):
                    self._issue_loads(
                        mainloop,
                        prod,
                        k_first,
                        tma_a,
                        tAgA,
                        tAsA,
                        tma_q,
                        tQgQ,
                        tQsQ,
                        tma_s,
                        tSgS,
                        tSsS,
                    )
                    prod.advance()

            # ------------------------------------------------------------ mainloop
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            row = tidx // 2
            half = tidx % 2
            for kt in cutlass.range(k_cnt, unroll=1):
                wbuf = kt % 2
                mainloop.consumer_wait(cons)
                # dequantize 32 weights of `row` (K offset 32*half) into sW[:, :, wbuf]
                q_base = (
                    sQ_addr + cons.index * (self.tile_n * BK // 2) + row * (BK // 2) + half * 16
                )
                s_base = sS_addr + cons.index * (self.tile_n * BK // 16) + row
                w_row = sW_addr + wbuf * (self.tile_n * BK * 2) + row * (BK * 2)
                sc0 = du.e4m3_to_bf16x2(du.ld_shared_u8(s_base + (2 * half) * self.tile_n))
                sc1 = du.e4m3_to_bf16x2(du.ld_shared_u8(s_base + (2 * half + 1) * self.tile_n))
                for j in cutlass.range_constexpr(4):
                    q = du.ld_shared_b32(q_base + 4 * j)
                    sc = sc0 if j < 2 else sc1
                    chunk = half * 4 + j
                    dst = w_row + ((chunk ^ (row % 8)) * 16)
                    du.st_shared_v4_b32(
                        dst,
                        du.fp4x2_to_bf16x2_scaled(q, 0, sc),
                        du.fp4x2_to_bf16x2_scaled(q, 1, sc),
                        du.fp4x2_to_bf16x2_scaled(q, 2, sc),
                        du.fp4x2_to_bf16x2_scaled(q, 3, sc),
                    )
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=128)

                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(num_kb):
                    cute.gemm(
                        tiled_mma,
                        acc,
                        tCrW[(None, None, kb, wbuf)],
                        tCrA[(None, None, kb, cons.index)],
                        acc,
                    )
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                cons.advance()
                # Refill only after a release: at kt == 0 no stage is free yet, and warp 0 must
                # not block in producer_acquire before it has released its own share of stage 0
                # (that deadlocked whenever K tiles outnumbered stages, H200 2026-12-02).
                if kt > 0:
                    mainloop.consumer_release(rel)
                    rel.advance()
                    if warp_idx == 0 and prod.count < k_cnt:
                        self._issue_loads(
                            mainloop,
                            prod,
                            k_first,
                            tma_a,
                            tAgA,
                            tAsA,
                            tma_q,
                            tQgQ,
                            tQsQ,
                            tma_s,
                            tSgS,
                            tSsS,
                        )
                        prod.advance()
            cute.nvgpu.warpgroup.wait_group(0)

            # ------------------------------------------------------------ epilogue
            scale = mGS[grp]
            mC_cta = mC
            if cutlass.const_expr(self.moe):
                mC_cta = cute.domain_offset((0, row_start, 0), mC)
            gC = cute.local_tile(mC_cta, (self.tile_n, self.tile_m), (n_tile, m_tile, act_l))
            tCgC = thr_epi.partition_C(gC)
            for i in cutlass.range_constexpr(cute.size(acc)):
                if tCcC[i][1] < rows_left:
                    v = acc[i] * scale
                    if cutlass.const_expr(self.split_k == 1):
                        tCgC[i] = v.to(self.out_dtype)
                    else:
                        cute.arch.atomic_add((tCgC.iterator + tCgC.layout(i)).llvm_ptr, v)

    @cute.jit
    def _issue_loads(
        self, mainloop, prod, k_first, tma_a, tAgA, tAsA, tma_q, tQgQ, tQsQ, tma_s, tSgS, tSsS
    ):
        mainloop.producer_acquire(prod)
        k = k_first + prod.count
        bar = mainloop.producer_get_barrier(prod)
        cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_q, tQgQ[(None, k)], tQsQ[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_s, tSgS[(None, k)], tSsS[(None, prod.index)], tma_bar_ptr=bar)
        mainloop.producer_commit(prod)


# ------------------------------------------------------------------------------ fake tensors


def fake_operands(moe: bool, out_dtype: type[cutlass.Numeric] = cutlass.BFloat16):
    """Fake (a, w, sf, gs, out, offs, stream) with dynamic M/T, N, K and group count, for compile."""
    s32 = cute.sym_int32
    m = s32(symbol="M")
    n = s32(divisibility=64, symbol="N")
    k = s32(divisibility=BK, symbol="K")
    kh = s32(divisibility=BK // 2, symbol="K2")
    ks = s32(divisibility=BK // 16, symbol="K16")
    g = s32(symbol="L")
    la = 1 if moe else g
    a = make_fake_compact_tensor(
        cutlass.BFloat16, (m, k, la), stride_order=(1, 0, 2), assumed_align=16
    )
    w = make_fake_compact_tensor(
        cutlass.Uint8, (n, kh, g), stride_order=(1, 0, 2), assumed_align=16
    )
    sf = make_fake_compact_tensor(
        cutlass.Uint8, (n, ks, g), stride_order=(0, 1, 2), assumed_align=16
    )
    gs = make_fake_compact_tensor(cutlass.Float32, (g,), assumed_align=4)
    out = make_fake_compact_tensor(out_dtype, (n, m, la), stride_order=(0, 1, 2), assumed_align=16)
    offs = make_fake_compact_tensor(cutlass.Int32, (s32(symbol="E1"),), assumed_align=4)
    return a, w, sf, gs, out, offs, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(
    tile_n: int, tile_m: int, split_k: int, moe: bool, *, no_jit_engine: bool = False
) -> object:
    """cute.compile one variant from fake tensors (TVM-FFI, env stream)."""
    kernel = Sm90Nvfp4W4A16GemmKernel(tile_n=tile_n, tile_m=tile_m, split_k=split_k, moe=moe)
    out_dtype = cutlass.BFloat16 if split_k == 1 else cutlass.Float32
    args = fake_operands(moe, out_dtype)
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(kernel, *args, options="--enable-tvm-ffi", **kw)


def check_targets() -> list[KernelTarget]:
    """One target per variant: dense/grouped (same kernel, L groups), split-K, MoE offsets."""
    variants = [
        ("sm90.w4a16_gemm.grouped.n128m128", 128, 128, 1, False),
        ("sm90.w4a16_gemm.grouped.n64m16", 64, 16, 1, False),
        ("sm90.w4a16_gemm.grouped.splitk4", 64, 16, 4, False),
        ("sm90.w4a16_gemm.moe_offs.n128m64", 128, 64, 1, True),
    ]
    return [
        KernelTarget(
            name=name,
            arch="sm_90a",
            compile=(
                lambda tn=tn, tm=tm, sk=sk, moe=moe: compile_kernel(
                    tn, tm, sk, moe, no_jit_engine=True
                )
            ),
            ptx_patterns=(r"wgmma\.mma_async", r"prmt\.b32", r"cp\.async\.bulk\.tensor"),
            sass_patterns=(r"HGMMA",),
        )
        for name, tn, tm, sk, moe in variants
    ]
