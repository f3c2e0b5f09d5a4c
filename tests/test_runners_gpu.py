"""Runners on the sm90 backend inside captured CUDA graphs (H100/H200).

Warm up, capture one call on static buffers, write fresh data into the same buffers, replay, and
compare with the torch reference on the same quantized operands; no compile after warm-up.
After warm-up a call allocates nothing from the caching allocator but its result
(intermediates come from `cutedsl.workspace`; the routed experts nothing at all), more rows than
warmed up are refused, and the routed experts' output is the same bit for bit on every call.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import quantized

from cutedsl import reference

pytestmark = pytest.mark.sm90


@pytest.fixture(autouse=True)
def _fresh_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with empty shared workspaces: a buffer a (dead) graph of an earlier test
    captured may not grow (cutedsl.workspace), and in vLLM every warm-up precedes capture."""
    from cutedsl import workspace

    monkeypatch.setattr(workspace, "_SHARED", {})


LIMIT = 10.0


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = (got.float() - want.float()).abs().max().item()
    tol = 1e-2 * want.abs().max().item() + 1e-3  # bf16 output rounding; fp32 accumulation order
    assert err <= tol, f"max abs err {err:.4g} > {tol:.4g}"


def _graph_check(run, make_inputs, ref, max_tokens: int, runner) -> None:
    from cutedsl import jit

    runner.warmup(max_tokens)
    keys = len(jit.cached_keys())
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
    assert len(jit.cached_keys()) == keys, "a kernel was compiled after warm-up"


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


@pytest.mark.parametrize("fused", ["0", "1"], ids=["swiglu_kernel", "fused_swiglu"])
@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe_graph(case: str, fused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cutedsl.moe import Nvfp4MoE
    from cutedsl.sm90 import runners

    monkeypatch.setenv(runners.FUSED_SWIGLU_ENV, fused)
    e, h, i, m, k = 16, 1024, 256, 24, 6
    w13 = quantized(e, 2 * i, h, scale=0.1, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    moe = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")
    assert moe._impl.fused is (fused == "1")

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


def _bf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def _case(name: str):
    """(runner, max_tokens, make_args, reference, op outputs one call allocates)."""
    from cutedsl.grouped_oproj import Nvfp4GroupedOproj
    from cutedsl.linear import Nvfp4Linear
    from cutedsl.moe import Nvfp4MoE
    from cutedsl.shared_mlp import Nvfp4SharedMlp

    if name == "linear":  # one row: split-K, through the workspace's fp32 buffer
        wq = quantized(1536, 4096, device="cuda")
        run = Nvfp4Linear(*wq, backend="sm90")
        return run, 4, lambda: (_bf(1, 4096),), lambda x: reference.nvfp4_linear_ref(x, *wq), 1
    if name == "grouped_oproj":  # [T, G, D] → [T, G, R]
        g, r, d = 8, 1024, 4096
        wq = quantized(g * r, d, scale=0.05, device="cuda")
        run = Nvfp4GroupedOproj(*wq, n_groups=g, backend="sm90")
        return (
            run,
            8,
            lambda: (_bf(5, g, d),),
            lambda x: reference.nvfp4_grouped_oproj_ref(x, *wq),
            1,
        )
    if name == "shared_mlp":
        h, i = 4096, 2048
        w13 = quantized(2 * i, h, scale=0.05, device="cuda")
        w2 = quantized(h, i, scale=0.05, device="cuda")
        run = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")
        return (run, 8, lambda: (_bf(8, h, scale=4.0),),
                lambda x: reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT), 1)  # fmt: skip
    e, h, i, m, k = 16, 1024, 256, 24, 6
    w13 = quantized(e, 2 * i, h, scale=0.1, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    run = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")

    def args():
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)]).int()
        ids[::2, 4:] = -1  # some non-local assignments
        out = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        return _bf(m, h, scale=2.0), ids, torch.rand(m, k, device="cuda"), out

    def ref(x, ids, w, out):
        return reference.nvfp4_moe_ref(x, ids, w, *w13, *w2, LIMIT)

    return run, 32, args, ref, 0  # writes vLLM's `out`: no output of its own


