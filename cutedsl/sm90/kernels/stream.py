"""Hopper (sm_90a) NVFP4 W4A16 decode GEMM for a few tokens: each warp streams its weights through
its own copy ring, dequantizes them in registers and multiplies on the tensor cores (`mma.sync`).

Same operands and math as `cutedsl.sm90.kernels.gemm`:
  out[l][m, n] = gs[l] * sum_k a[l][m, k] * (e2m1(w[l][n, k]) * sf[l][n, k // 16])
  a   (M, K, L)    bf16, K-major (token and group strides: any multiples of 8)   activations
  w   (N, K/2, L)  uint8, K-major, the sm90 weight encoding (cutedsl.sm90.weight)
  sf  (N, K/64, L) int32, N-major, 4 e5m3 block-scale codes per word
  gs  (L,)         fp32 global scale (weight_scale_2)
  out (N, M, L)    bf16, N-major (token and group strides: any multiples of 8)
  offs             ignored unless MoE (the operand list of the tiled kernel: both launch alike)
with M <= tokens (the compile-time token width: 8, 16 or 32) for dense and grouped launches.
MoE mode (`moe=True`): a is (T, K, 1) with the rows of expert e at [offs[e], offs[e+1]) (offs
int32 (E+1,) on the device), out is (N, T, 1), T free: each expert's rows are cut into tiles of
`tokens` rows, numbered in expert order; grid.y = min(E, T) + T // tokens bounds their count and
CTA y finds its (expert, tile) with the tiled kernel's scan (`gemm.moe_tile`) or, past the last
tile, exits. Rows outside [offs[0], offs[E]) are not written.

Design (for decode, where a GEMM reads each weight byte once and the tensor cores idle): no TMA,
no mbarrier, no CTA-wide ring. The sm90 encoding already stores, per weight row and 64-wide K
tile, the 8 bytes each lane of an `mma.sync.m16n8k16` A fragment needs (lane c = lane % 4 of the
quad owning the row: words q = 0, 1 for the K blocks 2q, 2q + 1), so every lane copies exactly the
bytes it will use: per K tile, 8 weight bytes and one scale word for each of its rows (rows g and
g + 8 of each 16-row block, g = lane / 4). The activations of each n8 token tile (token 8 t + g;
past the last token a zero-filling copy that reads nothing; columns past M are dropped) are
copied as whole 16-byte k chunks (lane (g, c): chunks c and c + 4 of token g) and read back as
B fragments with two `ldmatrix.x4` per K tile. The copies are `cp.async` (LDGSTS: no register
holds them in flight) into the warp's own `depth`-stage ring in shared memory, one commit group
per K tile; a lane waits for its own groups, then a warp sync makes the other lanes' activation
chunks visible: no CTA barrier in the mainloop. The weights are decoded with the tiled kernel's
register decode (`cutedsl.sm90.kernels.decode`).

Work split: CTA (x, 0, l) owns weight rows [x * rows, (x + 1) * rows) of group l; its `warps` warps
split K: warp w takes K tiles w, w + warps, w + 2 warps, ..., keeping depth - 1 of them in flight
(depth x (48 rows + 144 tokens) bytes of ring per warp) while it multiplies the oldest.

Epilogue: each warp parks its fp32 fragments in its ring (per 16-row block and n8 token tile:
8 token rows of 16 floats, pitch 20 floats, so the lanes of one store hit distinct banks); after
one CTA barrier, thread u sums output (row u % 16, token (u // 16) % 8 of its block) over the warps
in warp order (deterministic, the same bits on every run), scales by gs * 2^19 (DECODE_BIAS),
rounds to bf16 and stores it; 16 consecutive threads write 32 contiguous bytes.

Persistent mode (`ctas` > 0): grid.x is min(N / rows, ctas) (MoE: per expert tile) and CTA x owns
the row blocks x, x + P, x + 2 P, ... (P = grid.x) of its group (MoE: of its expert, for its tile's
tokens). Each warp's copy ring runs on across
its blocks: the K tiles of the next block are in flight while the CTA sums and stores the last one,
so a CTA pays the ring's fill once, not once per block. Its fragments are parked in a separate
region (two of them, alternating by block: one CTA barrier per block), not in the ring.
Resident activations (`res` > 0, persistent only): a warp's K tiles are the same in every block,
so it copies their activation chunks once, into `res` slots of its own (one copy group ahead of
the ring), and its ring stages carry only weights and scales; a launch needs
ceil(K / 64 / warps) <= res.

Compile-time: rows (16 | 32: 16-row blocks per warp), tokens (8 | 16 | 32: n8 tiles), warps
(1..16), depth (2..16: stages per warp ring), ctas (0: one CTA per row block; else the persistent
grid's CTA bound, 1..MAX_CTAS), res (0, or resident activation slots per warp, 1..MAX_RES) and
moe. Runtime: M, N, K, L, strides, pointers, stream.
Graph safety: no host sync; the grid is (N / rows, 1, L), MoE (N / rows, min(E, T) + T // tokens,
1); persistent: N / rows -> min(N / rows, ctas).
Constraints: N % rows == 0, K % 64 == 0; dense / grouped 1 <= M <= tokens.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cutedsl.kernels import device_utils as du
from cutedsl.kernels.checks import KernelTarget
from cutedsl.sm90.kernels import decode as dec
from cutedsl.sm90.kernels.gemm import fake_operands, moe_grid_y, moe_tile
from cutedsl.sm90.weight import DECODE_BIAS

BK = 64  # logical K per tile of the weight encoding
PITCH = 20  # floats per parked token row (16 outputs + 4: conflict-free stores)
A_ROW = 144  # bytes per staged activation row: 64 k (128 B) + 16, so ldmatrix's 8 rows hit 8
# distinct 16-byte bank groups
A_TILE = 8 * A_ROW  # one n8 token tile of one K tile
BLOCK = 8 * PITCH  # floats per parked 16-row x n8 block
# sm_90 dynamic shared memory per CTA, less 2 KiB: the DSL's static 1 KiB and the margin the tiled
# kernel keeps
SMEM_CAPACITY = 232448 - 2048
ROWS = (16, 32)
TOKENS = (8, 16, 32)
MAX_WARPS = 16
MAX_DEPTH = 16
MAX_CTAS = 4096
MAX_RES = 64


# ------------------------------------------------------------------------------ PTX helpers


@dsl_user_op
def cp_async(dst: Int32, src: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """Copy `nbytes` (4, 8 or 16; 16 bypasses L1) from global `src` to shared `dst` without a
    register (LDGSTS)."""
    ops = [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)]
    cop = "cg" if nbytes == 16 else "ca"
    text = f"cp.async.{cop}.shared.global [$0], [$1], {nbytes};"
    du.asm(None, ops, text, "r,l", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16_zfill(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """16-byte `cp.async` (bypassing L1) that reads `src_bytes` (16 or 0) of `src` and
    zero-fills the rest: with 0 nothing is read (`src` must still be a valid address)."""
    ops = [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip)]
    ops.append(Int32(src_bytes).ir_value(loc=loc, ip=ip))
    text = "cp.async.cg.shared.global [$0], [$1], 16, $2;"
    du.asm(None, ops, text, "r,l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel (PTX `trap`): a launch it must not serve."""
    du.asm(None, [], "trap;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ldmatrix_x4(addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """Four 8x8 b16 matrices from shared memory (lane 8 i + r gives row r of matrix i); lane l
    receives row l / 4, columns 2 (l % 4) and + 1 of each: an mma.sync B fragment word per
    matrix when the rows are tokens and the columns 8 consecutive k."""
    text = "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];"
    return du.asm_i32xn(4, [addr], text, "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    """fp32 from a shared-memory byte address; volatile, so it stays after the CTA barrier."""
    ops = [Int32(addr).ir_value(loc=loc, ip=ip)]
    text = "ld.shared.f32 $0, [$1];"
    return Float32(du.asm(T.f32(), ops, text, "=f,r", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def mma_16816_bf16(acc: tuple, a: tuple, b: tuple, *, loc=None, ip=None) -> tuple:
    """acc (4 fp32) += A (16 x 16 bf16: 4 words, the PTX row-major fragment) x B (16 x 8 bf16:
    2 words, the column-major fragment); one `mma.sync.aligned.m16n8k16` (HMMA.16816.F32.BF16)."""
    ops = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
    ops += [Float32(x).ir_value(loc=loc, ip=ip) for x in acc]
    ty = ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>")
    text = (
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )
    res = du.asm(ty, ops, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


# ------------------------------------------------------------------------------ kernel


def shared_storage(ring: int, park: int, acts: int, sched: int) -> type:
    """The CTA's shared-memory struct: `ring` bytes, then `park` and `acts` bytes where nonzero
    (16-byte aligned), then `sched` int32 words."""
    fields = {"ring": cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, ring], 16]}
    for name, nbytes in (("park", park), ("acts", acts)):
        if nbytes:
            fields[name] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, nbytes], 16]
    fields["sched"] = cute.struct.MemRange[cutlass.Int32, sched]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def stage_of(loads: tuple) -> int:
    """The ring stage's bytes, from `_addresses`'s operands."""
    return loads[-1]


class Sm90Nvfp4StreamGemmKernel:
    """W4A16 NVFP4 decode GEMM for sm_90a (module docstring). `__init__` takes codegen
    configuration only."""

    def __init__(
        self,
        rows: int = 16,
        tokens: int = 8,
        warps: int = 8,
        depth: int = 4,
        moe: bool = False,
        ctas: int = 0,
        res: int = 0,
    ):
        err = self.config_error(rows, tokens, warps, depth, ctas, res)
        if err:
            raise ValueError(err)
        self.rows, self.tokens, self.warps, self.depth = rows, tokens, warps, depth
        self.moe, self.ctas, self.res = moe, ctas, res
        self.rb = rows // 16  # 16-row blocks per warp
        self.nt = tokens // 8  # n8 token tiles
        self.threads = 32 * warps
        self.warp_bytes = self.region_bytes(rows, tokens, depth, ctas, res)
        self.park_bytes = self.park_region_bytes(rows, tokens) if ctas else 0
        self.res_bytes = res * self.nt * A_TILE  # one warp's resident activations

    @staticmethod
    def stage_bytes(rows: int, tokens: int, res: int = 0) -> int:
        """One ring stage of one warp: per lane, the 8 weight bytes and the scale word of each of
        its rows / 8 rows (item-major: lane-contiguous items, so each item's shared load is
        conflict-free), then per n8 token tile its 8 activation rows of 64 k (A_ROW apart; not
        with resident activations, `res` > 0)."""
        return (rows // 8) * 32 * (8 + 4) + (0 if res else (tokens // 8) * A_TILE)

    @staticmethod
    def park_region_bytes(rows: int, tokens: int) -> int:
        """One warp's parked fragments: per 16-row block and n8 token tile, BLOCK floats."""
        return (rows // 16) * (tokens // 8) * BLOCK * 4

    @staticmethod
    def region_bytes(rows: int, tokens: int, depth: int, ctas: int = 0, res: int = 0) -> int:
        """One warp's ring; one CTA's parked fragments reuse the rings afterwards, except in
        persistent mode (`ctas` > 0), where the rings never stop."""
        ring = depth * Sm90Nvfp4StreamGemmKernel.stage_bytes(rows, tokens, res)
        return (
            ring if ctas else max(ring, Sm90Nvfp4StreamGemmKernel.park_region_bytes(rows, tokens))
        )

    @staticmethod
    def smem_bytes(
        rows: int, tokens: int, warps: int, depth: int, ctas: int = 0, res: int = 0
    ) -> int:
        """A CTA's dynamic shared memory: the warps' rings (persistent: and two park regions
        per warp; resident activations: and `res` slots of activations per warp)."""
        K = Sm90Nvfp4StreamGemmKernel
        park = 2 * K.park_region_bytes(rows, tokens) if ctas else 0
        return warps * (
            K.region_bytes(rows, tokens, depth, ctas, res) + park + res * (tokens // 8) * A_TILE
        )

    @staticmethod
    def config_error(
        rows: int, tokens: int, warps: int, depth: int, ctas: int = 0, res: int = 0
    ) -> str | None:
        """Why the kernel refuses this configuration (None if it takes it)."""
        if rows not in ROWS:
            return f"rows must be one of {ROWS}, got {rows}"
        if tokens not in TOKENS:
            return f"tokens must be one of {TOKENS}, got {tokens}"
        if not 1 <= warps <= MAX_WARPS:
            return f"warps must be 1..{MAX_WARPS}, got {warps}"
        if not 2 <= depth <= MAX_DEPTH:
            return f"depth must be 2..{MAX_DEPTH}, got {depth}"
        if not 0 <= ctas <= MAX_CTAS:
            return f"ctas must be 0 (one CTA per row block) or 1..{MAX_CTAS}, got {ctas}"
        if not 0 <= res <= MAX_RES:
            return f"res must be 0 or 1..{MAX_RES} resident activation slots per warp, got {res}"
        if res and not ctas:
            return "res > 0 (resident activations) needs the persistent grid (ctas > 0)"
        need = Sm90Nvfp4StreamGemmKernel.smem_bytes(rows, tokens, warps, depth, ctas, res)
        if need > SMEM_CAPACITY:
            slots = f" and {res} resident slots" if res else ""
            return f"{warps} warps x {depth} stages{slots} need {need} B of shared memory"
        return None

    @staticmethod
    def can_implement(n: int, k: int, rows: int) -> bool:
        """GPU-free shape check (M is checked at launch)."""
        return n > 0 and k > 0 and n % rows == 0 and k % BK == 0

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K, L) bf16 K-major
        w: cute.Tensor,  # (N, K/2, L) uint8 K-major (sm90 encoding)
        sf: cute.Tensor,  # (N, K/64, L) int32 N-major (e5m3 x 4)
        gs: cute.Tensor,  # (L,) fp32
        out: cute.Tensor,  # (N, M, L) bf16, N-major
        offs: cute.Tensor,  # (E+1,) int32 expert row starts (MoE); ignored otherwise
        stream: cuda.CUstream,
    ):
        self.out_dtype = out.element_type

        self.shared_storage = shared_storage(
            self.warps * self.warp_bytes,  # the rings
            2 * self.warps * self.park_bytes,  # persistent: two park regions per warp
            self.warps * self.res_bytes,  # resident activations: res slots per warp
            self.warps + 2,  # `moe_tile`
        )
        grid = (cute.size(w, mode=[0]) // self.rows, 1, cute.size(w, mode=[2]))
        if cutlass.const_expr(self.ctas > 0):
            grid = (cutlass.min(grid[0], self.ctas), 1, grid[2])
        if cutlass.const_expr(self.moe):
            rows_t = cute.size(a, mode=[0])
            groups = cute.size(w, mode=[2])
            grid = (grid[0], moe_grid_y(rows_t, groups, self.tokens, cutlass.min), 1)
        self.kernel(a, w, sf, gs, out, offs).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mGS: cute.Tensor,
               mC: cute.Tensor, mOffs: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, grp = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # this CTA's tokens: [tok0, tok0 + t_cnt) of activation group act_l
        tok0 = cutlass.Int32(0)
        t_cnt = cute.size(mA, mode=[0])
        act_l = grp
        has_tile = cutlass.Boolean(True)  # dense / grouped: every CTA has its tile
        if cutlass.const_expr(self.moe):
            sched = storage.sched.get_tensor(cute.make_layout(self.warps + 2))
            grp, m_tile = moe_tile(mOffs, bidy, tidx, sched, self.threads, self.tokens)
            has_tile = grp >= 0
            act_l = 0
            if has_tile:
                tok0 = mOffs[grp] + m_tile * self.tokens
                t_cnt = cutlass.min(mOffs[grp + 1] - tok0, self.tokens)
        if has_tile:  # the same for every thread of the CTA (its barriers below)
            if cutlass.const_expr(self.ctas > 0):
                self._persistent(mA, mW, mS, mGS, mC, storage, tidx, bidx, grp, act_l, tok0, t_cnt)
            else:
                self._cta(mA, mW, mS, mGS, mC, storage, tidx, bidx, grp, act_l, tok0, t_cnt)

    def _addresses(self, mA, mW, mS, ring, lane, grp, act_l, n0, tok0, t_cnt, acts=None):
        """This lane's copy sources at K tile 0 and its places in a ring stage, for weight rows
        [n0, n0 + rows) of group grp and tokens [tok0, tok0 + t_cnt) of activation group act_l:
        (the `_issue` operands, the ldmatrix row address). `acts`: the warp's resident
        activation slots (their slot 0) instead of the ring stage's activation rows."""
        g, c = lane // 4, lane % 4  # the lane's row (and token) in its quad's 8; its K pair
        # Global byte addresses at K tile 0: a tile adds 32 weight bytes, one scale row (s_step)
        # and 128 activation bytes. Token 8 t + g is clamped to the last token.
        w_base = mW.iterator.toint()
        s_base = mS.iterator.toint()
        a_base = mA.iterator.toint()
        s_step = Int64(cute.crd2idx((0, 1, 0), mS.layout)) * 4
        w_src, s_src, a_src = [], [], []
        for r in range(self.rb):
            for h in range(2):  # rows g and g + 8 of block r
                n = n0 + 16 * r + 8 * h + g
                w_src.append(w_base + Int64(cute.crd2idx((n, c * 8, grp), mW.layout)))
                s_src.append(s_base + Int64(cute.crd2idx((n, 0, grp), mS.layout)) * 4)
        a_len = []  # bytes read per activation chunk: 16, or 0 (zero-filled) past the last token
        for t in range(self.nt):  # k chunks c and c + 4 (16 B) of token g
            tok = tok0 + cutlass.min(8 * t + g, t_cnt - 1)
            a_src.append(a_base + Int64(cute.crd2idx((tok, c * 8, act_l), mA.layout)) * 2)
            a_len.append(16 * cutlass.min(cutlass.max(t_cnt - 8 * t - g, 0), 1))
        # this lane's places in a stage: its weight bytes and scale words; the activation chunks
        # it copies (row g, chunks c and c + 4) and the row it addresses for ldmatrix
        nw = 2 * self.rb
        w_dst = ring + lane * 8
        s_dst = ring + nw * 256 + lane * 4
        a0 = ring + nw * 384 if acts is None else acts
        a_dst = a0 + g * A_ROW + c * 16
        a_ld = a0 + (lane % 8) * A_ROW + (lane // 8) * 16
        stage = self.stage_bytes(self.rows, self.tokens, self.res)
        return (w_src, s_src, a_src, a_len, s_step, w_dst, s_dst, a_dst, stage), a_ld

    def _park(self, acc, base, lane):
        """Store this warp's fp32 fragments at `base`: per 16-row block r and n8 token tile t,
        8 token rows of PITCH floats."""
        g, c = lane // 4, lane % 4
        for r in range(self.rb):
            for t in range(self.nt):
                blk = base + (r * self.nt + t) * (BLOCK * 4)
                for e in range(4):  # token 2 c + e % 2, row g + 8 (e // 2)
                    addr = blk + ((2 * c + e % 2) * PITCH + g + 8 * (e // 2)) * 4
                    du.st_shared_f32xn(addr, (acc[(r * self.nt + t) * 4 + e],))

    @cute.jit
    def _sum_store(self, mGS, mC, base, stride, tidx, grp, act_l, n0, tok0, t_cnt):
        """After a CTA barrier: thread u sums output (row u % 16, token (u // 16) % 8 of its
        block) over the warps' parked fragments (warp w's at base + w * stride, in warp order),
        scales, rounds and stores it to rows [n0, n0 + rows), tokens below t_cnt."""
        scale = mGS[grp] * DECODE_BIAS  # the decode's products are e2m1·sf·2^-19
        outputs = self.rb * self.nt * 128
        for it in cutlass.range_constexpr((outputs + self.threads - 1) // self.threads):
            u = tidx + it * self.threads
            if u < outputs:
                blk = u // 128  # = r * nt + t
                tok = 8 * (blk % self.nt) + (u % 128) // 16
                row = n0 + 16 * (blk // self.nt) + u % 16
                if tok < t_cnt:
                    off = base + (blk * BLOCK + ((u % 128) // 16) * PITCH + u % 16) * 4
                    s = ld_shared_f32(off)
                    for wi in cutlass.range_constexpr(1, self.warps):
                        s = s + ld_shared_f32(off + wi * stride)
                    mC[row, tok0 + tok, act_l] = (s * scale).to(self.out_dtype)

    @cute.jit
    def _cta(self, mA, mW, mS, mGS, mC, storage, tidx, bidx, grp, act_l, tok0, t_cnt):
        """One CTA's work: weight rows [bidx * rows, + rows) of group grp times tokens
        [tok0, tok0 + t_cnt) (t_cnt <= tokens) of activation group act_l."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        ring0 = storage.ring.data_ptr().toint()
        ring = ring0 + warp * self.warp_bytes  # this warp's region

        k_tiles = cute.size(mS, mode=[1])
        n0 = bidx * self.rows
        mine = (k_tiles - warp + self.warps - 1) // self.warps  # tiles w, w + warps, ...
        loads, a_ld = self._addresses(mA, mW, mS, ring, lane, grp, act_l, n0, tok0, t_cnt)

        acc = cute.make_rmem_tensor((self.rb * self.nt * 4,), cutlass.Float32)
        acc.fill(0.0)
        # ring of `depth` stages: tile i in stage i % depth; one copy group per tile, so waiting
        # for all but depth - 1 groups lands tile i
        for i in cutlass.range_constexpr(self.depth - 1):
            if i < mine:
                self._issue(warp + self.warps * i, i, loads)
            cute.arch.cp_async_commit_group()
        for i in cutlass.range(mine, unroll=1):
            # Every lane's ldmatrix of the stage this copy refills (tile i - 1's) is done and
            # ordered before it (bar.warp.sync orders the warp's shared-memory accesses).
            cute.arch.sync_warp()
            # Past the last tile the freed stage (tile i - 1's) gets the last tile again, never
            # read: an unconditional copy keeps its address math out of a branch, which LLVM
            # would otherwise sink it into and recompute every iteration.
            nxt = i + self.depth - 1
            self._issue(warp + self.warps * cutlass.min(nxt, mine - 1), nxt % self.depth, loads)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(self.depth - 1)
            cute.arch.sync_warp()  # the activation rows other lanes copied are visible
            self._tile(acc, (i % self.depth) * stage_of(loads), ring, a_ld, lane)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()  # every lane's copies landed before any lane parks over them

        # ---------------------------------------------------------------- epilogue
        self._park(acc, ring, lane)
        cute.arch.barrier()
        self._sum_store(mGS, mC, ring0, self.warp_bytes, tidx, grp, act_l, n0, tok0, t_cnt)

    @cute.jit
    def _persistent(self, mA, mW, mS, mGS, mC, storage, tidx, bidx, grp, act_l, tok0, t_cnt):
        """Persistent mode (module docstring): row blocks bidx, bidx + P, ... (P = grid.x) of
        group grp times tokens [tok0, tok0 + t_cnt) of activation group act_l, one copy stream
        per warp across all of them."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        ring0 = storage.ring.data_ptr().toint()
        ring = ring0 + warp * self.warp_bytes
        park0 = storage.park.data_ptr().toint()
        pair = self.warps * self.park_bytes  # one of the two park regions

        k_tiles = cute.size(mS, mode=[1])
        mine = (k_tiles - warp + self.warps - 1) // self.warps  # K tiles w, w + warps, ...
        p = cute.arch.grid_dim()[0]
        blocks = (cute.size(mW, mode=[0]) // self.rows - bidx + p - 1) // p  # bidx, bidx + p, ...
        total = blocks * mine  # this warp's tiles, block-major
        n0 = bidx * self.rows
        acts = None
        if cutlass.const_expr(self.res > 0):
            acts = storage.acts.data_ptr().toint() + warp * self.res_bytes
            if mine > self.res:  # never written past the slots (the host refuses such launches)
                trap()
        loads, a_ld = self._addresses(mA, mW, mS, ring, lane, grp, act_l, n0, tok0, t_cnt, acts)
        # byte offsets of the next block (p row blocks further) in the weights and the scales
        w_blk = Int64(cute.crd2idx((self.rows, 0, 0), mW.layout)) * Int64(p)
        s_blk = Int64(cute.crd2idx((self.rows, 0, 0), mS.layout)) * 4 * Int64(p)

        acc = cute.make_rmem_tensor((self.rb * self.nt * 4,), cutlass.Float32)
        acc.fill(0.0)
        # the copy pointer: flat tile fi = jb * mine + it of this warp; it stays at the last
        # tile once there (copies past the end refill a freed stage with it, never read)
        fi, jb, it = Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(self.res > 0):  # this warp's activations, once: the oldest group
            for j in cutlass.range(mine, unroll=1):
                self._issue_acts(warp + self.warps * j, j * (self.nt * A_TILE), loads)
            cute.arch.cp_async_commit_group()
        for i in cutlass.range_constexpr(self.depth - 1):
            if i < total:
                self._issue(
                    warp + self.warps * it, i, loads, (Int64(jb) * w_blk, Int64(jb) * s_blk)
                )
            cute.arch.cp_async_commit_group()
            fi, jb, it = self._advance(fi, jb, it, total, mine)
        f = Int32(0)  # the tile multiplied next, flat
        for b in cutlass.range(blocks, unroll=1):
            for ic in cutlass.range(mine, unroll=1):
                cute.arch.sync_warp()  # the stage refilled below (tile f - 1's) is read out
                slot = (f + self.depth - 1) % self.depth
                self._issue(
                    warp + self.warps * it, slot, loads, (Int64(jb) * w_blk, Int64(jb) * s_blk)
                )
                cute.arch.cp_async_commit_group()
                fi, jb, it = self._advance(fi, jb, it, total, mine)
                cute.arch.cp_async_wait_group(self.depth - 1)
                cute.arch.sync_warp()
                a_off = None
                if cutlass.const_expr(self.res > 0):
                    a_off = ic * (self.nt * A_TILE)  # resident slot ic: K tile w + warps * ic
                self._tile(acc, (f % self.depth) * stage_of(loads), ring, a_ld, lane, a_off)
                f = f + 1
            # block b done: park (regions alternate by block, so one barrier per block orders
            # this park after every thread's sums of block b - 2 from the same region)
            self._park(acc, park0 + (b % 2) * pair + warp * self.park_bytes, lane)
            acc.fill(0.0)
            cute.arch.barrier()
            n_b = (bidx + b * p) * self.rows
            self._sum_store(
                mGS, mC, park0 + (b % 2) * pair, self.park_bytes, tidx, grp, act_l, n_b, tok0, t_cnt
            )
        cute.arch.cp_async_wait_group(0)  # no copy outlives the CTA

    @cute.jit
    def _advance(self, fi, jb, it, total, mine):
        """The copy pointer's next flat tile fi = jb * mine + it, held at the last (total - 1)."""
        if fi < total - 1:
            fi = fi + 1
            it = it + 1
            if it == mine:
                it = Int32(0)
                jb = jb + 1
        return fi, jb, it

    @cute.jit
    def _issue(self, kt, slot, loads, block=None):
        """Copy this lane's bytes of K tile kt into ring stage `slot`; `block`: byte offsets
        (weights, scales) of another row block than `_addresses`'s."""
        w_src, s_src, a_src, a_len, s_step, w_dst, s_dst, a_dst, stage = loads
        kt64 = Int64(kt)
        off = slot * stage
        w_off, s_off = kt64 * 32, kt64 * s_step
        if cutlass.const_expr(block is not None):
            w_off, s_off = w_off + block[0], s_off + block[1]
        for i in cutlass.range_constexpr(2 * self.rb):
            cp_async(w_dst + off + i * 256, w_src[i] + w_off, 8)
            cp_async(s_dst + off + i * 128, s_src[i] + s_off, 4)
        if cutlass.const_expr(self.res == 0):  # (resident: `_issue_acts`, once)
            self._issue_acts(kt, off, loads)

    @cute.jit
    def _issue_acts(self, kt, off, loads):
        """Copy this lane's activation chunks of K tile kt to byte `off` past its activation
        places (a ring stage's, or a resident slot's)."""
        w_src, s_src, a_src, a_len, s_step, w_dst, s_dst, a_dst, stage = loads
        kt64 = Int64(kt)
        for t in cutlass.range_constexpr(self.nt):
            for h in cutlass.range_constexpr(2):  # k 8 c .. 8 c + 7, then 32 more
                src = a_src[t] + kt64 * 128 + 64 * h
                cp_async_16_zfill(a_dst + off + t * A_TILE + h * 64, src, a_len[t])

    @cute.jit
    def _tile(self, acc, off, ring, a_ld, lane, a_off=None):
        """The MMAs of the K tile in the ring stage at byte `off` of the warp's ring (its
        activations at `a_off` past the activation places when given: a resident slot): 4 k16 steps
        x rows/16 blocks x tokens/8 tiles. Word q of a row holds the pairs of K blocks 2q (pairs
        0, 1: k 2c, 2c + 8) and 2q + 1 (pairs 2, 3); rows g (h = 0) and g + 8 (h = 1) of block r.
        Activation word j of token tile t (k 8 j + 2 c, token g) comes from ldmatrix j // 4."""
        nw = 2 * self.rb
        base = ring + off
        bw = [du.ld_shared_v2_b32(base + i * 256 + lane * 8) for i in range(nw)]
        bs = [du.ld_shared_b32(base + nw * 256 + i * 128 + lane * 4) for i in range(nw)]
        a_at = a_ld + (off if a_off is None else a_off)
        ba = []
        for t in cutlass.range_constexpr(self.nt):
            for h in cutlass.range_constexpr(2):
                ba.extend(ldmatrix_x4(a_at + t * A_TILE + h * 64))
        for r in cutlass.range_constexpr(self.rb):
            pairs = []  # [h][q] -> 4 decoded bf16x2 words
            for h in cutlass.range_constexpr(2):
                s01, s23 = dec.e5m3x4_to_bf16x2x2(bs[2 * r + h])
                w0, w1 = bw[2 * r + h]
                pairs.append((dec.nvfp4x8_to_bf16x2x4(w0, s01), dec.nvfp4x8_to_bf16x2x4(w1, s23)))
            for j in cutlass.range_constexpr(4):  # k16 step: K block j of the tile
                q, p = j // 2, 2 * (j % 2)
                afrag = (pairs[0][q][p], pairs[1][q][p], pairs[0][q][p + 1], pairs[1][q][p + 1])
                for t in cutlass.range_constexpr(self.nt):
                    bfrag = (ba[t * 8 + 2 * j], ba[t * 8 + 2 * j + 1])
                    x = (r * self.nt + t) * 4
                    res = mma_16816_bf16((acc[x], acc[x + 1], acc[x + 2], acc[x + 3]), afrag, bfrag)
                    for e in cutlass.range_constexpr(4):
                        acc[x + e] = res[e]


# ------------------------------------------------------------------------------ compile


def compile_kernel(
    rows: int,
    tokens: int,
    warps: int,
    depth: int,
    moe: bool = False,
    *,
    ctas: int = 0,
    res: int = 0,
    no_jit_engine: bool = False,
) -> object:
    """cute.compile one configuration from fake tensors (the tiled kernel's operands: TVM-FFI,
    env stream); `no_jit_engine` compiles without loading (no GPU needed)."""
    kernel = Sm90Nvfp4StreamGemmKernel(rows, tokens, warps, depth, moe, ctas, res)
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(kernel, *fake_operands(moe), options="--enable-tvm-ffi", **kw)


def check_targets() -> list[KernelTarget]:
    """Every row block and token width, at several warp counts and depths, and two MoE
    configurations: each must copy its
    weights with 8-byte `cp.async` (LDGSTS) into its ring, wait on copy groups, multiply with
    `mma.sync` m16n8k16 (HMMA.16816 in SASS) through the register decode, park and sum its
    fragments in shared memory, and use no TMA and no wgmma."""
    ptx = (
        r"cp\.async\.ca\.shared\.global \[%r\d+\], \[%rd\d+\], 8;",
        r"cp\.async\.wait_group \d+;",
        r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;",
        r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
        r"bar\.warp\.sync",
        r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
        r"shf\.l\.wrap\.b32",
        r"mul\.rn\.bf16x2",
        r"prmt\.b32",
        r"st\.shared\.f32",
        r"ld\.shared\.f32",
        r"bar\.sync",
    )
    sass = (
        r"HMMA\.16816\.F32\.BF16",
        r"LDGSTS\.E\.(LTC128B\.)?64",
        r"LDGSTS\.E\.BYPASS\.(LTC128B\.)?128",
        r"LDSM\.16\.M88\.4",
        r"LDGDEPBAR",
        r"DEPBAR",
    )
    variants = [(16, 8, 8, 8), (16, 16, 8, 4), (32, 8, 4, 4), (16, 32, 4, 2), (32, 16, 16, 2)]
    moe = [(16, 8, 8, 4), (32, 16, 4, 2)]  # + the expert-tile scan (warp shfl.up)
    persistent = [(16, 8, 8, 2, 264, 0), (32, 8, 16, 4, 132, 0), (32, 32, 4, 2, 132, 0)]
    persistent += [(32, 32, 8, 2, 132, 2), (16, 16, 16, 2, 132, 4)]  # resident activations
    moe_persistent = [(16, 8, 8, 2, 16, 0), (16, 8, 8, 2, 16, 8)]
    cfgs = [(*c, m, 0, 0) for m, cs in ((False, variants), (True, moe)) for c in cs]
    cfgs += [(r, t, w, d, False, p, q) for r, t, w, d, p, q in persistent]
    cfgs += [(r, t, w, d, True, p, q) for r, t, w, d, p, q in moe_persistent]
    return [
        KernelTarget(
            name=f"sm90.stream_gemm.{'moe.' if m else ''}r{r}t{t}w{w}d{d}"
            f"{f'p{p}' if p else ''}{f'r{q}' if q else ''}",
            arch="sm_90a",
            compile=lambda r=r, t=t, w=w, d=d, m=m, p=p, q=q: compile_kernel(
                r, t, w, d, m, ctas=p, res=q, no_jit_engine=True
            ),
            ptx_patterns=(*ptx, r"shfl\.sync\.up\.b32") if m else ptx,
            sass_patterns=sass,
            absent_patterns=(r"wgmma", r"cp\.async\.bulk"),
        )
        for r, t, w, d, m, p, q in cfgs
    ]
