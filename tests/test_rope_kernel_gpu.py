"""The inverse-RoPE CuTeDSL kernel (`cutedsl.kernels.rope`, launched by
`cutedsl.grouped_oproj.inverse_rope`) against its torch statement `inverse_rope_into` and the
float64-checked reference, on an sm90 GPU: every output element written (NaN-poisoned output),
the pass-through dims bit for bit, the rotated dims equal to the torch statement (the same fp32
operations), edge token counts, a head slice of a padded buffer as input, int32 and int64
positions, and a captured CUDA graph replayed on fresh data without a compile."""

from __future__ import annotations

import pytest
import torch

from cutedsl import jit, reference
from cutedsl.grouped_oproj import inverse_rope, inverse_rope_into
from cutedsl.workspace import Workspace

pytestmark = pytest.mark.sm90

NH, HD = 64, 512


def _cache(positions: int = 4096) -> torch.Tensor:
    theta = torch.rand(positions, 32, device="cuda") * 6.28
    return torch.cat([theta.cos(), theta.sin()], -1).contiguous()


def _statement(o: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`inverse_rope_into` (the kernel's torch statement) on the same GPU."""
    t, nh, _ = o.shape
    ws = Workspace(o.device)
    ws.reserve("rope.cs", (t, reference.ROPE_DIM), torch.float32)
    for name in ("rope.e", "rope.o", "rope.y"):
        ws.reserve(name, (t, nh, reference.ROPE_DIM // 2), torch.float32)
    out = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    return inverse_rope_into(out, o, pos, cache, ws)


@pytest.mark.parametrize("t", [1, 3, 64, 300])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_kernel_equals_its_torch_statement(t: int, pos_dtype: torch.dtype) -> None:
    cache = _cache()
    o = (torch.randn(t, NH, HD, device="cuda") * 3).to(torch.bfloat16)
    pos = torch.randint(0, cache.shape[0], (t,), device="cuda", dtype=pos_dtype)
    out = torch.full_like(o, float("nan"))
    inverse_rope(out, o, pos, cache)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "an output element was not written"
    nope = HD - reference.ROPE_DIM
    assert torch.equal(out[..., :nope], o[..., :nope])
    want = _statement(o, pos, cache)
    diff = (out.float() - want.float()).abs()
    assert torch.equal(out, want), f"{int((diff > 0).sum())} elements differ, max {diff.max()}"
    ref = reference.inverse_rope_ref(o, pos, cache)
    assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()


def test_head_slice_of_a_padded_buffer() -> None:
    """wo_a's input is o_padded[:, :n_local_heads]: token stride > NH·HD."""
    t, padded = 5, 128
    cache = _cache()
    buf = (torch.randn(t, padded, HD, device="cuda") * 3).to(torch.bfloat16)
    o = buf[:, :NH]
    assert not o.is_contiguous()
    pos = torch.randint(0, cache.shape[0], (t,), device="cuda")
    out = torch.full((t, NH, HD), float("nan"), dtype=torch.bfloat16, device="cuda")
    inverse_rope(out, o, pos, cache)
    assert torch.equal(out, _statement(o.contiguous(), pos, cache))


def test_graph_replay_on_fresh_data_without_compile() -> None:
    t = 16
    cache = _cache()
    o = torch.zeros(t, NH, HD, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(t, dtype=torch.int64, device="cuda")
    out = torch.empty_like(o)
    inverse_rope(out, o, pos, cache)  # compiles (or loads) here
    compiles = jit.compile_count()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inverse_rope(out, o, pos, cache)
    o.copy_((torch.randn(t, NH, HD, device="cuda") * 3).to(torch.bfloat16))
    pos.copy_(torch.randint(0, cache.shape[0], (t,), device="cuda"))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert jit.compile_count() == compiles
    assert torch.equal(out, _statement(o, pos, cache))