@pytest.mark.parametrize(
    "name",
    [
        "linear",
        "grouped_oproj",
        "shared_mlp",
        "moe",  # was 1 allocation per call (torch.sort's index arange) before the route kernel
    ],
)
def test_second_call_allocates_only_the_op_outputs(name: str) -> None:
    """After warm-up, a runner's sm90 hot path (`runner._impl`, the backend past the
    input checks) allocates nothing but its result (allocation.all.allocated counts every
    caching-allocator allocation); intermediates, split-K buffers, routing buffers and the MoE
    combine accumulator come from the warm-up workspaces. Fresh data on the second call, and
    its result checked against the reference (NaN-poisoned `out` for the MoE)."""
    runner, max_tokens, make_args, ref, outputs = _case(name)
    runner.warmup(max_tokens)
    runner._impl(*make_args())  # first call: loads the kernel modules
    args = make_args()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    y = runner._impl(*args)
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.synchronize()
    assert after - before <= outputs, f"{after - before} allocations, op outputs {outputs}"
    _assert_close(args[-1] if y is None else y, ref(*args))


@pytest.mark.parametrize("case", ["distinct", "hot_expert"])
def test_moe_is_bitwise_deterministic(case: str) -> None:
    """The routed experts give the same bits on every call (route kernel rows in any order within
    an expert, combine in slot order without atomics): three calls on the same inputs, one
    with `out` not contiguous (the workspace copy), and the result is checked against the
    reference."""
    from cutedsl.moe import Nvfp4MoE

    e, h, i, m, k = 64, 2048, 512, 300, 6
    w13 = quantized(e, 2 * i, h, scale=0.1, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    run = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")
    run.warmup(m)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)]).int()
    if case == "hot_expert":  # one expert gets every token: contended routing cursors
        ids[:, 0] = 7
        ids[:, 1:][ids[:, 1:] == 7] = 8
    ids[::3, 5] = -1
    x, w = _bf(m, h, scale=2.0), torch.rand(m, k, device="cuda")
    outs = [torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    outs.append(torch.full((h, m), float("nan"), device="cuda", dtype=torch.bfloat16).T)
    for out in outs:
        run(x, ids, w, out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    _assert_close(outs[0], reference.nvfp4_moe_ref(x, ids, w, *w13, *w2, LIMIT))


def test_more_rows_than_warmed_up_is_refused() -> None:
    from cutedsl.workspace import WorkspaceError

    runner, max_tokens, make_args, _, _ = _case("moe")
    runner.warmup(max_tokens)
    x, ids, w, out = make_args()
    m = 8 * max_tokens + 1  # more than MAX_TOPK·max_tokens routed rows, or max_tokens tokens
    with pytest.raises(WorkspaceError, match=r"warmup\(max_tokens\)"):
        runner._impl(x.repeat(m, 1)[:m], ids.repeat(m, 1)[:m], w.repeat(m, 1)[:m],
                     out.repeat(m, 1)[:m])  # fmt: skip


def test_moe_fused_swiglu_is_bit_identical_to_the_swiglu_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The routed experts with the SwiGLU fused into the w13 GEMM return the same bits as with
    the separate SwiGLU kernel, at decode and prefill sizes (different tactics)."""
    from cutedsl.moe import Nvfp4MoE
    from cutedsl.sm90 import runners

    e, h, i, k = 16, 1024, 256, 6
    w13 = quantized(e, 2 * i, h, scale=0.3, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    moes = {}
    for fused in ("0", "1"):
        monkeypatch.setenv(runners.FUSED_SWIGLU_ENV, fused)
        moes[fused] = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="sm90")
        moes[fused].warmup(512)
    for m in (1, 4, 77, 512):
        x = (torch.randn(m, h, device="cuda") * 4).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)]).int()
        w = torch.rand(m, k, device="cuda")
        outs = []
        for fused in ("0", "1"):
            out = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
            moes[fused](x, ids, w, out)
            outs.append(out)
        assert torch.isfinite(outs[1]).all(), f"m={m}: unwritten output"
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"m={m}"
