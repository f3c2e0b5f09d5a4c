"""NVFP4 format core: the single source of truth for the format (torch only, CPU-safe).

Legend: M tokens, N out features, R rows of a matrix (N for a weight, M for an activation),
K in features (always logical; packed bytes are K//2), G o-proj groups, E experts.

NVFP4 (ModelOpt / checkpoint convention):
  - E2M1 values: code bits ``s e e m`` (bit 3 = sign), magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
  - Two codes per byte along K, element 2i in the LOW nibble, element 2i+1 in the high nibble.
  - One float8_e4m3fn block scale per 16 consecutive K elements of a row.
  - One fp32 global scale per tensor, multiply-to-dequantize (``weight_scale_2``/``input_scale``):
      x ≈ e2m1 · block_scale · global_scale,   global_scale = amax / (6 · 448).
  - Kernels read the block scales in the 128x4 "blocked" layout (cuBLAS/CUTLASS block-scaling
    layout, vLLM ``swizzle_blockscale``): rows padded to 128, scale columns padded to 4, each
    (128 rows x 4 cols) tile stored as 512 contiguous bytes with row r = 32·i + j, col c at byte
    16·j + 4·i + c.

Quantization follows vLLM 0.21.0's ``ref_nvfp4_quant`` arithmetic step by step (it uses the
quantize-side global scale 1/global_scale), so that our codes and scales are bit-identical to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
# Same Python float as vLLM's FLOAT4_E2M1_MAX_RECIPROCAL (bit-exact scale arithmetic).
_FP4_MAX_RCP = 1 / FP4_MAX
_TILE_ROWS = 128
_TILE_COLS = 4

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""float32 (16,): E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0)."""

# Midpoints between consecutive magnitudes and whether a tie rounds up (to the even code).
# Ties: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (round half to even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))  # fmt: skip


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``."""
    return (x + m - 1) // m * m


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype}, expected {want}")


def _check_k(name: str, t: torch.Tensor) -> int:
    if t.ndim < 1 or t.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"{name}: shape {tuple(t.shape)}, expected the last dim (K) divisible by {BLOCK}"
        )
    return t.shape[-1]


def _as_scale(name: str, s: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    s = torch.as_tensor(s, device=device)
    if not s.is_floating_point():
        raise ValueError(f"{name}: dtype {s.dtype}, expected a floating point scale")
    return s.to(torch.float32)


# --------------------------------------------------------------------------- E2M1 codec


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to even, saturating at ±6.

    x: any shape, floating point. Returns uint8 codes (0..15) of the same shape. The sign bit is
    taken from ``x`` (so -0.1 -> code 8, i.e. -0.0); NaN maps to ±0.
    """
    if not x.is_floating_point():
        raise ValueError(f"x: dtype {x.dtype}, expected a floating point tensor")
    a = x.abs().to(torch.float32)
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        mag += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits used, any shape) -> float32 values of the same shape."""
    _check_dtype("codes", codes, (torch.uint8,))
    return E2M1_VALUES.to(codes.device)[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K//2]; element 2i in the low nibble."""
    _check_dtype("codes", codes, (torch.uint8,))
    if codes.ndim < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes: shape {tuple(codes.shape)}, expected an even last dim")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K//2] -> uint8 codes [..., K] (inverse of :func:`pack_e2m1`)."""
    _check_dtype("packed", packed, (torch.uint8,))
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- quantizers


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """fp32 global scale (``weight_scale_2`` convention) = amax / (6·448); 1.0 where amax == 0.

    amax: 0-dim or any shape (e.g. [E] per expert); returns fp32 of the same shape. The amax == 0
    case (an all-zero tensor) gets 1.0 so that the quantize-side reciprocal stays finite; every
    code is then 0 and the dequantized tensor is exactly zero either way.
    """
    device = amax.device if torch.is_tensor(amax) else torch.device("cpu")
    amax = _as_scale("amax", amax, device)
    gs = amax / (FP4_MAX * E4M3_MAX)
    return torch.where(amax > 0, gs, torch.ones_like(gs))


