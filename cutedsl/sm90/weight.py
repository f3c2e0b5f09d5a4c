"""NVFP4 weights prepared for the SM90 W4A16 kernels (`cutedsl.sm90.kernels.gemm`), and the host
model of the kernels' register decode.

Legend: N out features, K in features (logical; packed bytes K//2), L weight groups (G o-proj groups,
E experts, 1 for a dense linear).

`prepare_weight` (once, at load) re-encodes the NVFP4 weight for the kernel's register
dequantization (`cutedsl.sm90.kernels.decode` decodes it; `decode_emulated` is its host model):
- weights, uint8 [L, N, K/2]: per row and 64-wide K tile, 32 bytes = 4 lanes c x 2 words q x 4 bytes.
  Word (c, q) holds the 8 e2m1 codes the wgmma A fragment of lane c needs for K blocks j = 2q, 2q+1:
  pair p = 2*(j - 2q) + h holds k = 16j + 8h + 2c + (0, 1) (element e = 0, 1). Code bit b of element
  (p, e) sits at bit (T[b] + 16e - R[p][b]) mod 32, where T = (6, 7, 8, 15) (m, e0, e1, sign: the
  bf16 bits it decodes to) and R[p][b] = ROT[p], except R[3][2] = ROT3_E1 (`decode`): the kernel
  decodes pair p with one rotation and one mask (pair 3: two of each). The codes of a block whose
  scale is 0 are stored as 0.
- block scales, int32 [L, K/64, N] (N contiguous: one TMA box of tile_n words per K tile): the 4
  scales of a row's K tile, one byte each, as "e5m3" codes (value 2^E (1 + m/8), code (E+10)<<3 | m,
  0 = zero), so that every e4m3 value (subnormals included) is a normal bf16 in the kernel.
  Negative scales are folded into the signs of their 16 weights; NaN scales are refused.
- global scale: fp32 [L], applied in the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BK = 64  # K per tile of the encoding (one kernel K tile)

# The decode constants (`cutedsl.sm90.kernels.decode` applies them on the device).
BF16X2_MASK = 0x81C081C0  # sign bit and 3 magnitude bits of each bf16 half
ROT = (0, 4, 10, 6)  # left rotation of pair p; pair 3 takes e1 (bits 8 / 24) from ROT3_E1 instead
ROT3_E1 = 14
MASK3 = 0x80C080C0  # pair 3: sign, e0, m from ROT[3]
MASK3_E1 = 0x01000100  # pair 3: e1 from ROT3_E1
SCALE_HI = 0x07  # prmt'd above each e5m3 code: exponent + 224 after << 4
DECODE_BIAS = 2.0**19  # e2m1 · scale = the decoded bf16 product · DECODE_BIAS


@dataclass(frozen=True)
class Weight:
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


def prepare_weight(
    b_packed: torch.Tensor,  # [N, K//2] | [L, N, K//2] | [L*N, K//2] with groups=L; uint8
    b_sf: torch.Tensor,  # same leading shape, [.., N, K//16] float8_e4m3fn linear (not swizzled)
    b_gs: torch.Tensor | float,  # fp32 0-dim or [L]
    groups: int | None = None,
) -> Weight:
    """Repack an NVFP4 weight once for the sm_90a kernels (see Weight)."""
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
    return Weight(w=w, sf=sf, gs=gs.contiguous(), n=N, k=K, groups=L)


# ------------------------------------------------------------------------------ weight encoding

# e4m3 magnitude byte (0..0x7E) -> e5m3 code: normal e4m3 (exponent field e >= 1) is x + 24;
# subnormal m * 2^-9 (m = 1..7) renormalized; 0x7F (NaN) is refused before the lookup.
_E5M3 = [0, 8, 16, 20, 24, 26, 28, 30] + [x + 24 for x in range(8, 128)]
_ROWS_PER_CHUNK = 8192  # bounds the int64 temporaries of the encoding (rows x K/2 x 8 B)


def encode_weight(packed: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed uint8 [L, N, K/2] + e4m3 codes uint8 [L, N, K/16] -> (w uint8 [L, N, K/2], sf int32
    [L, K/64, N]) in the sm90 encoding (module docstring). Runs on the tensors' device, in chunks
    of rows: each packed byte holds elements e = 0, 1 of one pair p of one word, so a word is the
    OR of one 256-entry lookup per pair (`_byte_bits`) of its four bytes."""
    L, N, KH = packed.shape
    K, T = 2 * KH, 2 * KH // _BK
    if bool(((sf & 0x7F) == 0x7F).any()):
        bad = ((sf & 0x7F) == 0x7F).nonzero()[0].tolist()
        raise ValueError(f"b_sf: NaN block scale (e4m3 0x7F/0xFF) at [group, row, block] = {bad}")
    rows_p, rows_s = packed.reshape(L * N, KH), sf.reshape(L * N, K // 16)
    w_out = torch.empty_like(rows_p)
    s_rows = torch.empty((L * N, T), dtype=torch.int32, device=packed.device)
    dev = packed.device
    e5m3 = torch.tensor(_E5M3, dtype=torch.uint8, device=dev)
    lut = _byte_bits().to(dev)  # [pair p * 256 + byte] -> its bits in the word
    # packed byte kb of a 64-wide K tile: kb = 16q + 8jj + 4h + c, pair p = 2jj + h
    pair = torch.arange(_BK // 2, device=dev).div(4, rounding_mode="floor") % 4
    base = (pair * 256).reshape(1, 1, _BK // 2)
    shift = 8 * torch.arange(4, device=dev)
    for r0 in range(0, L * N, _ROWS_PER_CHUNK):
        r1 = min(L * N, r0 + _ROWS_PER_CHUNK)
        s = rows_s[r0:r1]
        code_s = e5m3[(s & 0x7F).long()]  # [R, K/16]
        # a block's 8 bytes: zero scale -> zero codes; negative scale -> flipped code signs
        keep = torch.where(code_s != 0, 0xFF, 0).to(torch.uint8)
        flip = torch.where(s >= 0x80, 0x88, 0).to(torch.uint8)
        b = (rows_p[r0:r1] ^ flip.repeat_interleave(8, dim=1)) & keep.repeat_interleave(8, dim=1)
        idx = b.reshape(r1 - r0, T, _BK // 2).long() + base
        # [R, t, q, jj, h, c] -> OR over the 4 pairs (jj, h) of word (c, q); disjoint bits
        v = lut[idx].reshape(r1 - r0, T, 2, 4, 4).sum(3)  # [R, t, q, c]
        word = v.transpose(2, 3).contiguous()  # [R, t, c, q], values < 2^32
        w_out[r0:r1] = (
            word.view(torch.uint8).reshape(r1 - r0, T, 8, 8)[..., :4].reshape(r1 - r0, KH)
        )
        sw = (code_s.reshape(r1 - r0, T, 4).long() << shift).sum(-1)  # < 2^32: stored as int32 bits
        s_rows[r0:r1] = torch.where(sw >= 2**31, sw - 2**32, sw).to(torch.int32)
    w = w_out.reshape(L, N, KH)
    return w, s_rows.reshape(L, N, T).transpose(1, 2).contiguous()


def _byte_bits() -> torch.Tensor:
    """int64 [4 * 256]: entry 256 p + byte = the bits in its word of a packed byte (low nibble
    element 0, high nibble element 1) of pair p (`_code_bit_positions`)."""
    pos = _code_bit_positions()
    byte = torch.arange(256, dtype=torch.int64)
    out = torch.zeros(4, 256, dtype=torch.int64)
    for p in range(4):
        for e in range(2):
            code = (byte >> (4 * e)) & 0xF
            for b in range(4):
                out[p] |= ((code >> b) & 1) << pos[p, e, b]
    return out.reshape(-1)


def _code_bit_positions() -> torch.Tensor:
    """int64 [4 pairs, 2 elements, 4 code bits]: where code bit b of element (p, e) sits in its
    word (module docstring)."""

    pos = torch.empty(4, 2, 4, dtype=torch.int64)
    for p in range(4):
        for e in range(2):
            for b, t in enumerate((6, 7, 8, 15)):
                r = ROT3_E1 if (p, b) == (3, 2) else ROT[p]
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


def decode_emulated(wp: Weight) -> torch.Tensor:
    """Host model of the kernel's register dequantization (the bit operations of
    `cutedsl.sm90.kernels.decode`: per pair one rotate and mask, e5m3 scale words built by prmt,
    one bf16x2 multiply) -> fp32 [L, N, K] = e2m1 x block scale (no global scale). Tests check it
    equals formats.dequantize_nvfp4 of the original weight."""

    L, N, KH = wp.w.shape
    T = 2 * KH // _BK
    words = wp.w.reshape(L, N, T, 4, 2, 4).to(torch.int64)  # [.., c, q, byte]
    w = sum(words[..., i] << (8 * i) for i in range(4))  # [L, N, T, c, q]
    s = wp.sf.transpose(1, 2).to(torch.int64) & 0xFFFFFFFF  # [L, N, T]
    hi = torch.full_like(s, SCALE_HI * 0x01010101)
    scale_words = [
        (_prmt(s, hi, sel) << 4) & 0xFFFFFFFF for sel in (0x4040, 0x4141, 0x4242, 0x4343)
    ]
    pairs = [_rotl(w, r) & BF16X2_MASK for r in ROT[:3]]
    pairs.append((_rotl(w, ROT[3]) & MASK3) | (_rotl(w, ROT3_E1) & MASK3_E1))
    out = torch.empty((L, N, T, 4, 2, 4, 2), dtype=torch.float32, device=w.device)  # c q p e
    for p, t in enumerate(pairs):
        a0, a1 = _bf16x2_to_f32(t)  # e2m1 * 2^-126 (0.5 is a bf16 subnormal: kept, not flushed)
        for q in range(2):
            s0, _ = _bf16x2_to_f32(scale_words[2 * q + p // 2][..., None])  # scale * 2^107
            prod = [(x[..., q] * s0).to(torch.bfloat16).float() * DECODE_BIAS for x in (a0, a1)]
            out[:, :, :, :, q, p, 0], out[:, :, :, :, q, p, 1] = prod
    # [.., c, q, p=(jj, h), e] -> k = 64t + 16(2q + jj) + 8h + 2c + e
    out = out.reshape(L, N, T, 4, 2, 2, 2, 2).permute(0, 1, 2, 4, 5, 6, 3, 7)
    return out.reshape(L, N, 2 * KH)


def dequantize_prepared(wp: Weight) -> torch.Tensor:
    """fp32 [L, N, K] = the weight the kernels multiply by, global scale included (tests)."""
    return decode_emulated(wp) * wp.gs[:, None, None]


# ------------------------------------------------------------------------------ fused SwiGLU order

SWIGLU_ROWS = 8  # gate (then up) rows per 16-row group of the fused SwiGLU's w13 order


def swiglu_row_order(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [n]: the w13 row (gate rows 0..I-1, then up rows I..2I-1; n = 2I) at each row of the
    fused SwiGLU's order: rows 16 b .. 16 b + 7 are gate 8 b .. 8 b + 7 and rows 16 b + 8 ..
    16 b + 15 are up 8 b .. 8 b + 7, so the GEMM's 16-row wgmma fragments hold each output
    column's gate and up in one thread (`cutedsl.sm90.kernels.gemm`, `swiglu`)."""
    if n % (2 * SWIGLU_ROWS):
        raise ValueError(f"w13: {n} rows, expected 2I with I a multiple of {SWIGLU_ROWS}")
    i = n // 2
    g = SWIGLU_ROWS
    # [b, h, r] -> h * I + 8 b + r
    b = torch.arange(i // g, device=device).view(-1, 1, 1)
    h = torch.arange(2, device=device).view(1, 2, 1)
    r = torch.arange(g, device=device).view(1, 1, g)
    return (h * i + g * b + r).reshape(n)


_REORDER_CHUNK_BYTES = 64 << 20  # bounds the temporary of `interleave_swiglu`


def interleave_swiglu(wp: Weight) -> Weight:
    """`wp` (a prepared w13: gate rows, then up rows) with its rows in `swiglu_row_order`, in
    place, a few groups at a time (the encoding is per row, so reordering the prepared rows
    equals preparing reordered checkpoint rows; the temporary stays under
    _REORDER_CHUNK_BYTES, or one group). Returns `wp`."""
    order = swiglu_row_order(wp.n, wp.w.device)
    step = max(1, _REORDER_CHUNK_BYTES // (wp.w[0].numel() + 4 * wp.sf[0].numel()))
    for g0 in range(0, wp.groups, step):
        g1 = min(wp.groups, g0 + step)
        wp.w[g0:g1] = wp.w[g0:g1].index_select(1, order)
        wp.sf[g0:g1] = wp.sf[g0:g1].index_select(2, order)
    return wp
