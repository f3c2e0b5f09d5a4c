"""NVFP4 weights prepared for the SM100 kernels (`cutedsl.sm100.kernels.gemm`). Pure torch: runs
on a CPU and never imports `cutlass`.

Legend: N out features (per group), K in features (logical; packed bytes K//2), L weight groups
(G o-proj groups, E experts, 1 for a dense linear), KB = K // 16, I the intermediate size.

`prepare_weight` (once, at load) turns a checkpoint NVFP4 weight into the GEMM's B operands:
- codes, uint8 (L*N, K//2): the checkpoint bytes unchanged (e2m1x2, element 2i in the low nibble),
  K-major, contiguous; group l owns rows [l*N, (l+1)*N).
- block scales, e4m3 (L*N, KB): the 128x4 blocked ("to_blocked") layout of each group's own
  (N, KB) matrix, placed at byte offset l*N*KB (`blocked_scale_offset` within a group). With
  N % 128 == 0 this equals the blocked layout of the whole (L*N, KB) matrix.
The global scale (`weight_scale_2`) is not part of it: the launchers take alpha = input_scale *
weight_scale_2 per group as an fp32 device vector.

A fused SwiGLU w13 weight is interleaved first (`interleave_w13`, on the packed codes and on the
LINEAR scales), so that accumulator column 2i is gate i and 2i+1 is up i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cutedsl import formats
from cutedsl.validate import require

TILE_N = 128  # the GEMM's N tile: N % TILE_N == 0 per group
TILE_K = 256  # the GEMM's K tile: K % TILE_K == 0


@dataclass(frozen=True)
class Weight:
    """NVFP4 weight prepared for the sm_100a GEMM (see the module docstring).

    w:  uint8 (groups*N, K//2) e2m1x2 codes, contiguous
    sf: float8_e4m3fn (groups*N, K//16), each group's scales 128x4-blocked on their own
    n:  out features per group (N % 128 == 0); k: in features (K % 256 == 0); groups: L >= 1
    """

    w: torch.Tensor
    sf: torch.Tensor
    n: int
    k: int
    groups: int


def blocked_scale_offset(row: torch.Tensor, blk: torch.Tensor, kb: int) -> torch.Tensor:
    """Byte offset of scale (row, blk) in the 128x4 blocked layout of a (rows, kb) matrix
    (kb % 4 == 0): the expression the quant kernel places each scale byte with."""
    rr = row % 128
    return ((row // 128) * (kb // 4) + blk // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + blk % 4


def prepare_weight(w_packed: torch.Tensor, w_sf: torch.Tensor, groups: int | None = None) -> Weight:
    """Checkpoint NVFP4 weight -> `Weight`.

    w_packed: uint8 [N, K//2], [L, N, K//2], or [L*N, K//2] with `groups` = L;
    w_sf: the matching LINEAR e4m3 scales [..., N, K//16] (uint8 bytes accepted).
    Requires N % 128 == 0 and K % 256 == 0 (the kernel's constraints; no padding is needed).
    Raises ValueError naming the offending argument otherwise.
    """
    require(w_packed.dtype == torch.uint8, f"w_packed: dtype {w_packed.dtype}, expected uint8")
    require(
        w_packed.ndim in (2, 3),
        f"w_packed: shape {tuple(w_packed.shape)}, expected [N, K//2] or [L, N, K//2]",
    )
    if w_packed.ndim == 3:
        require(
            groups in (None, w_packed.shape[0]),
            f"groups={groups}: w_packed has {w_packed.shape[0]} groups",
        )
        groups = w_packed.shape[0]
    elif groups is None:
        groups = 1
    *lead, kh = w_packed.shape
    rows = lead[0] * lead[1] if len(lead) == 2 else lead[0]
    require(
        groups >= 1 and rows % groups == 0,
        f"w_packed: {rows} rows, expected a multiple of groups={groups}",
    )
    n, k = rows // groups, 2 * kh
    require(n > 0 and n % TILE_N == 0, f"w_packed: N = {n}, expected a multiple of {TILE_N}")
    require(k > 0 and k % TILE_K == 0, f"w_packed: K = {k}, expected a multiple of {TILE_K}")
    want = (*w_packed.shape[:-1], k // 16)
    require(
        w_sf.dtype in (torch.float8_e4m3fn, torch.uint8),
        f"w_sf: dtype {w_sf.dtype}, expected float8_e4m3fn",
    )
    require(tuple(w_sf.shape) == want, f"w_sf: shape {tuple(w_sf.shape)}, expected {want}")
    w = w_packed.reshape(rows, kh).contiguous()
    sf = formats.swizzle_scales(w_sf.reshape(rows, k // 16).view(torch.float8_e4m3fn))
    return Weight(w=w, sf=sf, n=n, k=k, groups=groups)


def interleave_w13(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with rows (w1/gate 0..I-1, w3/up 0..I-1) -> rows (g0, u0, g1, u1, ...).

    Applied to the packed weight and to its LINEAR scales before `prepare_weight`; the fused
    SwiGLU epilogue reads accumulator column 2i as gate i and 2i+1 as up i."""
    *lead, r2, x = t.shape
    require(r2 % 2 == 0, f"w13: shape {tuple(t.shape)}, expected an even row count 2I")
    i = r2 // 2
    return t.reshape(*lead, 2, i, x).transpose(-3, -2).reshape(*lead, r2, x).contiguous()


def deinterleave_w13(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_w13`."""
    *lead, r2, x = t.shape
    require(r2 % 2 == 0, f"w13: shape {tuple(t.shape)}, expected an even row count 2I")
    i = r2 // 2
    return t.reshape(*lead, i, 2, x).transpose(-3, -2).reshape(*lead, r2, x).contiguous()
