"""The SM100 kernel contracts as torch statements, on exactly the buffers the launchers pass the
kernels (`cutedsl.sm100.gemm`). Pure torch, any device (CPU or any CUDA GPU); never imports
`cutlass`.

- `expected_quant`: what `Sm100Nvfp4QuantKernel` (`gemm.quantize_act`) writes.
- `emulate_gemm`: what `Sm100Nvfp4GemmKernel` (`gemm.gemm`) writes, batched or grouped, with or
  without the fused clamped SwiGLU: rows, groups and alpha as the kernel addresses them (A group
  l at rows l*M_a, blocked scales per group, alpha per batch group or per expert; in grouped mode
  the expert of each 128-row tile is #{e : offs[e] <= first row of the tile}, and tiles past
  offs[E-1] store nothing).
- `EMULATED`: a `cutedsl.sm100.gemm.Kernels` that runs these two in place of the kernel launches,
  writing the launchers' own output buffers; it is the `sm100-emulated` backend
  (`cutedsl.backends`): the sm100 host code end to end, with only the launches replaced.

CUDA graphs: device ops only, shapes from the arguments' shapes: no host sync (no .tolist(),
.item(), boolean-mask indexing or data-dependent shape), no CPU tensor and no host-to-device
copy (the e2m1 codes are decoded arithmetically, not through a host table). The statements keep
their temporaries (dequantized operands, fp32 accumulators: what the kernels hold in registers,
shared memory and TMEM) in the caching allocator; under capture, in the graph's private pool.
Math: operands dequantized exactly (e2m1 x e4m3 is exact in fp32, and in TF32), fp32 products
and sums, alpha and the SwiGLU in fp32, one rounding to the output dtype: the kernel's math up to
the order of the fp32 sums.
"""

from __future__ import annotations

import torch

from cutedsl import formats
from cutedsl.sm100.layout import TILE_M

# Expert weights (fp32 bytes) one grouped statement dequantizes at a time: per-tile weight
# gathers run in chunks of at most this many bytes.
GATHER_BYTES = 256 << 20


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits: s e e m) -> fp32 values, arithmetically (no lookup table)."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where((c & 8) != 0, -mag, mag)