def _quantize_blocks(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Core quantizer, vLLM ``ref_nvfp4_quant`` arithmetic. x [..., R, K]; global_scale
    broadcastable to x.shape[:-2] (checkpoint convention). Returns (codes uint8 [..., R, K],
    block scales e4m3 [..., R, K//16])."""
    *lead, r, k = x.shape
    gs_q = (1.0 / global_scale).to(torch.float32)  # vLLM's input_global_scale_inv
    gs_q = gs_q.reshape(*gs_q.shape, 1, 1, 1)  # over (R, K//16, 16)
    xb = x.to(torch.float32).reshape(*lead, r, k // BLOCK, BLOCK)
    vec_max = xb.abs().amax(dim=-1, keepdim=True)
    scale = gs_q * (vec_max * _FP4_MAX_RCP)
    scale = torch.clamp(scale, min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale_f = scale.to(torch.float32)
    output_scale = _safe_reciprocal(scale_f * _safe_reciprocal(gs_q))
    scaled = torch.clamp(xb * output_scale, -FP4_MAX, FP4_MAX)
    codes = encode_e2m1(scaled).reshape(*lead, r, k)
    return codes, scale.squeeze(-1)


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x with 0 -> 1e-8, exactly as vLLM's ``get_reciprocal`` (keeps all-zero blocks zero)."""
    return 1.0 / (x + (x == 0) * 1e8)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight (or any) tensor x [..., R, K] (bf16/fp16/fp32, K % 16 == 0) to NVFP4.

    global_scale: None -> computed from amax over all of x (one 0-dim scale); or a given fp32
    scale in the checkpoint convention (0-dim, or shaped like x.shape[:-2], e.g. [E] for stacked
    experts): pass one explicitly to share it across a fused pair (wq_a+wkv, w1+w3).
    Returns (packed uint8 [..., R, K//2], block_scales float8_e4m3fn [..., R, K//16] linear
    layout, global_scale fp32). Values beyond 6·448·global_scale saturate.
    """
    _check_dtype("x", x, (torch.bfloat16, torch.float16, torch.float32))
    if x.ndim < 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [..., R, K] with ndim >= 2")
    _check_k("x", x)
    if global_scale is None:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        global_scale = global_scale_from_amax(amax.to(torch.float32))
    gs = _as_scale("global_scale", global_scale, x.device)
    if gs.ndim > 0 and tuple(gs.shape) != tuple(x.shape[:-2]):
        raise ValueError(
            f"global_scale: shape {tuple(gs.shape)}, expected () or {tuple(x.shape[:-2])}"
        )
    codes, sf = _quantize_blocks(x, gs)
    return pack_e2m1(codes), sf, gs


def quantize_nvfp4_activation(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize an activation x [M, K] with dynamic block scales (vLLM ``ref_nvfp4_quant``).

    global_scale: the static fp32 ``input_scale`` (checkpoint convention, 0-dim); None computes
    amax(x)/(6·448). vLLM quantizes with 1/global_scale; our codes and e4m3 scales equal
    ``ref_nvfp4_quant(x, 1/global_scale, 16)`` bit for bit. Returns (packed uint8 [M, K//2],
    block_scales e4m3 [M, K//16] linear layout, global_scale fp32 0-dim).
    """
    if x.ndim != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [M, K]")
    if global_scale is not None and torch.as_tensor(global_scale).ndim != 0:
        raise ValueError(
            f"global_scale: shape {tuple(torch.as_tensor(global_scale).shape)}, expected ()"
        )
    return quantize_nvfp4(x, global_scale)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    *,
    swizzled: bool = False,
) -> torch.Tensor:
    """NVFP4 -> dense [..., R, K] in ``dtype``: x = e2m1 · (block_scale · global_scale), fp32 math.

    packed: uint8 [..., R, K//2]. block_scales: float8_e4m3fn (or its uint8 bytes) [..., R, K//16]
    linear, or with swizzled=True the blocked layout [..., pad128(R), pad4(K//16)].
    global_scale: fp32, 0-dim or shaped like packed.shape[:-2]. The operation order is the one
    of vLLM's ``dequantize_to_dtype``, so results are identical to it.
    """
    _check_dtype("packed", packed, (torch.uint8,))
    _check_dtype("block_scales", block_scales, (torch.float8_e4m3fn, torch.uint8))
    if packed.ndim < 2:
        raise ValueError(f"packed: shape {tuple(packed.shape)}, expected [..., R, K//2]")
    *lead, r, kh = packed.shape
    k = 2 * kh
    if k % BLOCK != 0:
        raise ValueError(
            f"packed: shape {tuple(packed.shape)}, expected K = 2*{kh} divisible by {BLOCK}"
        )
    sf = block_scales.view(torch.float8_e4m3fn)
    if swizzled:
        want = (*lead, round_up(r, _TILE_ROWS), round_up(k // BLOCK, _TILE_COLS))
        if tuple(sf.shape) != want:
            raise ValueError(f"block_scales: shape {tuple(sf.shape)}, expected {want} (blocked)")
        sf = unswizzle_scales(sf, r, k)
    elif tuple(sf.shape) != (*lead, r, k // BLOCK):
        raise ValueError(
            f"block_scales: shape {tuple(sf.shape)}, expected {(*lead, r, k // BLOCK)}"
        )
    gs = _as_scale("global_scale", global_scale, packed.device)
    if gs.ndim > 0 and tuple(gs.shape) != tuple(lead):
        raise ValueError(f"global_scale: shape {tuple(gs.shape)}, expected () or {tuple(lead)}")
    gs = gs.reshape(*gs.shape, 1, 1)
    vals = decode_e2m1(unpack_e2m1(packed)).reshape(*lead, r, k // BLOCK, BLOCK)
    out = vals * (sf.to(torch.float32) * gs).unsqueeze(-1)
    return out.reshape(*lead, r, k).to(dtype)


# --------------------------------------------------------------------------- scale layouts


def swizzle_scales(sf: torch.Tensor) -> torch.Tensor:
    """Linear block scales [..., R, C] (C = K//16) -> blocked [..., pad128(R), pad4(C)].

    Zero padding. Same bytes as vLLM's ``swizzle_blockscale`` and torch ``to_blocked``: tile
    (rt, ct) of 128x4 is stored contiguously, row 32·i + j and column c at byte 16·j + 4·i + c.
    The result is returned as a contiguous tensor viewed with the padded 2-D shape.
    """
    _check_dtype("sf", sf, (torch.float8_e4m3fn, torch.uint8))
    if sf.ndim < 2:
        raise ValueError(f"sf: shape {tuple(sf.shape)}, expected [..., R, K//16]")
    *lead, r, c = sf.shape
    rp, cp = round_up(r, _TILE_ROWS), round_up(c, _TILE_COLS)
    padded = sf.new_zeros((*lead, rp, cp))
    padded[..., :r, :c] = sf
    tiles = padded.reshape(*lead, rp // 128, 4, 32, cp // 4, 4)
    n = len(lead)
    perm = (*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (rt, ct, j, i, c)
    return tiles.permute(perm).contiguous().reshape(*lead, rp, cp)


def unswizzle_scales(blocked: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Blocked [..., pad128(rows), pad4(k//16)] -> linear [..., rows, k//16] (k is the logical K).

    Inverse of :func:`swizzle_scales` (vLLM's ``convert_swizzled_to_linear``).
    """
    _check_dtype("blocked", blocked, (torch.float8_e4m3fn, torch.uint8))
    if k % BLOCK != 0:
        raise ValueError(f"k: {k}, expected a multiple of {BLOCK}")
    c = k // BLOCK
    rp, cp = round_up(rows, _TILE_ROWS), round_up(c, _TILE_COLS)
    if blocked.ndim < 2 or tuple(blocked.shape[-2:]) != (rp, cp):
        raise ValueError(
            f"blocked: shape {tuple(blocked.shape)}, expected [..., {rp}, {cp}] for rows={rows}, k={k}"
        )
    lead = blocked.shape[:-2]
    n = len(lead)
    tiles = blocked.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)  # (rt, ct, j, i, c)
    perm = (*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (rt, i, j, ct, c)
    return tiles.permute(perm).reshape(*lead, rp, cp)[..., :rows, :c].contiguous()


def assemble_group_scales(
    sf: torch.Tensor | Sequence[torch.Tensor], padded_rows: int
) -> torch.Tensor:
    """Per-group block scales -> one blocked tensor [G·padded_rows, pad4(C)] for grouped GEMMs.

    sf: [G, R, C] or a sequence of G tensors [R_g, C] (R_g <= padded_rows). padded_rows: a
    multiple of 128. Group g's rows start at row g·padded_rows, each group swizzled in its own
    128-row tiles; padding rows/cols are zero.
    """
    if torch.is_tensor(sf) and sf.ndim != 3:
        raise ValueError(f"sf: shape {tuple(sf.shape)}, expected [G, R, K//16]")
    groups = list(sf.unbind(0)) if torch.is_tensor(sf) else list(sf)
    if not groups:
        raise ValueError("sf: no groups, expected G >= 1")
    if padded_rows <= 0 or padded_rows % _TILE_ROWS != 0:
        raise ValueError(f"padded_rows: {padded_rows}, expected a positive multiple of 128")
    c = groups[0].shape[-1]
    stacked = groups[0].new_zeros((len(groups), padded_rows, c))
    for g, s in enumerate(groups):
        if s.ndim != 2 or s.shape[-1] != c or s.shape[0] > padded_rows:
            raise ValueError(
                f"sf[{g}]: shape {tuple(s.shape)}, expected [R_g <= {padded_rows}, {c}]"
            )
        stacked[g, : s.shape[0]] = s
    return swizzle_scales(stacked.reshape(len(groups) * padded_rows, c))
