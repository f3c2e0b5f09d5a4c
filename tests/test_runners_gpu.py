"""Runners on the sm90 backend inside captured CUDA graphs (H100/H200).

Warm up, capture one call on static buffers, write fresh data into the same buffers, replay, and
compare with the torch reference on the same quantized operands; no compile after warm-up.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import quantized

from cutedsl import reference

pytestmark = pytest.mark.sm90

LIMIT = 10.0


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = (got.float() - want.float()).abs().max().item()
    tol = 1e-2 * want.abs().max().item() + 1e-3  # bf16 output rounding; fp32 accumulation order
    assert err <= tol, f"max abs err {err:.4g} > {tol:.4g}"


def _graph_check(run, make_inputs, ref, max_tokens: int, runner) -> None:
    from cutedsl import sm90

    runner.warmup(max_tokens)
    keys = len(sm90.cache_keys())
    static = make_inputs()
    out = run(*static)  # eager once on the static buffers (also loads the modules)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(*static)
    for _ in range(2):
        fresh = make_inputs()
        for s, f in zip(static, fresh):
            s.copy_(f)
        if isinstance(out, torch.Tensor):
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out if isinstance(out, torch.Tensor) else static[-1], ref(*static))
    assert len(sm90.cache_keys()) == keys, "a kernel was compiled after warm-up"


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1536, 4096), (16, 4096, 8192), (129, 1024, 512)])
def test_linear_graph(m: int, n: int, k: int) -> None:
    from cutedsl.linear import Nvfp4Linear

    wq = quantized(n, k, device="cuda")
    lin = Nvfp4Linear(*wq, backend="sm90")

    def inputs():
        return (torch.randn(m, k, device="cuda").to(torch.bfloat16),)

    _graph_check(lin, inputs, lambda x: reference.nvfp4_linear_ref(x, *wq), m, lin)


@pytest.mark.parametrize("t", [1, 33])
def test_grouped_oproj_graph(t: int) -> None:
    from cutedsl.grouped_oproj import Nvfp4GroupedOproj

    g, r, nh, hd = 8, 1024, 64, 512
    wq = quantized(g * r, nh * hd // g, scale=0.05, device="cuda")
    op = Nvfp4GroupedOproj(*wq, n_groups=g, backend="sm90")
    theta = torch.rand(4096, 32, device="cuda") * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], -1)

    def inputs():
        return (
            torch.randn(t, nh, hd, device="cuda").to(torch.bfloat16),
            torch.randint(0, 4096, (t,), device="cuda"),
        )

    def ref(o, pos):
        x = reference.inverse_rope_ref(o, pos, cache).view(t, g, -1)
        return reference.nvfp4_grouped_oproj_ref(x, *wq)

    _graph_check(lambda o, pos: op(o, pos, cache), inputs, ref, t, op)


def test_shared_mlp_graph() -> None:
    from cutedsl.shared_mlp import Nvfp4SharedMlp

    h, i, m = 4096, 2048, 8
    w13 = quantized(2 * i, h, scale=0.05, device="cuda")
    w2 = quantized(h, i, scale=0.05, device="cuda")
    mlp = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")

    def inputs():
        return ((torch.randn(m, h, device="cuda") * 4).to(torch.bfloat16),)

    _graph_check(mlp, inputs, lambda x: reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT), m, mlp)


@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe_graph(case: str) -> None:
    from cutedsl.moe import Nvfp4MoE

    e, h, i, m, k = 16, 1024, 256, 24, 6
    w13 = quantized(e, 2 * i, h, scale=0.1, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    moe = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")

    def inputs():
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)]).int()
        if case == "one_expert":
            ids[:, 0], ids[:, 1:] = 3, -1
        elif case == "not_local":
            ids[::2, 2:] = -1
        w = torch.rand(m, k, device="cuda")
        out = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        return ((torch.randn(m, h, device="cuda") * 2).to(torch.bfloat16), ids, w, out)

    def ref(x, ids, w, out):
        return reference.nvfp4_moe_ref(x, ids, w, *w13, *w2, LIMIT)

    _graph_check(lambda *a: moe(*a), inputs, ref, m, moe)
