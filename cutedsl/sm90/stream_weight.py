"""NVFP4 weights laid out for the SM90 streaming decode GEMM (`cutedsl.sm90.kernels.stream`).

Legend: N out features, K in features (logical), L weight groups (G o-proj groups, E experts, 1 for
a dense linear), KP = K / 128 (K pairs: two 64-wide K tiles), B = N / 64 (64-row blocks).

The stream layout is a pure permutation of the 32-bit words of the sm90 encoding
(`cutedsl.sm90.weight`: its bit layout of the e2m1 codes inside each word, its e5m3 scale codes and
its decode are kept as they are), arranged so that the weight is one byte stream that a CTA copies
in large contiguous pieces and each thread reads its WGMMA A fragment with 128-bit loads:

  blob uint8 [L, KP, B, CHUNK], CHUNK = 4608 bytes = the 64 rows x 128 K of block b at K pair j:
    bytes [2048 kt, 2048 kt + 2048), kt = 0, 1 (K tile 2 j + kt): 128 records of 16 bytes, record
      t (the warpgroup thread t = 32 warp + lane that owns the fragment) = the 4 code words
      (row0, q 0), (row0, q 1), (row0 + 8, q 0), (row0 + 8, q 1) of the sm90 word (lane % 4, q) of
      that K tile, row0 = 16 warp + lane / 4 (the PTX wgmma A-fragment rows of the thread);
    bytes [4096, 4608): 32 records of 16 bytes, record s = 8 warp + lane / 4 (the 4 threads of a
      quad share it) = the e5m3 scale words (K tile 2 j, row0), (2 j, row0 + 8), (2 j + 1, row0),
      (2 j + 1, row0 + 8).
  gs float32 [L]: the global scale (weight_scale_2), applied in the epilogue.

Blocks b of one K pair are adjacent, so R = 64 W consecutive rows (W warpgroups) at one K pair are
one contiguous piece of W * CHUNK bytes, whatever W a launch takes.

`prepare_stream_weight` builds it once at load time from the checkpoint's NVFP4 tensors (the
intermediate sm90 encoding is dropped: the stream copy is the only one kept); `to_stream` /
`from_stream` are the permutation and its inverse between the two sm90 layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cutedsl.sm90.weight import Weight, decode_emulated, prepare_weight

KPAIR = 128  # K per unit of the stream (two 64-wide K tiles)
CHUNK = 4608  # bytes of one (64-row block, K pair): 2 x 2048 code bytes + 512 scale bytes
CODE_BYTES = 2048  # one K tile's code records (128 threads x 16 bytes)


@dataclass(frozen=True)
class StreamWeight:
    """NVFP4 weight in the stream layout (module docstring).

    blob: uint8 [L, K/128, N/64, 4608], contiguous
    gs:   float32 [L]
    """

    blob: torch.Tensor
    gs: torch.Tensor
    n: int
    k: int
    groups: int


def prepare_stream_weight(
    b_packed: torch.Tensor,  # [N, K//2] | [L, N, K//2] | [L*N, K//2] with groups=L; uint8
    b_sf: torch.Tensor,  # same leading shape, [.., N, K//16] float8_e4m3fn, linear
    b_gs: torch.Tensor | float,  # fp32 0-dim or [L]
    groups: int | None = None,
) -> StreamWeight:
    """The checkpoint's NVFP4 weight in the stream layout (once, at load). Requires K % 128 == 0
    and N % 64 == 0; errors as `cutedsl.sm90.weight.prepare_weight`."""
    wp = prepare_weight(b_packed, b_sf, b_gs, groups)
    if wp.k % KPAIR:
        raise ValueError(f"weight: K={wp.k} must be a multiple of {KPAIR} for the stream layout")
    sw = to_stream(wp)
    del wp  # only the stream copy stays alive
    return sw


def _row0() -> torch.Tensor:
    """int64 [128]: the first A-fragment row of warpgroup thread t (16 warp + lane / 4)."""
    t = torch.arange(128)
    return 16 * (t // 32) + (t % 32) // 4


def to_stream(wp: Weight) -> StreamWeight:
    """The sm90 encoding (`Weight`) -> the stream layout: a permutation of its 32-bit words."""
    L, N, KH = wp.w.shape
    K = 2 * KH
    if K % KPAIR or N % 64:
        raise ValueError(f"weight: N={N} must be a multiple of 64 and K={K} of {KPAIR}")
    KP, B = K // KPAIR, N // 64
    dev = wp.w.device
    # code words: [L, N, K/64, c, q] int32 (little-endian bytes of the uint8 rows)
    words = wp.w.contiguous().view(torch.int32).reshape(L, N, 2 * KP, 4, 2)
    t = torch.arange(128, device=dev)
    row0 = _row0().to(dev)
    rows = row0[:, None] + 8 * torch.tensor([0, 0, 1, 1], device=dev)[None, :]  # [t, word]
    qs = torch.tensor([0, 1, 0, 1], device=dev)[None, :].expand(128, 4)
    lane_c = (t % 4)[:, None].expand(128, 4)
    b = torch.arange(B, device=dev)
    n_idx = (64 * b[:, None, None] + rows[None]).reshape(-1)  # [B*128*4]
    # [L, N, K/64, 4, 2] -> [L, K/64, B, 128, 4]
    by_tile = words.permute(0, 2, 1, 3, 4)  # [L, K/64, N, c, q]
    codes = by_tile[:, :, n_idx, lane_c.repeat(B, 1).reshape(-1), qs.repeat(B, 1).reshape(-1)]
    codes = codes.reshape(L, KP, 2, B, 128, 4).permute(0, 1, 3, 2, 4, 5)  # [L, KP, B, kt, t, 4]
    # scale words: sf [L, K/64, N] -> [L, KP, B, slot 32, (kt, rr)]
    s = torch.arange(32, device=dev)
    srow = 16 * (s // 8) + s % 8  # row0 of the quads of record s
    srows = (64 * b[:, None, None] + srow[None, :, None] + 8 * torch.arange(2, device=dev)).reshape(
        -1
    )  # [B*32*2]
    sc = wp.sf[:, :, srows].reshape(L, KP, 2, B, 32, 2).permute(0, 1, 3, 4, 2, 5)
    blob = torch.cat(
        (codes.reshape(L, KP, B, 2 * 128 * 4), sc.reshape(L, KP, B, 32 * 4)), dim=-1
    ).contiguous()
    return StreamWeight(
        blob=blob.view(torch.uint8).reshape(L, KP, B, CHUNK),
        gs=wp.gs,
        n=N,
        k=K,
        groups=L,
    )


def from_stream(sw: StreamWeight) -> Weight:
    """The inverse of `to_stream`: the sm90 encoding back from the stream layout."""
    L, KP, B, _ = sw.blob.shape
    N, K = 64 * B, KPAIR * KP
    dev = sw.blob.device
    words = sw.blob.contiguous().view(torch.int32).reshape(L, KP, B, CHUNK // 4)
    codes = words[..., : 2 * 128 * 4].reshape(L, KP, B, 2, 128, 4)
    sc = words[..., 2 * 128 * 4 :].reshape(L, KP, B, 32, 2, 2)  # [.., slot, kt, rr]
    t = torch.arange(128, device=dev)
    row0 = _row0().to(dev)
    w = torch.empty(L, N, 2 * KP, 4, 2, dtype=torch.int32, device=dev)  # [.., n, K/64, c, q]
    for i, (rr, q) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        for kt in range(2):
            rows = (64 * torch.arange(B, device=dev)[:, None] + row0 + 8 * rr).reshape(-1)
            # [L, KP, B, 128] -> rows (b, t), tiles 2 KP + kt, lane t % 4
            vals = codes[:, :, :, kt, :, i].permute(0, 2, 3, 1).reshape(L, B * 128, KP)
            w[:, rows[:, None], (2 * torch.arange(KP, device=dev) + kt)[None, :],
              (t % 4).repeat(B)[:, None], q] = vals  # fmt: skip
    sf = torch.empty(L, 2 * KP, N, dtype=torch.int32, device=dev)
    s = torch.arange(32, device=dev)
    srow = 16 * (s // 8) + s % 8
    for kt in range(2):
        for rr in range(2):
            rows = (64 * torch.arange(B, device=dev)[:, None] + srow + 8 * rr).reshape(-1)
            vals = sc[:, :, :, :, kt, rr].reshape(L, KP, B * 32)
            sf[:, 2 * torch.arange(KP, device=dev)[:, None] + kt, rows[None, :]] = vals
    wb = w.reshape(L, N, 2 * KP * 8).view(torch.uint8).reshape(L, N, K // 2)
    return Weight(w=wb.contiguous(), sf=sf.contiguous(), gs=sw.gs, n=N, k=K, groups=L)


def dequantize_stream(sw: StreamWeight) -> torch.Tensor:
    """fp32 [L, N, K] = e2m1 x block scale x global scale of the stream weight, through the host
    model of the kernel's register decode (`cutedsl.sm90.weight.decode_emulated`)."""
    return decode_emulated(from_stream(sw)) * sw.gs[:, None, None]
