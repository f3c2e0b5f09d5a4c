"""The SM100 kernel contracts as torch statements, on exactly the buffers the launchers pass the
kernels (`cutedsl.sm100.gemm`). Runs on a CPU and never imports `cutlass`: the host-side tests
replace the kernels with these (tests/conftest.py `emulated_device`), and the GPU tests compare
the kernels against them.

- `expected_quant`: what `Sm100Nvfp4QuantKernel` (`gemm.quantize_act`) writes.
- `emulate_gemm`: what `Sm100Nvfp4GemmKernel` (`gemm.gemm`) writes, batched or grouped, with or
  without the fused clamped SwiGLU.
"""

from __future__ import annotations

import torch

from cutedsl import formats
from cutedsl.sm100.layout import TILE_M


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
    Batched (offs None): L = out.shape[2], L_b = L, rows >= M_c untouched. Grouped: L = 1,
    offs (E,) segment ends, L_b = E, rows past offs[-1] untouched.
    """
    m_c, _, lc = out.shape
    kb = k // 16
    m_sf = formats.round_up(m_a, TILE_M)
    l_b = alpha.shape[0]
    n = b.shape[0] // l_b
    a_f = formats.dequantize_nvfp4(
        a.reshape(-1, m_a, k // 2),
        formats.unswizzle_scales(a_sf, a_sf.shape[0], k).reshape(-1, m_sf, kb)[:, :m_a],
        1.0,
        torch.float32,
    )
    b_f = formats.dequantize_nvfp4(
        b.reshape(l_b, n, k // 2),
        torch.stack([formats.unswizzle_scales(s, n, k) for s in b_sf.reshape(l_b, n, kb)]),
        1.0,
        torch.float32,
    )
    if offs is None:
        acc = torch.einsum("lmk,lnk->lmn", a_f[:, :m_c], b_f) * alpha[:, None, None]
        segs = [(lidx, 0, m_c, lidx) for lidx in range(lc)]
    else:
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        acc = torch.empty((1, m_a, n), dtype=torch.float32, device=a.device)
        for ex, (s, en) in enumerate(zip(starts, ends)):
            acc[0, s:en] = (a_f[0, s:en] @ b_f[ex].T) * alpha[ex]
        segs = [(0, s, en, 0) for s, en in zip(starts, ends)]
    if swiglu_limit is not None:
        lim = swiglu_limit
        g = acc[..., 0::2].clamp(max=lim)
        u = acc[..., 1::2].clamp(min=-lim, max=lim)
        acc = torch.nn.functional.silu(g) * u
    for lidx, s, en, li in segs:
        out[s:en, :, li] = acc[lidx, s:en].to(out.dtype)