def _dequant(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """packed uint8 (..., R, K//2) and linear e4m3 scales (..., R, K//16) -> fp32 (..., R, K)."""
    *lead, r, kh = packed.shape
    vals = _e2m1(formats.unpack_e2m1(packed)).reshape(*lead, r, kh // 8, formats.BLOCK)
    return (vals * sf.view(torch.float8_e4m3fn).to(torch.float32)[..., None]).reshape(
        *lead, r, 2 * kh
    )


def _linear_scales(blocked: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Blocked e4m3 bytes of a (rows, K//16) matrix (rows % 128 == 0) -> linear (rows, K//16)."""
    kb = k // formats.BLOCK
    return formats.unswizzle_scales(blocked.reshape(rows, kb).view(torch.float8_e4m3fn), rows, k)


def _epilogue(acc: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """alpha * acc already applied; the fused clamped SwiGLU on interleaved (gate, up) columns."""
    if swiglu_limit is None:
        return acc
    g = acc[..., 0::2].clamp(max=swiglu_limit)
    u = acc[..., 1::2].clamp(min=-swiglu_limit, max=swiglu_limit)
    return torch.nn.functional.silu(g) * u


def expected_quant(
    x: torch.Tensor, gs: torch.Tensor, padded_t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `quantize_act` writes for x (T, G, D) (or (T, D): G = 1): (codes uint8
    (G*padded_T, D//2), blocked scales e4m3 (G*padded_T, D//16)), from `cutedsl.formats`."""
    if x.ndim == 2:
        x = x[:, None]
    t, g, d = x.shape
    q, sf, _ = formats.quantize_nvfp4(x.permute(1, 0, 2).float(), gs.reshape(()))
    q_out = torch.zeros((g, padded_t, d // 2), dtype=torch.uint8, device=x.device)
    q_out[:, :t] = q
    return q_out.reshape(g * padded_t, d // 2), formats.assemble_group_scales(sf, padded_t)


def emulate_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor,
    *,
    m_a: int,
    k: int,
    offs: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
) -> None:
    """Torch statement of `Sm100Nvfp4GemmKernel` on the very buffers `gemm.gemm` passes it.

    a: uint8 (L*M_a, K//2); a_sf: blocked e4m3 (L*pad128(M_a), K//16); b: uint8 (L_b*N, K//2);
    b_sf: blocked e4m3 (L_b*N, K//16); alpha fp32 (L_b,); out: bf16 (M_c, N_out, L) view.
    Batched (offs None): L = out.shape[2], L_b = L; rows >= M_c untouched, A rows past M_a read
    as zeros. Grouped: L = 1, offs int32 (E,) segment ends (multiples of 128), L_b = E; rows of
    the tiles past offs[-1] (and rows >= M_c) untouched.
    """
    m_c, _, lc = out.shape
    l_b = alpha.shape[0]
    n = b.shape[0] // l_b
    l_a = 1 if offs is not None else lc
    m_sf = formats.round_up(m_a, TILE_M)
    tiles = -(-max(m_a, m_c) // TILE_M)
    a_sf_lin = _linear_scales(a_sf, l_a * m_sf, k).reshape(l_a, m_sf, -1)[:, :m_a]
    a_f = _dequant(a.reshape(l_a, m_a, k // 2), a_sf_lin)
    a_f = torch.nn.functional.pad(a_f, (0, 0, 0, tiles * TILE_M - m_a))  # TMA zero fill
    b_q = b.reshape(l_b, n, k // 2)
    b_sf_lin = _linear_scales(b_sf, l_b * n, k).reshape(l_b, n, -1)
    if offs is None:
        acc = torch.bmm(a_f[:, :m_c], _dequant(b_q, b_sf_lin).transpose(1, 2))
        y = _epilogue(acc * alpha[:, None, None], swiglu_limit)  # (L, M_c, N_out)
        out.copy_(y.permute(1, 2, 0))
        return
    row0 = torch.arange(tiles, dtype=torch.int32, device=a.device) * TILE_M
    expert = torch.searchsorted(offs, row0, right=True)  # #{e : offs[e] <= row0}, per tile
    valid = expert < l_b
    expert = expert.clamp(max=l_b - 1)
    a_t = a_f.view(tiles, TILE_M, k)
    chunk = max(1, GATHER_BYTES // (n * k * 4))
    for t0 in range(0, tiles, chunk):
        r0, r1 = t0 * TILE_M, min((t0 + chunk) * TILE_M, m_c)
        if r0 >= r1:
            break
        ex = expert[t0 : t0 + chunk]
        w = _dequant(b_q.index_select(0, ex), b_sf_lin.index_select(0, ex))  # (c, N, K)
        acc = torch.bmm(a_t[t0 : t0 + chunk], w.transpose(1, 2))
        y = _epilogue(acc * alpha.index_select(0, ex)[:, None, None], swiglu_limit)
        keep = valid[t0 : t0 + chunk, None].expand(-1, TILE_M).reshape(-1, 1)[: r1 - r0]
        dst = out[r0:r1, :, 0]
        dst.copy_(torch.where(keep, y.reshape(-1, y.shape[-1])[: r1 - r0].to(out.dtype), dst))


class _EmulatedKernels:
    """`cutedsl.sm100.gemm.Kernels` whose launches are the torch statements above, writing the
    launchers' q / sf / out buffers in place."""

    name = "emulated"

    def precompile(self, swiglu_limit: float | None) -> None:
        pass  # nothing to compile

    def quant(
        self, x3: torch.Tensor, gs: torch.Tensor, padded_t: int, q: torch.Tensor, sf: torch.Tensor
    ) -> None:
        eq, esf = expected_quant(x3, gs, padded_t)
        q.copy_(eq)
        sf.copy_(esf.view(sf.dtype))

    def gemm(
        self,
        a: torch.Tensor,
        a_sf: torch.Tensor,
        b: torch.Tensor,
        b_sf: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        *,
        m_a: int,
        k: int,
        offs: torch.Tensor | None,
        swiglu_limit: float | None,
    ) -> None:
        emulate_gemm(
            a, a_sf, b, b_sf, alpha, out, m_a=m_a, k=k, offs=offs, swiglu_limit=swiglu_limit
        )


EMULATED = _EmulatedKernels()
