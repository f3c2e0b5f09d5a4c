"""Block-scaled NVFP4 GEMM for SM100 (sm_100a) with tcgen05 `kind::mxf4nvf4.block_scale`.

Computes, for every output element (fp32 accumulation in TMEM, bf16 result):

    out[m, n, l] = alpha[l'] * sum_k e2m1(A[m, k, l]) * sfa[m, k // 16, l]
                                    * e2m1(B[n, k, l']) * sfb[n, k // 16, l']

where l' = l (batched) or the expert owning row m (grouped). alpha = input_scale *
weight_scale_2 (both dequant multipliers, the checkpoint convention) is read from a device fp32
vector in the epilogue, never baked into the kernel. Optionally the epilogue applies the fused
clamped SwiGLU of an L1 (w13) GEMM.

Legend: M rows (tokens), N out features, K in features (logical; packed bytes K // 2), L batch
groups (1 dense, G for wo_a), E experts, KB = K // 16.

Operands (raw device pointers + runtime extents; A and B K-major, e2m1x2 packed, element 2i in
the low nibble):
    a:     (L, M_a, K // 2) uint8         group l's rows start at row l * M_a
    b:     (L_b, N, K // 2) uint8         L_b = L (batched) or E (grouped)
    a_sf:  e4m3, the 128x4 blocked layout of the (L * pad128(M_a), KB) matrix: each group's own
           blocked matrix at byte offset l * pad128(M_a) * KB (`formats.assemble_group_scales`)
    b_sf:  e4m3, (L_b, N, KB), each group/expert blocked on its own (`formats.swizzle_scales`)
    out:   (M_c, N_out, L) bf16, N contiguous, runtime row stride sc_m and group stride sc_l
           (wo_a writes its (T, G, R) output in place: sc_m = G * R, sc_l = R)
    alpha: (L,) or (E,) fp32
    offs:  (E,) int32, grouped only: the cumulative END row of each expert's segment of `a`,
           each segment a multiple of 128 rows (`cutedsl.sm100.layout.moe_layout`)

Modes (compile-time):
    grouped=False  batched / dense. Grid (ceil(M_c / 128), N / tile_n, L). Rows >= M_c are not
                   stored; A rows past M_a read TMA zero fill.
    grouped=True   MoE: one A holding every expert's padded segment (M_a rows). The expert of a
                   128-row tile is found on the device by a binary search of `offs` (E <= 1023)
                   and used as the L coordinate of B / SFB, so no per-expert descriptor exists
                   and one compile serves every routing and every M. Tiles past offs[E - 1] run
                   no k-loop and store nothing. Grid (ceil(M_a / 128), N / tile_n, 1).
    swiglu_limit   (not None) fused clamped SwiGLU. The rows of w13 are interleaved
                   (`cutedsl.sm100.weight.interleave_w13`): b row 2i = gate row i, 2i + 1 = up
                   row i; the output has N_out = N / 2 columns and out[:, i] =
                   silu(min(g, limit)) * clamp(u, -limit, limit), g = alpha * acc[:, 2i],
                   u = alpha * acc[:, 2i + 1].

Warp roles (128 threads, one 128 x tile_n output tile per CTA, non-persistent, cluster 1x1):
    warp 0      TMA loads of A / B / SFA / SFB into a num_ab_stage shared-memory ring
                (num_ab_stage - 2 k-tiles in flight ahead), UTCCP shared -> TMEM scale copies,
                and the tcgen05 block-scaled MMAs (4 per 256-wide k-tile, scales in TMEM next to
                the fp32 accumulator)
    warps 0-3   epilogue: tcgen05.ld 32dp32b (thread = accumulator row), alpha (and SwiGLU),
                16 B bf16 stores per row with a per-row predicate
No TMA store, no 2-CTA MMA, no split-K: a decode GEMM runs N / 128 CTAs per group.

Compile-time: tile_n (128), grouped, swiglu_limit, num_ab_stage (4), the arch.
Runtime: M_a, M_c, N, K, L, E, sc_m, sc_l, the pointers and the stream; one compile per mode
serves every shape.

Constraints (`Sm100Nvfp4GemmKernel.can_implement`): K % 256 == 0, N % tile_n == 0, M_a >= 1,
16 B aligned pointers, sc_m % 8 == 0, sc_l % 8 == 0; grouped: 1 <= E <= 1023, offs
non-decreasing, every offs[e] % 128 == 0, offs[E - 1] <= M_a. 32-bit offsets: M_a * K, N * K and
M_c * N * L below 2**31 elements (e.g. MoE rows * 7168 < 2**31: at most 299k padded rows).

CUDA graphs: no host synchronization; the grid depends on the extents only (never on the
routing, which lives in `offs` on the device).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

SF_VEC = 16
TILE_M = 128
TILE_K = 256  # 4 MMAs of K=64
MMA_K = 64
AB_DTYPE = cutlass.Float4E2M1FN
SF_DTYPE = cutlass.Float8E4M3FN
C_DTYPE = cutlass.BFloat16
MAX_EXPERTS = 1023  # 10 binary-search steps


def sf_layout(rows, k, l) -> cute.Layout:
    """Layout of the blocked e4m3 scales of an (rows, K, L) operand (rows % 128 == 0): each L
    index is its own `to_blocked` matrix of rows*K/16 bytes, L-major, i.e. the bytes of
    `formats.assemble_group_scales`. The kernel addresses SFA and SFB with it."""
    return blockscaled_utils.tile_atom_to_shape_SF((rows, k, l), SF_VEC)


def swiglu_acc_layout(m_c, n_out, l, sc_m, sc_l) -> cute.Layout:
    """The (M_c, N_out, L) output seen with the accumulator's column count 2*N_out: accumulator
    column j (interleaved gate/up) maps to output column j // 2, i.e. mode (2, N_out):(0, 1)."""
    return cute.make_layout((m_c, (2, n_out), l), stride=(sc_m, (0, 1), sc_l))


