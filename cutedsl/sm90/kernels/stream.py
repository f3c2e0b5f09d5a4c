"""Hopper (sm_90a) NVFP4 W4A16 decode GEMM that streams the weight like a copy (M <= tile_m <= 32).

Legend: M tokens, N out features, K in features (logical), L weight groups (G o-proj groups; 1 for
a dense linear), W consumer warpgroups per CTA, R = 64 W weight rows per unit, KP = K / 128,
NT = N / R row tiles, U = L * NT * KP units, G CTAs (the grid; the host launches a few per SM).

Math (per group l):  out[l][m, n] = gs[l] * sum_k a[l][m, k] * (e2m1(w[l][n, k]) * sf[l][n, k // 16])
  a        (M, K, L)           bf16, K-major (dense: L = 1)                  activations
  blob     (bytes,)            uint8, the stream layout of `cutedsl.sm90.stream_weight`
                               ([L, KP, N/64, 4608]: codes and e5m3 scales of the sm90 encoding)
  gs       (L,)                fp32 global scale, applied in the epilogue
  out      (N, M, L)           bf16 view of a row-major (L, M, N) tensor: element (n, m, l) is
                               out[l][m, n] above, rounded once (RN) from fp32; tokens m >= M and
                               nothing else of `out` are left untouched
  partial  (R * tile_m, 2, G)  fp32 scratch: CTA c's partial sums of its first / last row tile
  counters (L * NT,)           int32, zero before the launch and zero after it (each row tile's
                               arrivals; the last arrival resets it)

Schedule (stream-K over the weight bytes): unit u = (l, t, j), j fastest, is the R rows of row
tile t of group l times K pair j: one contiguous W * 4608-byte piece of `blob` and the activations
a[l][:, 128 j : 128 j + 128]. CTA c streams units [c U / G, (c + 1) U / G) (floors), so every CTA
moves the same bytes within one unit, whatever N, K and L; a row tile whose units one CTA holds
entirely is written from its registers, one split over CTAs c_first..c_last is summed in CTA
order (deterministic, whoever arrives last) by the last CTA to arrive, from `partial`. CTA c parks
the partial of its first row tile in slot 0 and of its last in slot 1 (a CTA has at most those
two split tiles). No CTA ever waits for another: no co-residency assumption, no deadlock.

Per CTA: W consumer warpgroups and one producer warp.
  - the producer warp copies unit after unit into a ring of `stages` units: the weight piece with
    one `cp.async.bulk` (L2 evict-first: each weight byte is read once per launch) and the two
    64-wide activation tiles with TMA (128B swizzle, the WGMMA B layout; rows past M are
    zero-filled), all on the stage's full mbarrier; it never stops at a row tile boundary, so the
    stream does not drain between tiles and the epilogue of one tile overlaps the next loads.
  - each consumer warpgroup owns 64 of the R rows; each thread reads its fragment of a unit with
    three 128-bit shared loads (two code records, one scale record, `stream_weight`), decodes it
    with the sm90 register decode (`cutedsl.sm90.kernels.decode`: bit-exact e2m1 x e4m3 in bf16,
    up to the 2^-19 that the epilogue's gs * 2^19 undoes) straight into the register A operand
    and issues 8 RS-WGMMA (64 x tile_m x 16) on the unit (swap-AB: weights are A, tokens B). The
    decode of unit i + 1 runs while the WGMMAs of unit i are in flight (two fragment buffers).
  - epilogue of a row tile: acc * gs * 2^19 -> bf16 from registers (whole tile), or the partial
    protocol above (fp32 stores, fence, one atomic per tile, ordered sum by the last arrival).

Compile-time: W (1, 2), tile_m (16, 32), stages. Runtime: M, N, K, L, G, pointers, stream.
Graph safety: no host sync, no allocation; the grid is the partial scratch's G.
Constraints: M <= tile_m, N % R == 0, K % 128 == 0, G <= U (every CTA holds a unit, so every
contributor of a split tile arrives).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.cutlass_dsl import T, dsl_user_op

from cutedsl.kernels import device_utils as du
from cutedsl.kernels.checks import KernelTarget
from cutedsl.sm90.kernels import decode as dec
from cutedsl.sm90.stream_weight import CHUNK, CODE_BYTES, KPAIR
from cutedsl.sm90.weight import DECODE_BIAS

BK = 64  # K per WGMMA K tile (one 128-byte swizzle atom of bf16 activations)
SMEM_CAPACITY = 232448  # sm_90 dynamic shared memory per CTA (227 KiB)
MAX_STAGES = 16
# W = 4 is 17 warps with the producer: 5 on one SM sub-partition cap registers at 96 (spills)
WARPGROUPS = (1, 2)
TILE_MS = (16, 32)


# ------------------------------------------------------------------------------ PTX helpers


@dsl_user_op
def bulk_g2s(dst: Int32, src: Int64, nbytes: int, mbar: Int32, *, loc=None, ip=None) -> None:
    """`cp.async.bulk` of `nbytes` (a multiple of 16) contiguous global bytes at `src` to shared
    `dst` (both 16-byte aligned), completing on the mbarrier at `mbar`; L2 evict-first policy (the
    weight is read once per launch; PTX ISA `createpolicy`)."""
    ops = [
        Int32(dst).ir_value(loc=loc, ip=ip),
        Int64(src).ir_value(loc=loc, ip=ip),
        Int32(mbar).ir_value(loc=loc, ip=ip),
    ]
    text = (
        "{\n.reg .b64 pol;\n"
        "createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
        f"[$0], [$1], {nbytes}, [$2], pol;\n}}"
    )
    du.asm(None, ops, text, "r,l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_f32(addr: Int64, vals: tuple, *, loc=None, ip=None) -> None:
    """128-bit store of four fp32 values to a global byte address (16-byte aligned)."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)]
    ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in vals]
    text = "st.global.v4.f32 [$0], {$1, $2, $3, $4};"
    du.asm(None, ops, text, "l,f,f,f,f", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_v4_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, ...]:
    """128-bit load of four fp32 values cached in L2 only (`.cg`: another CTA wrote them in this
    launch; L1 is not coherent); volatile, so it stays after the barrier that orders it."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)]
    ty = ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>")
    text = "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];"
    res = du.asm(ty, ops, text, "=f,=f,=f,=f,l", side_effects=True, loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def fence_gpu(*, loc=None, ip=None) -> None:
    """`fence.acq_rel.gpu`: this thread's global writes are ordered before its later writes
    (here: the tile's arrival) for every thread of the GPU."""
    du.asm(None, [], "fence.acq_rel.gpu;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def atom_add_acq_rel_gpu(addr: Int64, v: Int32, *, loc=None, ip=None) -> Int32:
    """`atom.acq_rel.gpu.global.add.s32`: the old value of the int32 at `addr`."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)]
    text = "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;"
    return Int32(du.asm(T.i32(), ops, text, "=r,l,r", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_relaxed_gpu_s32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """`st.relaxed.gpu.global.s32` (the counter reset)."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)]
    du.asm(None, ops, "st.relaxed.gpu.global.s32 [$0], $1;", "l,r", side_effects=True, loc=loc,
           ip=ip)  # fmt: skip


# ------------------------------------------------------------------------------ the kernel


def stage_bytes(warpgroups: int, tile_m: int) -> int:
    """Bytes of one ring stage (one unit): the weight piece and two activation tiles."""
    return warpgroups * CHUNK + 2 * tile_m * BK * 2


def default_stages(warpgroups: int, tile_m: int, ctas_per_sm: int = 1) -> int:
    """The deepest ring (<= MAX_STAGES) that lets `ctas_per_sm` CTAs share an SM's shared memory:
    the bytes in flight per SM are what a stream needs (Little's law: bandwidth x latency)."""
    per = stage_bytes(warpgroups, tile_m)
    return max(2, min(MAX_STAGES, (SMEM_CAPACITY // ctas_per_sm - 3072) // per))


class Sm90StreamW4A16DecodeKernel:
    """Streaming W4A16 NVFP4 decode GEMM for sm_90a (module docstring). `__init__` takes codegen
    configuration only."""

    def __init__(self, warpgroups: int = 2, tile_m: int = 16, stages: int | None = None):
        if warpgroups not in WARPGROUPS:
            raise ValueError(f"warpgroups must be one of {WARPGROUPS}, got {warpgroups}")
        if tile_m not in TILE_MS:
            raise ValueError(f"tile_m must be one of {TILE_MS}, got {tile_m}")
        self.wg = warpgroups
        self.tile_m = tile_m
        self.rows = 64 * warpgroups
        self.consumers = 128 * warpgroups
        self.threads = self.consumers + 32
        self.load_warp = self.consumers // 32
        self.unit_w = warpgroups * CHUNK
        self.stages = stages if stages is not None else default_stages(warpgroups, tile_m)
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be in [2, {MAX_STAGES}], got {self.stages}")
        if self.stages * stage_bytes(warpgroups, tile_m) + 2048 > SMEM_CAPACITY:
            raise ValueError(
                f"{self.stages} stages of {stage_bytes(warpgroups, tile_m)} B overflow"
            )
        self.tx_bytes = stage_bytes(warpgroups, tile_m)

    @staticmethod
    def can_implement(n: int, k: int, warpgroups: int) -> bool:
        """GPU-free shape check (M <= tile_m is the launcher's)."""
        return n > 0 and k > 0 and n % (64 * warpgroups) == 0 and k % KPAIR == 0

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L) bf16 K-major
        blob: cute.Tensor,  # (bytes,) uint8
        gs: cute.Tensor,  # (L,) fp32
        out: cute.Tensor,  # (N, M, L) bf16 N-major
        partial: cute.Tensor,  # (R * tile_m, 2, G) fp32
        counters: cute.Tensor,  # (L * N / R,) int32
        stream: cuda.CUstream,
    ):
        rowmajor = utils.LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            rowmajor.sm90_mma_major_mode(),
            rowmajor.sm90_mma_major_mode(),
            cutlass.Float32,
            (self.wg, 1, 1),
            tiler_mn=(64, self.tile_m),
            a_source=cute.nvgpu.warpgroup.OperandSource.RMEM,
        )
        # Activations: a ring of 2 * stages K-major SW128 tiles (two per unit), the WGMMA B operand.
        sa_layout = sm90_utils.make_smem_layout_b(
            rowmajor, (self.rows, self.tile_m, BK), cutlass.BFloat16, 2 * self.stages
        )
        tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            a,
            cute.slice_(sa_layout, (None, None, 0)),
            (self.tile_m, BK),
        )

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            flag: cute.struct.MemRange[cutlass.Int32, 4]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sa_layout)], 1024
            ]
            sW: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, self.stages * self.unit_w], 128
            ]

        self.shared_storage = SharedStorage
        grid = (cute.size(partial, mode=[2]), 1, 1)
        self.kernel(tma_a, mA, blob, gs, out, partial, counters, tiled_mma, sa_layout).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        mBlob: cute.Tensor,
        mGS: cute.Tensor,
        mC: cute.Tensor,
        mP: cute.Tensor,
        mCnt: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        flag = storage.flag.get_tensor(cute.make_layout(4))
        sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sW_addr = storage.sW.data_ptr().toint()

        # full[s] at full + 8 s: one arrival (the producer's expect_tx) + the unit's bytes;
        # empty[s] at empty + 8 s: one arrival per consumer warp once its WGMMAs read the stage.
        full = mbar.toint()
        empty = full + 8 * self.stages
        if tidx == 0:
            for st in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(mbar + st, 1)
                cute.arch.mbarrier_init(mbar + self.stages + st, self.consumers // 32)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # ---------------------------------------------------------------- this CTA's units
        rows = cute.size(mA, mode=[0])
        kp = cute.size(mA, mode=[1]) // KPAIR
        n_tiles = cute.size(mC, mode=[0]) // self.rows
        nb64 = cute.size(mC, mode=[0]) // 64
        units = cute.size(mGS, mode=[0]) * n_tiles * kp
        sched = (kp, n_tiles, units, n_ctas)
        u0 = self._unit_start(cta, sched)
        n_units = self._unit_start(cta + 1, sched) - u0

        if n_units > 0:
            if warp_idx == self.load_warp:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                gA = cute.local_tile(mA, (self.tile_m, BK), (0, None, None))
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sA, 0, 2),
                    cute.group_modes(gA, 0, 2),
                )
                blob_addr = mBlob.iterator.toint()
                self._produce(
                    u0, n_units, kp, n_tiles, nb64, mbar, full, empty, sW_addr, blob_addr,
                    tma_a, tAgA, tAsA,
                )  # fmt: skip
            else:
                self._consume(
                    tidx, u0, n_units, sched, rows, full, empty, sW_addr, sA, mGS, mC, mP, mCnt,
                    flag, tiled_mma,
                )  # fmt: skip

    # ---------------------------------------------------------------- schedule arithmetic

    @cute.jit
    def _unit_start(self, c, sched):
        """First unit of CTA c: floor(c * U / G) (int64 product)."""
        _, _, units, n_ctas = sched
        return Int32((Int64(c) * Int64(units)) // Int64(n_ctas))

    @cute.jit
    def _cta_of(self, u, sched):
        """The CTA whose units hold unit u: the largest c with floor(c U / G) <= u, that is
        floor(((u + 1) G - 1) / U)."""
        _, _, units, n_ctas = sched
        return Int32((Int64(u + 1) * Int64(n_ctas) - 1) // Int64(units))

    # ---------------------------------------------------------------- producer

    @cute.jit
    def _produce(
        self, u0, n_units, kp, n_tiles, nb64, mbar, full, empty, sW_addr, blob_addr, tma_a,
        tAgA, tAsA,
    ):  # fmt: skip
        """Unit after unit into ring stage s (= i % stages), once the consumers released the
        stage's previous unit (from the second pass on): its weight piece (one bulk copy) and
        its two activation tiles (TMA), all on full[s]."""
        s = Int32(0)
        ph = Int32(0)  # parity of the current pass over the ring
        tile = u0 // kp
        j = u0 - tile * kp
        for i in cutlass.range(n_units, unroll=1):
            if i >= self.stages:
                du.mbar_wait(empty + s * 8, ph ^ 1)
            grp = tile // n_tiles
            t = tile - grp * n_tiles
            src = blob_addr + (Int64((grp * kp + j) * nb64) + Int64(t * self.wg)) * CHUNK
            with cute.arch.elect_one():
                du.mbar_arrive_expect_tx(full + s * 8, self.tx_bytes)
                bulk_g2s(sW_addr + s * self.unit_w, src, self.unit_w, full + s * 8)
            for kt in cutlass.range_constexpr(2):
                cute.copy(
                    tma_a,
                    tAgA[(None, 2 * j + kt, grp)],
                    tAsA[(None, 2 * s + kt)],
                    tma_bar_ptr=mbar + s,
                )
            s = s + 1
            if s == self.stages:
                s = Int32(0)
                ph = ph ^ 1
            j = j + 1
            if j == kp:
                j = Int32(0)
                tile = tile + 1

    # ---------------------------------------------------------------- consumers

    @cute.jit
    def _consume(
        self, tidx, u0, n_units, sched, rows, full, empty, sW_addr, sA, mGS, mC, mP, mCnt, flag,
        tiled_mma,
    ):  # fmt: skip
        """The consumer warpgroups: per unit, WGMMA on the fragment decoded the step before, the
        decode of the next unit while they run, the stage's release, and at the end of a row
        tile (or of the CTA's units) its epilogue. Unrolled by 2 so the fragment buffer of each
        step is compile-time."""
        kp = sched[0]
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lane = tidx % 32
        t_in = tidx % 128
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCsA = thr_mma.partition_B(sA)
        tCrA = tiled_mma.make_fragment_B(tCsA)
        a_shape = tiled_mma.partition_shape_A((self.rows, BK))
        frags = (
            (tiled_mma.make_fragment_A(a_shape), tiled_mma.make_fragment_A(a_shape)),
            (tiled_mma.make_fragment_A(a_shape), tiled_mma.make_fragment_A(a_shape)),
        )
        thr_epi = tiled_mma.get_slice(tidx)
        cC = cute.make_identity_tensor((self.rows, self.tile_m))
        tCcC = thr_epi.partition_C(cC)
        acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        # this thread's records inside a unit's piece (`stream_weight`)
        code_off = wg * CHUNK + t_in * 16
        scale_off = wg * CHUNK + 2 * CODE_BYTES + (t_in // 4) * 16

        s = Int32(0)
        ph = Int32(0)
        tile = u0 // kp
        j = u0 - tile * kp
        du.mbar_wait(full, 0)
        self._decode(frags[0], sW_addr + code_off, sW_addr + scale_off)
        for i2 in cutlass.range((n_units + 1) // 2, unroll=1):
            for h in cutlass.range_constexpr(2):
                i = i2 * 2 + h
                if i < n_units:
                    # unit i: WGMMA on frags[h] and stage s
                    cute.nvgpu.warpgroup.fence()
                    for kt in cutlass.range_constexpr(2):
                        for kb in cutlass.range_constexpr(BK // 16):
                            cute.gemm(
                                tiled_mma,
                                acc,
                                frags[h][kt][(None, None, kb)],
                                tCrA[(None, None, kb, 2 * s + kt)],
                                acc,
                            )
                    cute.nvgpu.warpgroup.commit_group()
                    # the next unit's stage and parity
                    sn = s + 1
                    phn = ph
                    if sn == self.stages:
                        sn = Int32(0)
                        phn = ph ^ 1
                    if i + 1 < n_units:  # decode unit i + 1 while unit i's WGMMAs run
                        du.mbar_wait(full + sn * 8, phn)
                        base = sW_addr + sn * self.unit_w
                        self._decode(frags[1 - h], base + code_off, base + scale_off)
                    cute.nvgpu.warpgroup.wait_group(0)
                    if lane == 0:
                        du.mbar_arrive(empty + s * 8)
                    if j == kp - 1 or i == n_units - 1:
                        self._epilogue(acc, tCcC, thr_epi, tidx, tile, u0, sched, rows, mGS, mC,
                                       mP, mCnt, flag)  # fmt: skip
                        acc.fill(0.0)
                    s = sn
                    ph = phn
                    j = j + 1
                    if j == kp:
                        j = Int32(0)
                        tile = tile + 1

    @cute.jit
    def _decode(self, frag_pair, code_addr, scale_addr):
        """This thread's fragment of one unit (2 rows x 32 K values of each of its two K tiles):
        three 128-bit shared loads, the sm90 register decode, into the A fragments `frag_pair`."""
        sc = du.ld_shared_v4_b32(scale_addr)  # (kt 0: row0, row0 + 8), (kt 1: row0, row0 + 8)
        for kt in cutlass.range_constexpr(2):
            c = du.ld_shared_v4_b32(code_addr + kt * CODE_BYTES)  # (row0: q0, q1), (row0 + 8: ..)
            f32 = cute.recast_tensor(frag_pair[kt], cutlass.Int32)  # (4 regs, 1, 4 k16 blocks)
            for rr in cutlass.range_constexpr(2):  # rows row0, row0 + 8
                sw = dec.e5m3x4_to_bf16x2x2(sc[2 * kt + rr])
                for q in cutlass.range_constexpr(2):  # K blocks 2q, 2q + 1
                    w0, w1, w2, w3 = dec.nvfp4x8_to_bf16x2x4(c[2 * rr + q], sw[q])
                    # fragment reg (v1 = row + 8, v2 = k + 8) + 4 * k16 block
                    f32[rr + 0 + 4 * (2 * q)] = w0
                    f32[rr + 2 + 4 * (2 * q)] = w1
                    f32[rr + 0 + 4 * (2 * q + 1)] = w2
                    f32[rr + 2 + 4 * (2 * q + 1)] = w3

    @cute.jit
    def _store(self, acc, tCcC, thr_epi, tile, sched, rows, mGS, mC):
        """acc * gs * 2^19 -> bf16 into out for tokens < M (the C fragment: rows of this thread's
        warpgroup, token columns)."""
        n_tiles = sched[1]
        grp = tile // n_tiles
        t = tile - grp * n_tiles
        scale = mGS[grp] * DECODE_BIAS  # the decode's products are e2m1 * sf * 2^-19
        gC = cute.local_tile(mC, (self.rows, self.tile_m), (t, 0, grp))
        tCgC = thr_epi.partition_C(gC)
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tCcC[i][1] < rows:
                tCgC[i] = (acc[i] * scale).to(mC.element_type)

    @cute.jit
    def _epilogue(self, acc, tCcC, thr_epi, tidx, tile, u0, sched, rows, mGS, mC, mP, mCnt, flag):
        """The end of this CTA's units of row tile `tile`: store it when the CTA held all of its
        units, else park the partial, count the arrival, and, the last to arrive, sum every
        contributor's partial in CTA order and store."""
        kp = sched[0]
        c_first = self._cta_of(tile * kp, sched)
        c_last = self._cta_of(tile * kp + kp - 1, sched)
        if c_first == c_last:
            self._store(acc, tCcC, thr_epi, tile, sched, rows, mGS, mC)
        else:
            elems = cute.size(acc)
            slot_elems = self.rows * self.tile_m
            p_base = mP.iterator.toint()
            cta, _, _ = cute.arch.block_idx()
            mine = p_base + Int64(cta * 2 + self._slot(cta, tile, sched)) * (slot_elems * 4)
            for c in cutlass.range_constexpr(elems // 4):
                addr = mine + Int64((c * self.consumers + tidx) * 4) * 4
                st_global_v4_f32(addr, tuple(acc[c * 4 + v] for v in range(4)))
            fence_gpu()
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumers)
            if tidx == 0:
                cnt = mCnt.iterator.toint() + Int64(tile) * 4
                old = atom_add_acq_rel_gpu(cnt, Int32(1))
                last = Int32(0)
                if old == c_last - c_first:
                    last = Int32(1)
                    st_relaxed_gpu_s32(cnt, Int32(0))  # ready for the next launch
                flag[0] = last
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumers)
            if flag[0] == 1:
                fence_gpu()
                acc.fill(0.0)
                for src in cutlass.range(c_first, c_last + 1, unroll=1):
                    theirs = p_base + Int64(src * 2 + self._slot(src, tile, sched)) * (
                        slot_elems * 4
                    )
                    for c in cutlass.range_constexpr(elems // 4):
                        addr = theirs + Int64((c * self.consumers + tidx) * 4) * 4
                        v = ld_global_cg_v4_f32(addr)
                        for e in cutlass.range_constexpr(4):
                            acc[c * 4 + e] = acc[c * 4 + e] + v[e]
                self._store(acc, tCcC, thr_epi, tile, sched, rows, mGS, mC)

    @cute.jit
    def _slot(self, c, tile, sched):
        """Partial slot of CTA c for row tile `tile`: 0 if it is the CTA's first row tile, else 1
        (then it is its last)."""
        slot = Int32(1)
        if self._unit_start(c, sched) // sched[0] == tile:
            slot = Int32(0)
        return slot


# ------------------------------------------------------------------------------ fake tensors


def fake_operands(warpgroups: int, tile_m: int):
    """Fake (a, blob, gs, out, partial, counters, stream): dynamic M, N, K, L, G and bytes."""
    s32 = cute.sym_int32
    m = s32(symbol="M")
    n = s32(divisibility=64 * warpgroups, symbol="N")
    k = s32(divisibility=KPAIR, symbol="K")
    g = s32(symbol="L")
    a = make_fake_compact_tensor(
        cutlass.BFloat16, (m, k, g), stride_order=(1, 0, 2), assumed_align=16
    )
    blob = make_fake_compact_tensor(cutlass.Uint8, (s32(symbol="BYTES"),), assumed_align=16)
    gs = make_fake_compact_tensor(cutlass.Float32, (g,), assumed_align=4)
    out = make_fake_compact_tensor(
        cutlass.BFloat16, (n, m, g), stride_order=(0, 1, 2), assumed_align=16
    )
    partial = make_fake_compact_tensor(
        cutlass.Float32,
        (64 * warpgroups * tile_m, 2, s32(symbol="G")),
        stride_order=(0, 1, 2),
        assumed_align=16,
    )
    counters = make_fake_compact_tensor(cutlass.Int32, (s32(symbol="TILES"),), assumed_align=4)
    return a, blob, gs, out, partial, counters, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(
    warpgroups: int, tile_m: int, stages: int | None = None, *, no_jit_engine: bool = False
) -> object:
    """cute.compile one variant from fake tensors (TVM-FFI, env stream); `no_jit_engine` compiles
    without loading (no GPU needed)."""
    kernel = Sm90StreamW4A16DecodeKernel(warpgroups=warpgroups, tile_m=tile_m, stages=stages)
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(
        kernel, *fake_operands(warpgroups, tile_m), options="--enable-tvm-ffi", **kw
    )


def check_targets() -> list[KernelTarget]:
    """One target per (warpgroups, tile_m) the streaming tactics use. Each must show register-A
    WGMMA (HGMMA reading an R operand), the sm90 decode (shf / prmt / bf16x2 multiplies), the bulk
    weight copy with its L2 policy, the activation TMA, 128-bit shared loads of the fragment
    records and the partial protocol (gpu-scope fence, acq_rel atomic, L2-only loads)."""
    variants = [(w, tm) for w in WARPGROUPS for tm in TILE_MS]
    return [
        KernelTarget(
            name=f"sm90.w4a16_stream.w{w}m{tm}",
            arch="sm_90a",
            compile=(lambda w=w, tm=tm: compile_kernel(w, tm, no_jit_engine=True)),
            ptx_patterns=(
                r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16",
                r"shf\.l\.wrap\.b32",
                r"prmt\.b32",
                r"mul\.rn\.bf16x2",
                r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes\.L2::cache_hint",
                r"createpolicy\.fractional\.L2::evict_first",
                r"cp\.async\.bulk\.tensor",
                r"ld\.shared\.v4\.b32",
                r"fence\.acq_rel\.gpu",
                r"atom\.acq_rel\.gpu\.global\.add\.s32",
                r"ld\.global\.cg\.v4\.f32",
            ),
            sass_patterns=(
                r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+, gdesc",
                r"PRMT",
                r"UBLKCP",
                r"LDS\.128",
            ),
        )
        for w, tm in variants
    ]
