"""Host side of the Hopper (sm_90a) NVFP4 W4A16 GEMM family (kernels/gemm_sm90.py).

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), G groups (wo_a),
E experts, T routed rows (MoE).

Public functions (torch tensors in, torch tensors out; BF16 activations and outputs):
  prepare_nvfp4_weight(b_packed, b_sf, b_gs, groups=None) -> Sm90Nvfp4Weight   (once, at load)
  sm90_nvfp4_gemm(a[M, K], b_packed[N, K/2], b_sf[N, K/16], b_gs) -> [M, N]     (convenience)
  sm90_nvfp4_gemm_prepared(a[M, K], wp) -> [M, N]                               (hot path)
  sm90_nvfp4_grouped_gemm(a[G, M, K], wp(G groups)) -> [G, M, N]                (wo_a)
  sm90_nvfp4_moe_gemm(a[T, K], offs[E+1] int32 device, wp(E groups)) -> [T, N]  (experts)

Weight prep (`prepare_nvfp4_weight`, once at load) re-encodes the NVFP4 weight for the kernel's
register dequantization (kernels/device_utils.py decodes it; `decode_emulated` is its host model):
- weights, uint8 [L, N, K/2]: per row and 64-wide K tile, 32 bytes = 4 lanes c x 2 words q x 4 bytes.
  Word (c, q) holds the 8 e2m1 codes the wgmma A fragment of lane c needs for K blocks j = 2q, 2q+1:
  pair p = 2*(j - 2q) + h holds k = 16j + 8h + 2c + (0, 1) (element e = 0, 1). Code bit b of element
  (p, e) sits at bit (T[b] + 16e - R[p][b]) mod 32, where T = (6, 7, 8, 15) (m, e0, e1, sign: the
  bf16 bits it decodes to) and R[p][b] = ROT[p], except R[3][2] = ROT3_E1 (device_utils): the kernel
  decodes pair p with one rotation and one mask (pair 3: two of each). The codes of a block whose
  scale is 0 are stored as 0.
- block scales, int32 [L, K/64, N] (N contiguous: one TMA box of tile_n words per K tile): the 4
  scales of a row's K tile, one byte each, as "e5m3" codes (value 2^E (1 + m/8), code (E+10)<<3 | m,
  0 = zero), so that every e4m3 value (subnormals included) is a normal bf16 in the kernel.
  Negative scales are folded into the signs of their 16 weights; NaN scales are refused.
- global scale: fp32 [L], applied in the epilogue.

Compile cache: keyed on compile-time values only (tile_n, tile_m, split_k, moe, out dtype); M, N,
K, the group count, strides and addresses are runtime values (fake tensors with symbolic extents),
so one compile serves every token count and routing. CUDA graphs: call `warmup()` (or each launch
function once) before capture; the launch path allocates only outputs not given (split-K
reduces through distributed shared memory: no scratch), never syncs with the host and never
compiles once warm.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

_BK = 64
# Token tiles the GPU tests cover (tests/test_gemm_sm90.py); others are refused before compiling
# (H200 2026-12-02, the first kernel: tile_m 8 gave wrong results, 24 aborted in cute.compile).
TILE_M_VERIFIED = (16, 32, 64, 128, 192, 256)
MAX_SPLIT_K = 8  # split-K CTAs form one thread-block cluster (kernels/gemm_sm90.py)
_NUM_SMS_H200 = 132


@dataclass(frozen=True)
class Sm90Nvfp4Weight:
    """NVFP4 weight prepared for the sm_90a kernels.

    w:  uint8 [L, N, K//2], the sm90 weight encoding (module docstring), contiguous
    sf: int32 [L, K//64, N], 4 e5m3 block-scale codes per word (module docstring), contiguous
    gs: float32 [L] global scale (weight_scale_2) per group
    """

    w: torch.Tensor
    sf: torch.Tensor
    gs: torch.Tensor
    n: int
    k: int
    groups: int


def prepare_nvfp4_weight(
    b_packed: torch.Tensor,  # [N, K//2] | [L, N, K//2] | [L*N, K//2] with groups=L; uint8
    b_sf: torch.Tensor,  # same leading shape, [.., N, K//16] float8_e4m3fn linear (not swizzled)
    b_gs: torch.Tensor | float,  # fp32 0-dim or [L]
    groups: int | None = None,
) -> Sm90Nvfp4Weight:
    """Repack an NVFP4 weight once for the sm_90a kernels (see Sm90Nvfp4Weight)."""
    if b_packed.dtype != torch.uint8:
        raise ValueError(f"b_packed: dtype {b_packed.dtype}, expected torch.uint8")
    if b_sf.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"b_sf: dtype {b_sf.dtype}, expected torch.float8_e4m3fn")
    if b_packed.ndim == 2 and groups is not None:
        if b_packed.shape[0] % groups:
            raise ValueError(f"b_packed: {b_packed.shape[0]} rows not divisible by groups={groups}")
        b_packed = b_packed.reshape(groups, b_packed.shape[0] // groups, b_packed.shape[1])
        b_sf = b_sf.reshape(groups, b_sf.shape[0] // groups, b_sf.shape[1])
    if b_packed.ndim == 2:
        b_packed, b_sf = b_packed.unsqueeze(0), b_sf.unsqueeze(0)
    if b_packed.ndim != 3:
        raise ValueError(
            f"b_packed: shape {tuple(b_packed.shape)}, expected [N, K//2] or [L, N, K//2]"
        )
    L, N, KH = b_packed.shape
    K = 2 * KH
    if tuple(b_sf.shape) != (L, N, K // 16):
        raise ValueError(f"b_sf: shape {tuple(b_sf.shape)}, expected {(L, N, K // 16)} (linear)")
    if N % 64 or K % _BK:
        raise ValueError(f"weight: N={N} must be a multiple of 64 and K={K} of {_BK}")
    gs = torch.as_tensor(b_gs, dtype=torch.float32, device=b_packed.device).reshape(-1)
    if gs.numel() == 1:
        gs = gs.expand(L)
    if gs.numel() != L:
        raise ValueError(f"b_gs: {gs.numel()} values, expected 1 or {L}")
    w, sf = encode_weight(b_packed, b_sf.view(torch.uint8))
    return Sm90Nvfp4Weight(w=w, sf=sf, gs=gs.contiguous(), n=N, k=K, groups=L)


# ------------------------------------------------------------------------------ weight encoding

# e4m3 magnitude byte (0..0x7E) -> e5m3 code: normal e4m3 (exponent field e >= 1) is x + 24;
# subnormal m * 2^-9 (m = 1..7) renormalized; 0x7F (NaN) is refused before the lookup.
_E5M3 = [0, 8, 16, 20, 24, 26, 28, 30] + [x + 24 for x in range(8, 128)]
_ROWS_PER_CHUNK = 4096  # bounds the int64 temporaries of the encoding (rows x K x 8 B)


def encode_weight(packed: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed uint8 [L, N, K/2] + e4m3 codes uint8 [L, N, K/16] -> (w uint8 [L, N, K/2], sf int32
    [L, K/64, N]) in the sm90 encoding (module docstring). Runs on the tensors' device, in chunks
    of rows."""
    L, N, KH = packed.shape
    K, T = 2 * KH, 2 * KH // _BK
    if bool(((sf & 0x7F) == 0x7F).any()):
        bad = ((sf & 0x7F) == 0x7F).nonzero()[0].tolist()
        raise ValueError(f"b_sf: NaN block scale (e4m3 0x7F/0xFF) at [group, row, block] = {bad}")
    rows_p, rows_s = packed.reshape(L * N, KH), sf.reshape(L * N, K // 16)
    w_out = torch.empty_like(rows_p)
    s_rows = torch.empty((L * N, T), dtype=torch.int32, device=packed.device)
    e5m3 = torch.tensor(_E5M3, dtype=torch.int64, device=packed.device)
    dev = packed.device
    src = _code_bit_positions().to(dev)  # [pair p, element e, code bit b] -> bit in the word
    for r0 in range(0, L * N, _ROWS_PER_CHUNK):
        r1 = min(L * N, r0 + _ROWS_PER_CHUNK)
        b = rows_p[r0:r1].to(torch.int64)
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(r1 - r0, K)  # element k
        s = rows_s[r0:r1].to(torch.int64)
        neg = (s & 0x80) != 0  # fold a negative scale into its 16 weights' signs
        codes = codes ^ (neg.repeat_interleave(16, dim=1).to(torch.int64) << 3)
        code_s = e5m3[s & 0x7F]  # [R, K/16]
        codes = codes * (code_s != 0).repeat_interleave(16, dim=1)  # zero scale: zero codes
        # k = 64t + 16j + 8h + 2c + e with j = 2q + jj  ->  [R, t, c, q, (jj, h), e]
        c6 = codes.reshape(r1 - r0, T, 2, 2, 2, 4, 2).permute(0, 1, 5, 2, 3, 4, 6)
        c6 = c6.reshape(r1 - r0, T, 4, 2, 4, 2)  # [.., pair p = 2jj + h, element e]
        # disjoint bits: sum = or
        word = sum((((c6 >> b) & 1) << src[:, :, b]).sum((-2, -1)) for b in range(4))
        by = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # little endian
        w_out[r0:r1] = by.reshape(r1 - r0, KH).to(torch.uint8)
        sj = code_s.reshape(r1 - r0, T, 4) << (8 * torch.arange(4, device=dev))
        sw = sj.sum(-1)
        s_rows[r0:r1] = torch.where(sw >= 2**31, sw - 2**32, sw).to(torch.int32)
    w = w_out.reshape(L, N, KH)
    return w, s_rows.reshape(L, N, T).transpose(1, 2).contiguous()


def _code_bit_positions() -> torch.Tensor:
    """int64 [4 pairs, 2 elements, 4 code bits]: where code bit b of element (p, e) sits in its
    word (module docstring)."""
    from cutedsl.kernels import device_utils as du

    pos = torch.empty(4, 2, 4, dtype=torch.int64)
    for p in range(4):
        for e in range(2):
            for b, t in enumerate((6, 7, 8, 15)):
                r = du.ROT3_E1 if (p, b) == (3, 2) else du.ROT[p]
                pos[p, e, b] = (t + 16 * e - r) % 32
    assert pos.unique().numel() == 32, "the pair rotations must place the 32 bits disjointly"
    return pos


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    """32-bit rotate left of u32 values held in int64 (PTX shf.l.wrap with both inputs = x)."""
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int | torch.Tensor) -> torch.Tensor:
    """PTX prmt.b32 (default mode, selector nibbles < 8) on int64 tensors holding u32 values."""
    pool = a | (b << 32)
    sel = torch.as_tensor(sel, dtype=torch.int64, device=a.device)
    out = torch.zeros_like(a)
    for i in range(4):
        idx = (sel >> (4 * i)) & 7
        out |= ((pool >> (8 * idx)) & 0xFF) << (8 * i)
    return out


def _bf16x2_to_f32(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = (word & 0xFFFF), (word >> 16) & 0xFFFF
    as_bf16 = [(h << 16).to(torch.int64).to(torch.int32).view(torch.float32) for h in (lo, hi)]
    return as_bf16[0], as_bf16[1]


def decode_emulated(wp: Sm90Nvfp4Weight) -> torch.Tensor:
    """Host model of the kernel's register dequantization (device_utils.nvfp4x8_to_bf16x2x4 and
    e5m3x4_to_bf16x2x4, same bit operations; the kernel's `_s2` / `x2` forms give the same bf16
    products, two scale images per word) -> fp32 [L, N, K] = e2m1 x block scale (no global
    scale). Tests check it equals formats.dequantize_nvfp4 of the original weight."""
    from cutedsl.kernels import device_utils as du

    L, N, KH = wp.w.shape
    T = 2 * KH // _BK
    words = wp.w.reshape(L, N, T, 4, 2, 4).to(torch.int64)  # [.., c, q, byte]
    w = sum(words[..., i] << (8 * i) for i in range(4))  # [L, N, T, c, q]
    s = wp.sf.transpose(1, 2).to(torch.int64) & 0xFFFFFFFF  # [L, N, T]
    hi = torch.full_like(s, du.SCALE_HI * 0x01010101)
    scale_words = [
        (_prmt(s, hi, sel) << 4) & 0xFFFFFFFF for sel in (0x4040, 0x4141, 0x4242, 0x4343)
    ]
    pairs = [_rotl(w, r) & du.BF16X2_MASK for r in du.ROT[:3]]
    pairs.append((_rotl(w, du.ROT[3]) & du.MASK3) | (_rotl(w, du.ROT3_E1) & du.MASK3_E1))
    out = torch.empty((L, N, T, 4, 2, 4, 2), dtype=torch.float32, device=w.device)  # c q p e
    for p, t in enumerate(pairs):
        a0, a1 = _bf16x2_to_f32(t)  # e2m1 * 2^-126 (0.5 is a bf16 subnormal: kept, not flushed)
        for q in range(2):
            s0, _ = _bf16x2_to_f32(scale_words[2 * q + p // 2][..., None])  # scale * 2^107
            prod = [(x[..., q] * s0).to(torch.bfloat16).float() * du.DECODE_BIAS for x in (a0, a1)]
            out[:, :, :, :, q, p, 0], out[:, :, :, :, q, p, 1] = prod
    # [.., c, q, p=(jj, h), e] -> k = 64t + 16(2q + jj) + 8h + 2c + e
    out = out.reshape(L, N, T, 4, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 6, 3, 7)
    return out.reshape(L, N, 2 * KH)


def dequantize_prepared(wp: Sm90Nvfp4Weight) -> torch.Tensor:
    """fp32 [L, N, K] = the weight the kernels multiply by, global scale included (tests)."""
    return decode_emulated(wp) * wp.gs[:, None, None]


# ------------------------------------------------------------------------------ compile cache

_CACHE: dict[tuple, object] = {}
_LOCK = threading.Lock()
_COMPILES = [0]


def _compiled(tile_n: int, tile_m: int, split_k: int, moe: bool) -> object:
    key = (tile_n, tile_m, split_k, moe)  # compile-time values only
    fn = _CACHE.get(key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                from cutedsl.kernels.gemm_sm90 import compile_kernel

                fn = compile_kernel(tile_n, tile_m, split_k, moe)
                _CACHE[key] = fn
                _COMPILES[0] += 1
    return fn


def cache_keys() -> list[tuple]:
    """Keys of the compiled variants: (tile_n, tile_m, split_k, moe)."""
    return list(_CACHE)


def compile_count() -> int:
    """How many times this process ran cute.compile for this family."""
    return _COMPILES[0]


# ------------------------------------------------------------------------------ tactics


_TUNED = Path(__file__).with_name("tuned") / "sm90_h200_dense.json"


@functools.cache
def _tuned_table() -> dict[tuple[int, int, int], list[tuple[int, tuple[int, int, int]]]]:
    """(N, K, groups) -> [(measured M, tactic)] ascending, from cutedsl/tuned/sm90_h200_dense.json
    (built by `python -m cutedsl.bench.tune_sm90` from `gemm_sm90 --sweep grid` runs)."""
    with open(_TUNED) as f:
        dense = json.load(f)["dense"]
    out = {}
    for key, per_m in dense.items():
        n, k, g = (int(x) for x in key.split(","))
        out[(n, k, g)] = sorted((int(m), tuple(e["tactic"])) for m, e in per_m.items())
    return out


def _split_k(ctas: int, kt: int, tile_m: int, cap: int) -> int:
    """The largest power-of-two K split with ctas * split <= cap that the kernel takes (a cluster
    of <= MAX_SPLIT_K CTAs, dividing tile_m / 2) and leaves every split >= 8 K tiles."""
    s = 1
    while (
        ctas * s * 2 <= cap
        and kt % (s * 2) == 0
        and kt // (s * 2) >= 8
        and s * 2 <= MAX_SPLIT_K
        and (tile_m // 2) % (s * 2) == 0
    ):
        s *= 2
    return s


def choose_tactic(
    m: int, n: int, k: int, groups: int, moe: bool = False, num_sms: int = _NUM_SMS_H200
) -> tuple[int, int, int]:
    """(tile_n, tile_m, split_k) for m rows of an N x K weight with `groups` groups.

    Dense / grouped shapes in the measured table (cutedsl/tuned/sm90_h200_dense.json: the Flash
    projections, H200 grid sweeps of 2026-12-03, every tactic of `gemm_sm90 --sweep grid`) take the
    fastest tactic of the smallest measured M >= m. Otherwise a rule fitted to the same sweep
    (within 2 % of the fastest on its geomean there, 1.49x at worst: wo_a at M = 128):
    - m <= 32 (decode): token tile 16 / 32; a grid of >= num_sms 128-row weight tiles takes
      128 x tile_m unsplit, else 64-row tiles split K while the grid is under two waves;
    - larger m, a grid of >= num_sms 128-row weight tiles: 128 x (64 | 128 | 256) covering m (up to
      256), unsplit;
    - larger m, a smaller grid: 128 x (64 for m <= 128, 128 for m <= 256, else 256), split K up to
      one wave (num_sms CTAs);
    split-K never drops a split under 8 K tiles (`_split_k`).
    MoE (rows per expert unknown on the host, m = the launch's sizing): tile 16/32/64/128 covering
    m, else 192 (H200 2026-12-04, bench/results/h200_2026-12-04/sweep_moe192.json: routed w13 / w2
    at M = 4096 1.18x / 1.17x, at M = 16384 1.03x / 1.01x faster than 256); 128 weight rows from
    tile 64 up and at tile 16 (H200 2026-12-03 sweep, routed w13 / w2 at M = 16, 64, 256: 2-3 %
    faster than 64), 64 at tile 32; never split.
    """
    kt = k // _BK
    if moe:
        tile_m = next((t for t in (16, 32, 64, 128) if m <= t), 192)
        tile_n = 64 if tile_m == 32 or n % 128 else 128
        return tile_n, tile_m, 1
    if num_sms == _NUM_SMS_H200:
        for m_max, tactic in _tuned_table().get((n, k, groups), ()):
            if m <= m_max:
                return tactic
    wide = n % 128 == 0 and (n // 128) * groups >= num_sms  # 128-row tiles fill the GPU
    if m <= 32:
        tile_m = 16 if m <= 16 else 32
        if wide:
            return 128, tile_m, 1
        # split while the grid is under two waves: the doubled grid stays under four
        return 64, tile_m, _split_k((n // 64) * groups, kt, tile_m, 4 * num_sms - 1)
    tile_n = 128 if n % 128 == 0 else 64
    if wide:
        return tile_n, (64 if m <= 64 else 128 if m <= 128 else 256), 1
    tile_m = 64 if m <= 128 else 128 if m <= 256 else 256
    ctas = (n // tile_n) * -(-m // tile_m) * groups
    return tile_n, tile_m, _split_k(ctas, kt, tile_m, num_sms)


# ------------------------------------------------------------------------------ launch


def _check_a(a: torch.Tensor, k: int, name: str = "a") -> None:
    if a.dtype != torch.bfloat16:
        raise ValueError(f"{name}: dtype {a.dtype}, expected torch.bfloat16")
    if a.shape[-1] != k:
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected last dim K={k}")
    if not a.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (row-major, K innermost)")


_MAX_GRID_Y = 65535


def moe_tile_bound(rows: int, experts: int, tile_m: int) -> int:
    """The MoE kernel's grid.y: an upper bound on sum_e ceil(rows_e / tile_m) over any routing
    of `rows` rows to `experts` experts (each expert with rows adds at most one partial tile)."""
    return min(experts, rows) + rows // tile_m


def launch_tactic(m: int, n: int, k: int, groups: int, moe: bool) -> tuple[int, int, int]:
    """The tactic a launch of m rows uses when none is forced (what `warmup` must compile).
    MoE: rows per expert are unknown on the host; size tiles for 2x the uniform share. When even
    min(E, m) experts in 128-row tiles give under two CTAs per SM (m = 6: one decode token), take
    64-row tiles: H200 2026-12-03 (bench/experiments/moe_schedule.py), routed w13 / w2 at M = 1
    1.11x / 1.09x faster; at M = 4 (736 CTAs) 0.95x / 0.97x, so not there."""
    m_eff = max(1, 2 * -(-m // groups)) if moe else m
    tile_n, tile_m, split_k = choose_tactic(m_eff, n, k, groups, moe)
    if moe and tile_n == 128 and min(groups, m) * (n // 128) < 2 * _NUM_SMS_H200:
        tile_n = 64
    return tile_n, tile_m, split_k


_DUMMY: dict[tuple, torch.Tensor] = {}


def _dummy(device: torch.device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    key = (device, shape, dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def _launch(
    a3: torch.Tensor,  # (La, M, K) bf16 contiguous
    wp: Sm90Nvfp4Weight,
    out3: torch.Tensor,  # (La, M, N) bf16 contiguous
    offs: torch.Tensor | None,
    tactic: tuple[int, int, int] | None,
) -> None:
    """Launch one GEMM (split-K tactics reduce in a thread-block cluster: no scratch)."""
    la, m, k = a3.shape
    moe = offs is not None
    if tactic is None:
        tactic = launch_tactic(m, wp.n, k, wp.groups, moe)
    tile_n, tile_m, split_k = tactic
    if tile_m not in TILE_M_VERIFIED:
        raise ValueError(f"tactic {tactic}: tile_m {tile_m} not in {TILE_M_VERIFIED}")
    if moe and split_k != 1:
        raise NotImplementedError("split-K with MoE offsets is not wired on the host")
    if moe and moe_tile_bound(m, wp.groups, tile_m) > _MAX_GRID_Y:
        raise ValueError(
            f"a: {m} rows in token tiles of {tile_m} give up to "
            f"{moe_tile_bound(m, wp.groups, tile_m)} MoE tiles, over the grid limit "
            f"{_MAX_GRID_Y}; use a larger tile_m"
        )
    _compiled(tile_n, tile_m, split_k, moe)(*kernel_operands(a3, wp, out3, offs))


def kernel_operands(
    a3: torch.Tensor,  # (La, M, K) bf16 contiguous
    wp: Sm90Nvfp4Weight,
    out3: torch.Tensor,  # (La, M, N) bf16 contiguous
    offs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The operands of a compiled kernel (`cutedsl.kernels.gemm_sm90.compile_kernel`) as views:
    a (M, K, La), w (N, K/2, L), sf (N, K/64, L), gs, out (N, M, La), offs (a dummy unless MoE)."""
    offs_t = offs if offs is not None else _dummy(a3.device, (1,), torch.int32)
    return (
        a3.permute(1, 2, 0),
        wp.w.permute(1, 2, 0),
        wp.sf.permute(2, 1, 0),
        wp.gs,
        out3.permute(2, 1, 0),
        offs_t,
    )


def sm90_nvfp4_gemm_prepared(
    a: torch.Tensor,  # (M, K) bf16
    wp: Sm90Nvfp4Weight,  # one group
    out: torch.Tensor | None = None,  # (M, N) bf16
    tactic: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """out = a @ dequant(wp)^T, fp32 accumulation, BF16 out. M may be 0."""
    if wp.groups != 1:
        raise ValueError(f"wp: {wp.groups} groups, expected 1 (use sm90_nvfp4_grouped_gemm)")
    _check_a(a, wp.k)
    if a.ndim != 2:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [M, K]")
    m = a.shape[0]
    if out is None:
        out = a.new_empty((m, wp.n))
    if m == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, m, wp.n), None, tactic)
    return out


def sm90_nvfp4_gemm(
    a: torch.Tensor,  # (M, K) bf16
    b_packed: torch.Tensor,  # (N, K//2) uint8
    b_sf: torch.Tensor,  # (N, K//16) e4m3 linear
    b_gs: torch.Tensor | float,  # fp32 0-dim
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Convenience form that prepares the weight on every call (tests; not the hot path)."""
    return sm90_nvfp4_gemm_prepared(a, prepare_nvfp4_weight(b_packed, b_sf, b_gs), out)


def sm90_nvfp4_grouped_gemm(
    a: torch.Tensor,  # (G, M, K) bf16, per-group contiguous
    wp: Sm90Nvfp4Weight,  # G groups
    out: torch.Tensor | None = None,  # (G, M, N) bf16
    tactic: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """out[g] = a[g] @ dequant(wp[g])^T for G equal groups (wo_a)."""
    _check_a(a, wp.k)
    if a.ndim != 3 or a.shape[0] != wp.groups:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [G={wp.groups}, M, K={wp.k}]")
    g, m, _ = a.shape
    if out is None:
        out = a.new_empty((g, m, wp.n))
    if m == 0:
        return out
    _launch(a, wp, out, None, tactic)
    return out


def sm90_nvfp4_moe_gemm(
    a: torch.Tensor,  # (T, K) bf16, rows grouped by expert
    offs: torch.Tensor,  # (E+1,) int32 on the device: expert e owns rows [offs[e], offs[e+1])
    wp: Sm90Nvfp4Weight,  # E groups
    out: torch.Tensor | None = None,  # (T, N) bf16
    tactic: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ dequant(wp[e])^T. One compile serves every routing; rows
    outside [offs[0], offs[E]) are not written."""
    _check_a(a, wp.k)
    if a.ndim != 2:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [T, K]")
    if offs.dtype != torch.int32 or offs.shape != (wp.groups + 1,):
        raise ValueError(
            f"offs: {offs.dtype} {tuple(offs.shape)}, expected int32 ({wp.groups + 1},)"
        )
    t = a.shape[0]
    if out is None:
        out = a.new_empty((t, wp.n))
    if t == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, t, wp.n), offs, tactic)
    return out


def warmup(tactics: list[tuple[int, int, int, bool]]) -> None:
    """Compile (tile_n, tile_m, split_k, moe) variants before CUDA-graph capture."""
    for tn, tm, sk, moe in tactics:
        _compiled(tn, tm, sk, moe)