class Sm100Nvfp4GemmKernel:
    """NVFP4 x NVFP4 -> bf16 GEMM, dense / batched (wo_a) / MoE grouped, optional fused SwiGLU."""

    def __init__(
        self,
        tile_n: int = 128,
        grouped: bool = False,
        swiglu_limit: float | None = None,
        num_ab_stage: int = 4,
    ) -> None:
        if tile_n != 128:
            raise NotImplementedError(f"tile_n={tile_n}: only 128 is implemented")
        self.tile_n = tile_n
        self.grouped = grouped
        self.fuse_swiglu = swiglu_limit is not None
        self.swiglu_limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
        self.num_ab_stage = num_ab_stage
        self.num_acc_stage = 1
        self.threads = 128
        self.num_tmem_cols = 512
        self.mma_tiler = (TILE_M, tile_n, TILE_K)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,  # e2m1 (L, M_a, K) K-major
        b_ptr: cute.Pointer,  # e2m1 (L_b, N, K) K-major
        sfa_ptr: cute.Pointer,  # e4m3 blocked
        sfb_ptr: cute.Pointer,  # e4m3 blocked
        c_ptr: cute.Pointer,  # bf16 (M_c, N_out, L) strides (sc_m, 1, sc_l)
        alpha_ptr: cute.Pointer,  # fp32 (L,) or (E,)
        offs_ptr: cute.Pointer,  # int32 (E,) (grouped only; any int32 pointer otherwise)
        m_a: Int32,
        m_c: Int32,
        n: Int32,
        k: Int32,
        l: Int32,
        e: Int32,
        sc_m: Int32,
        sc_l: Int32,
        stream,
    ):
        k_ = cute.assume(k, TILE_K)
        n_ = cute.assume(n, self.tile_n)
        l_b = e if cutlass.const_expr(self.grouped) else l
        mA = cute.make_tensor(
            a_ptr, cute.make_layout((m_a, k_, l), stride=(k_, 1, cute.assume(m_a * k, TILE_K)))
        )
        mB = cute.make_tensor(
            b_ptr, cute.make_layout((n_, k_, l_b), stride=(k_, 1, cute.assume(n * k, TILE_K)))
        )
        # Scale tensors cover whole 128-row tiles (the blocked layout pads rows to 128).
        m_sf = (m_a + TILE_M - 1) // TILE_M * TILE_M
        mSFA = cute.make_tensor(sfa_ptr, sf_layout(m_sf, k_, l))
        mSFB = cute.make_tensor(sfb_ptr, sf_layout(n_, k_, l_b))
        n_out = n
        if cutlass.const_expr(self.fuse_swiglu):
            n_out = n // 2
        mC = cute.make_tensor(
            c_ptr,
            cute.make_layout(
                (m_c, n_out, l), stride=(cute.assume(sc_m, 8), 1, cute.assume(sc_l, 8))
            ),
        )
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout((l_b,)))
        mOffs = cute.make_tensor(offs_ptr, cute.make_layout((e,)))

        mma_op = tcgen05.MmaMXF4NVF4Op(
            SF_DTYPE,
            (TILE_M, self.tile_n, MMA_K),
            tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM,
        )
        tiled_mma = cute.make_tiled_mma(mma_op)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

        a_smem_staged = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler, AB_DTYPE, self.num_ab_stage
        )
        b_smem_staged = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler, AB_DTYPE, self.num_ab_stage
        )
        sfa_smem_staged = blockscaled_utils.make_smem_layout_sfa(
            tiled_mma, self.mma_tiler, SF_VEC, self.num_ab_stage
        )
        sfb_smem_staged = blockscaled_utils.make_smem_layout_sfb(
            tiled_mma, self.mma_tiler, SF_VEC, self.num_ab_stage
        )
        a_smem = cute.slice_(a_smem_staged, (None, None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, None, 0))
        sfa_smem = cute.slice_(sfa_smem_staged, (None, None, None, 0))
        sfb_smem = cute.slice_(sfb_smem_staged, (None, None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mA, a_smem, self.mma_tiler, tiled_mma, cluster_vmnk.shape
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mB, b_smem, self.mma_tiler, tiled_mma, cluster_vmnk.shape
        )
        tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            g2s,
            mSFA,
            sfa_smem,
            self.mma_tiler,
            tiled_mma,
            cluster_vmnk.shape,
            internal_type=cutlass.Int16,
        )
        tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            g2s,
            mSFB,
            sfb_smem,
            self.mma_tiler,
            tiled_mma,
            cluster_vmnk.shape,
            internal_type=cutlass.Int16,
        )
        self.tma_bytes = (
            cute.size_in_bytes(AB_DTYPE, a_smem)
            + cute.size_in_bytes(AB_DTYPE, b_smem)
            + cute.size_in_bytes(SF_DTYPE, sfa_smem)
            + cute.size_in_bytes(SF_DTYPE, sfb_smem)
        )

        m_rows = m_a if cutlass.const_expr(self.grouped) else m_c
        grid = (
            (m_rows + TILE_M - 1) // TILE_M,
            n // self.tile_n,
            1 if cutlass.const_expr(self.grouped) else l,
        )
        self.kernel(
            tiled_mma,
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_sfa,
            tma_sfa,
            tma_atom_sfb,
            tma_sfb,
            mC,
            mAlpha,
            mOffs,
            e,
            a_smem_staged,
            b_smem_staged,
            sfa_smem_staged,
            sfb_smem_staged,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA_mkl: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB_nkl: cute.Tensor,
        mC_mnl: cute.Tensor,
        mAlpha: cute.Tensor,
        mOffs: cute.Tensor,
        num_experts: Int32,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        sfa_smem_staged: cute.Layout,
        sfb_smem_staged: cute.Layout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, bidz = cute.arch.block_idx()

        # ------------------------------------------------------------ tile -> (m, n, group)
        m_tile = bidx
        n_tile = bidy
        a_l = bidz
        b_l = bidz
        tile_valid = cutlass.Boolean(True)
        if cutlass.const_expr(self.grouped):
            # expert = #{e : offs[e] <= first row of the tile} (offs non-decreasing).
            row0 = m_tile * TILE_M
            lo = Int32(0)
            hi = num_experts
            for _ in cutlass.range_constexpr(10):
                if lo < hi:
                    mid = (lo + hi) // 2
                    if mOffs[mid] <= row0:
                        lo = mid + 1
                    else:
                        hi = mid
            tile_valid = lo < num_experts
            a_l = Int32(0)
            b_l = lo
            if lo >= num_experts:
                b_l = num_experts - 1

        # ------------------------------------------------------------ shared storage
        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
            tmem_holding_buf: Int32

        smem = utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # (MMA, MMA_M, MMA_K, STAGE)
        sA = smem.allocate_tensor(
            element_type=AB_DTYPE,
            layout=a_smem_staged.outer,
            byte_alignment=128,
            swizzle=a_smem_staged.inner,
        )
        # (MMA, MMA_N, MMA_K, STAGE)
        sB = smem.allocate_tensor(
            element_type=AB_DTYPE,
            layout=b_smem_staged.outer,
            byte_alignment=128,
            swizzle=b_smem_staged.inner,
        )
        sSFA = smem.allocate_tensor(
            element_type=SF_DTYPE, layout=sfa_smem_staged, byte_alignment=128
        )
        sSFB = smem.allocate_tensor(
            element_type=SF_DTYPE, layout=sfb_smem_staged, byte_alignment=128
        )

        # ------------------------------------------------------------ pipelines
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tma_bytes,
        ).make_participants()
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads),
        ).make_participants()

        # ------------------------------------------------------------ global partitions
        # (bM, bK, RestM, RestK, RestL)
        gA = cute.local_tile(mA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None,) * 3)
        gB = cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None,) * 3)
        gSFA = cute.local_tile(mSFA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None,) * 3)
        gSFB = cute.local_tile(mSFB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None,) * 3)
        k_tiles = cute.size(gA, mode=[3])
        if not tile_valid:
            k_tiles = Int32(0)

        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgB = thr_mma.partition_B(gB)  # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma.partition_B(gSFB)

        one = cute.make_layout(1)
        # ((atom_v, rest_v), STAGE) / ((atom_v, rest_v), RestM, RestK, RestL)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, 0, one, cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, one, cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
        )
        tAsSFA, tAgSFA = cpasync.tma_partition(
            tma_atom_sfa, 0, one, cute.group_modes(sSFA, 0, 3), cute.group_modes(tCgSFA, 0, 3)
        )
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cpasync.tma_partition(
            tma_atom_sfb, 0, one, cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3)
        )
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)
        # ((atom_v, rest_v), RestK)
        tAgA = tAgA[(None, m_tile, None, a_l)]
        tBgB = tBgB[(None, n_tile, None, b_l)]
        tAgSFA = tAgSFA[(None, m_tile, None, a_l)]
        tBgSFB = tBgSFB[(None, n_tile, None, b_l)]

        # ------------------------------------------------------------ TMEM: acc + scales
        tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)  # (MMA, MMA_N, MMA_K, STAGE)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(acc_shape)  # (MMA, MMA_M, MMA_N)

        tmem_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.threads)
        tmem = utils.TmemAllocator(storage.tmem_holding_buf, barrier_for_retrieve=tmem_barrier)
        tmem.allocate(self.num_tmem_cols)
        tmem.wait_for_alloc()
        acc_tmem_ptr = tmem.retrieve_ptr(Float32)
        tCtAcc = cute.make_tensor(acc_tmem_ptr, tCtAcc_fake.layout)

        sfa_tmem_ptr = cute.recast_ptr(
            acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc), dtype=SF_DTYPE
        )
        tCtSFA = cute.make_tensor(
            sfa_tmem_ptr,
            blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem_staged, (None,) * 3 + (0,))
            ),
        )  # (MMA, MMA_M, MMA_K)
        sfb_tmem_ptr = cute.recast_ptr(
            acc_tmem_ptr
            + tcgen05.find_tmem_tensor_col_offset(tCtAcc)
            + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
            dtype=SF_DTYPE,
        )
        tCtSFB = cute.make_tensor(
            sfb_tmem_ptr,
            blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem_staged, (None,) * 3 + (0,))
            ),
        )  # (MMA, MMA_N, MMA_K)

        # smem -> TMEM scale copies (UTCCP)
        s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), SF_DTYPE)
        tCtSFA_c = cute.filter_zeros(tCtSFA)
        s2t_sfa = tcgen05.make_s2t_copy(s2t_atom, tCtSFA_c)
        thr_s2t_sfa = s2t_sfa.get_slice(0)
        tCsSFA_s2t = tcgen05.get_s2t_smem_desc_tensor(
            s2t_sfa, thr_s2t_sfa.partition_S(cute.filter_zeros(sSFA))
        )  # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K, STAGE)
        tCtSFA_s2t = thr_s2t_sfa.partition_D(tCtSFA_c)
        tCtSFB_c = cute.filter_zeros(tCtSFB)
        s2t_sfb = tcgen05.make_s2t_copy(s2t_atom, tCtSFB_c)
        thr_s2t_sfb = s2t_sfb.get_slice(0)
        tCsSFB_s2t = tcgen05.get_s2t_smem_desc_tensor(
            s2t_sfb, thr_s2t_sfb.partition_S(cute.filter_zeros(sSFB))
        )
        tCtSFB_s2t = thr_s2t_sfb.partition_D(tCtSFB_c)

        # ------------------------------------------------------------ mainloop (warp 0)
        if warp_idx == 0:
            acc_empty = acc_producer.acquire_and_advance()
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _k in cutlass.range(k_tiles, prefetch_stages=self.num_ab_stage - 2):
                ab_empty = ab_producer.acquire_and_advance()
                cute.copy(
                    tma_atom_a,
                    tAgA[(None, ab_empty.count)],
                    tAsA[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
                cute.copy(
                    tma_atom_b,
                    tBgB[(None, ab_empty.count)],
                    tBsB[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
                cute.copy(
                    tma_atom_sfa,
                    tAgSFA[(None, ab_empty.count)],
                    tAsSFA[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )
                cute.copy(
                    tma_atom_sfb,
                    tBgSFB[(None, ab_empty.count)],
                    tBsSFB[(None, ab_empty.index)],
                    tma_bar_ptr=ab_empty.barrier,
                )

                ab_full = ab_consumer.wait_and_advance()
                stage = (None, None, None, None, ab_full.index)
                cute.copy(s2t_sfa, tCsSFA_s2t[stage], tCtSFA_s2t)
                cute.copy(s2t_sfb, tCsSFB_s2t[stage], tCtSFB_s2t)
                for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                    tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                    cute.gemm(
                        tiled_mma,
                        tCtAcc,
                        tCrA[(None, None, kb, ab_full.index)],
                        tCrB[(None, None, kb, ab_full.index)],
                        tCtAcc,
                    )
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_full.release()
            acc_empty.commit()

        # ------------------------------------------------------------ epilogue (all warps)
        t2r_atom = cute.make_copy_atom(
            tcgen05.Ld32x32bOp(tcgen05.Repetition.x128, tcgen05.Pack.NONE), Float32
        )
        t2r = tcgen05.make_tmem_copy(t2r_atom, tCtAcc)
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tCtAcc)  # (T2R_M, T2R_N, EPI_M, EPI_N)

        # The output viewed with the accumulator's (M, N) tile shape: with the fused SwiGLU the
        # accumulator column j maps to output column j // 2 (column mode (2, N/2):(0, 1)).
        if cutlass.const_expr(self.fuse_swiglu):
            n_acc = cute.size(mC_mnl, mode=[1]) * 2
            mC_acc = cute.make_tensor(
                mC_mnl.iterator,
                swiglu_acc_layout(
                    cute.size(mC_mnl, mode=[0]),
                    n_acc // 2,
                    cute.size(mC_mnl, mode=[2]),
                    mC_mnl.stride[0],
                    mC_mnl.stride[2],
                ),
            )
        else:
            mC_acc = mC_mnl
        c_l = a_l
        gC = cute.local_tile(
            mC_acc, cute.slice_(self.mma_tiler, (None, None, 0)), (m_tile, n_tile, c_l)
        )  # (bM, bN)
        cC = cute.local_tile(
            cute.make_identity_tensor(mC_acc.shape),
            cute.slice_(self.mma_tiler, (None, None, 0)),
            (m_tile, n_tile, c_l),
        )
        tTR_gC = thr_t2r.partition_D(thr_mma.partition_C(gC))
        tTR_cC = thr_t2r.partition_D(thr_mma.partition_C(cC))
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC.shape, Float32)
        tTR_rC = cute.make_rmem_tensor(tTR_gC.shape, C_DTYPE)
        simt_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), C_DTYPE)

        tmem.relinquish_alloc_permit()
        acc_full = acc_consumer.wait_and_advance()
        cute.copy(t2r, tTR_tAcc, tTR_rAcc)
        alpha = mAlpha[b_l]
        row = tTR_cC[0][0]  # 32dp32b: the whole fragment is one row (thread = TMEM lane)
        store = tile_valid and row < cute.size(mC_mnl, mode=[0])
        if cutlass.const_expr(self.fuse_swiglu):
            # Fragment (((2, 64), 1), 1, 1, 1): sub-mode 0 is (gate, up) of one output column;
            # register 2i is gate i, 2i+1 is up i (checked on the traced layouts).
            half = (((0, None), None), None, None, None)
            tTR_gH = tTR_gC[half]  # 64 contiguous bf16 of this row
            rH = cute.make_rmem_tensor(tTR_gH.shape, Float32)
            rHc = cute.make_rmem_tensor(tTR_gH.shape, C_DTYPE)
            lim = Float32(self.swiglu_limit)
            for i in cutlass.range_constexpr(cute.size(tTR_rAcc) // 2):
                # min(x, L) = -max(-x, -L) (no fmin in cute.arch).
                g = -cute.arch.fmax(-(tTR_rAcc[2 * i] * alpha), -lim)
                u = -cute.arch.fmax(-cute.arch.fmax(tTR_rAcc[2 * i + 1] * alpha, -lim), -lim)
                rH[i] = g / (Float32(1.0) + cute.math.exp(-g)) * u
            rHc.store(rH.load().to(C_DTYPE))
            if store:
                cute.copy(simt_atom, rHc, tTR_gH)
        else:
            tTR_rC.store((tTR_rAcc.load() * alpha).to(C_DTYPE))
            if store:
                cute.copy(simt_atom, tTR_rC, tTR_gC)
        acc_full.release()

        cute.arch.barrier()
        tmem.free(acc_tmem_ptr)

    @staticmethod
    def can_implement(
        m_a: int, m_c: int, n: int, k: int, *, grouped: bool, swiglu: bool, e: int = 1
    ) -> bool:
        """Whether the kernel supports these extents (module docstring, "Constraints"); runs on
        the host without a GPU. e is L for batched, E for grouped."""
        if k <= 0 or k % TILE_K != 0 or n <= 0 or n % 128 != 0 or m_a < 1:
            return False
        groups = 1 if grouped else max(e, 1)
        # 32-bit values: the L strides M_a*K and N*K (TMA applies them in hardware, 64-bit), and
        # the epilogue's output offsets (< M_c*N*L elements).
        if m_a * k >= 2**31 or n * k >= 2**31 or max(m_a, m_c) * n * groups >= 2**31:
            return False
        if grouped:
            return 1 <= e <= MAX_EXPERTS
        return m_c >= 1


def compile_gemm(
    grouped: bool = False,
    swiglu_limit: float | None = None,
    tile_n: int = 128,
    no_jit_engine: bool = False,
    options: str | None = None,
):
    """`cute.compile` of one GEMM variant from fake pointers (every extent is a runtime argument).

    grouped, swiglu_limit, tile_n: the codegen arguments (module docstring, "Modes"); callers
    cache the result per value (`cutedsl.jit.compiled`). no_jit_engine / options: passed to
    `cute.compile` (no_jit_engine=True: compile only, for `make check-kernels`)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    fake = 0x10000000
    gmem = cute.AddressSpace.gmem
    args = (
        make_ptr(AB_DTYPE, fake, gmem, assumed_align=16),
        make_ptr(AB_DTYPE, fake, gmem, assumed_align=16),
        make_ptr(SF_DTYPE, fake, gmem, assumed_align=16),
        make_ptr(SF_DTYPE, fake, gmem, assumed_align=16),
        make_ptr(C_DTYPE, fake, gmem, assumed_align=16),
        make_ptr(Float32, fake, gmem, assumed_align=4),
        make_ptr(Int32, fake, gmem, assumed_align=4),
        128,  # m_a
        128,  # m_c
        256,  # n
        256,  # k
        1,  # l
        1,  # e
        256,  # sc_m
        256,  # sc_l
        cuda.CUstream(0),
    )
    kernel = Sm100Nvfp4GemmKernel(tile_n=tile_n, grouped=grouped, swiglu_limit=swiglu_limit)
    kw = {"no_jit_engine": no_jit_engine}
    if options:
        kw["options"] = options
    return cute.compile(kernel, *args, **kw)


_MMA_PTX = r"tcgen05\.mma.*kind::mxf4nvf4\.block_scale"


def check_targets():
    """`make check-kernels` targets: every SM100 GEMM variant, compiled for sm_100a from fakes."""
    from cutedsl.kernels.checks import KernelTarget

    sass = (r"UTCOMMA", r"UTCCP")
    return [
        KernelTarget(
            name="sm100.nvfp4_gemm.batched",
            arch="sm_100a",
            compile=lambda: compile_gemm(no_jit_engine=True),
            ptx_patterns=(_MMA_PTX,),
            sass_patterns=sass,
        ),
        KernelTarget(
            name="sm100.nvfp4_gemm.grouped_offs",
            arch="sm_100a",
            compile=lambda: compile_gemm(grouped=True, no_jit_engine=True),
            ptx_patterns=(_MMA_PTX,),
            sass_patterns=sass,
        ),
        KernelTarget(
            name="sm100.nvfp4_gemm.batched_swiglu",
            arch="sm_100a",
            compile=lambda: compile_gemm(swiglu_limit=10.0, no_jit_engine=True),
            ptx_patterns=(_MMA_PTX,),
            sass_patterns=sass,
        ),
        KernelTarget(
            name="sm100.nvfp4_gemm.grouped_offs_swiglu",
            arch="sm_100a",
            compile=lambda: compile_gemm(grouped=True, swiglu_limit=10.0, no_jit_engine=True),
            ptx_patterns=(_MMA_PTX,),
            sass_patterns=sass,
        ),
    ]
