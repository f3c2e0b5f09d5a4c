"""The clamped SwiGLU between the MLP GEMMs: `cutedsl.sm90.swiglu.swiglu_clamp` (the CuTeDSL kernel
of `cutedsl.sm90.kernels.swiglu`, any CUDA arch) against an independent float64 statement of DSv4's
activation, and against the fp32 torch statement it replaces (`swiglu_clamp_bf16`); the input
checks on the CPU."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import fresh_gen

from cutedsl.sm90 import swiglu as R

LIMIT = 10.0


def reference64(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) in float64 (gate | up halves of h)."""
    i = h.shape[1] // 2
    g, u = h[:, :i].double(), h[:, i:].double()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(g) * u


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 spacing (both bf16)."""
    e = torch.frexp(b.float().abs().clamp_min(2.0**-126)).exponent
    spacing = torch.ldexp(torch.ones_like(b, dtype=torch.float32), e - 8)
    return (a.float() - b.float()).abs() / spacing


def test_rejects_bad_operands() -> None:
    h = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        R.swiglu_clamp(h.float(), LIMIT, torch.zeros(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out \[M, I\]"):
        R.swiglu_clamp(h, LIMIT, torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        R.swiglu_clamp(h, LIMIT, torch.zeros(16, 4, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="I % 8"):
        R.swiglu_clamp(torch.zeros(4, 24, dtype=torch.bfloat16), LIMIT,
                       torch.zeros(4, 12, dtype=torch.bfloat16))  # fmt: skip


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("limit", [LIMIT, None], ids=["limit", "nolimit"])
@pytest.mark.parametrize(("m", "i"), [(1, 8), (3, 256), (384, 2048), (1000, 3072), (4099, 128)])
def test_kernel_matches_the_activation(m: int, i: int, limit: float | None) -> None:
    g = fresh_gen()
    # Wide enough that the clamps bite (|x| > 10) and silu's tails are exercised.
    h = (torch.randn(m, 2 * i, generator=g) * 6).to(torch.bfloat16).cuda()
    out = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    R.swiglu_clamp(h, limit, out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "an output element was not written"
    ref = reference64(h.cpu(), limit)
    ulp = _bf16_ulps(out.cpu(), ref.to(torch.bfloat16))
    assert ulp.max() <= 1, f"max {ulp.max():.1f} bf16 ulp from the float64 activation"
    # The fp32 torch statement the kernel replaces, on the same GPU: at most one ulp apart.
    want = R.swiglu_clamp_bf16(h, limit)
    diff = _bf16_ulps(out, want)
    assert diff.max() <= 1, f"max {diff.max():.1f} ulp from the torch statement"
    same = (out == want).float().mean().item()
    assert same >= 0.99, f"only {same:.4f} of the values equal the torch statement"


@gpu
def test_kernel_captures_and_allocates_nothing() -> None:
    g = fresh_gen()
    m, i = 64, 512
    h = (torch.randn(m, 2 * i, generator=g) * 4).to(torch.bfloat16).cuda()
    out = torch.empty(m, i, dtype=torch.bfloat16, device="cuda")
    R.swiglu_clamp(h, LIMIT, out)  # compile + load
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    R.swiglu_clamp(h, LIMIT, out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        R.swiglu_clamp(h, LIMIT, out)
    h.copy_((torch.randn(m, 2 * i, generator=g) * 4).to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ulp = _bf16_ulps(out.cpu(), reference64(h.cpu(), LIMIT).to(torch.bfloat16))
    assert ulp.max() <= 1
