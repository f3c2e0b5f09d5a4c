"""The SM100 host path on any CUDA GPU: the public runners on the `sm100-emulated` backend (the
sm100 backend's own code, each CuTeDSL kernel launch replaced by its torch statement,
`cutedsl.sm100.emulate.EMULATED`) eagerly and inside captured CUDA graphs.

Each test warms the runner up, poisons its workspaces with NaN, runs it once eagerly with CUDA
sync debugging set to "error" (a host synchronization in the hot path raises), captures one call
on static buffers, then twice writes fresh random data into those buffers, NaN-fills the output,
replays, and compares every element with the W4A4 torch reference (`cutedsl.reference`,
act="nvfp4"). Sizes follow the tiny DSv4 checkpoint (H 2048, 16 experts, wo_a 2 x 128 rows,
wq_b K 256).
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, quantized, workspaces

from cutedsl import formats, reference

pytestmark = pytest.mark.gpu

LIMIT = 10.0
EMU = "sm100-emulated"


@pytest.fixture(autouse=True)
def _fresh_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty shared workspaces per test: a buffer an earlier test's graph captured may not grow."""
    from cutedsl import workspace

    monkeypatch.setattr(workspace, "_SHARED", {})


def _bf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def _scale(amax: float) -> torch.Tensor:
    """A static input_scale (dequant multiplier) for activations up to `amax`."""
    return formats.global_scale_from_amax(torch.tensor(amax, device="cuda"))


def _calc_diff_ok(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two GEMMs with a re-quantized intermediate (bf16 vs fp32 before its NVFP4 rounding):
    DeepGEMM's calc_diff in float64."""
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    x, y = got.double(), want.double()
    diff = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
    assert diff < 2e-3, diff


def _graph_check(runner, run, make_inputs, ref, check, max_tokens: int) -> None:
    runner.warmup(max_tokens)
    for ws in workspaces(runner._impl):
        for b in ws._bufs.values():
            b.fill_(0xFF)
    static = make_inputs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(*static)  # eager, on the static buffers
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(out if isinstance(out, torch.Tensor) else static[-1], ref(*static))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(*static)
    for _ in range(2):
        for s, f in zip(static, make_inputs()):
            s.copy_(f)
        (out if isinstance(out, torch.Tensor) else static[-1]).fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out if isinstance(out, torch.Tensor) else static[-1], ref(*static))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 768, 2048), (7, 8192, 256), (130, 2048, 256)])
def test_linear_graph(m: int, n: int, k: int) -> None:
    from cutedsl.linear import Nvfp4Linear

    wq, xs = quantized(n, k, device="cuda"), _scale(4.0)
    lin = Nvfp4Linear(*wq, input_scale=xs, backend=EMU)
    assert lin.backend == EMU

    def ref(x):
        return reference.nvfp4_linear_ref(x, *wq, act="nvfp4", input_scale=xs)

    _graph_check(lin, lin, lambda: (_bf(m, k),), ref, assert_close_to_ref, m)


@pytest.mark.parametrize("t", [1, 33])
def test_grouped_oproj_graph(t: int) -> None:
    from cutedsl.grouped_oproj import Nvfp4GroupedOproj

    g, r, nh, hd = 2, 128, 16, 512
    d = nh * hd // g
    wq, xs = quantized(g * r, d, scale=0.05, device="cuda"), _scale(4.0)
    op = Nvfp4GroupedOproj(*wq, input_scale=xs, n_groups=g, head_dim=hd, backend=EMU)
    theta = torch.rand(4096, 32, device="cuda") * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], -1)

    def inputs():
        return _bf(t, nh, hd), torch.randint(0, 4096, (t,), device="cuda")

    def ref(o, pos):
        x = reference.inverse_rope_ref(o, pos, cache).view(t, g, d)
        return reference.nvfp4_grouped_oproj_ref(x, *wq, act="nvfp4", input_scale=xs)

    _graph_check(op, lambda o, pos: op(o, pos, cache), inputs, ref, assert_close_to_ref, t)


def test_shared_mlp_graph() -> None:
    from cutedsl.shared_mlp import Nvfp4SharedMlp

    h, i, m = 2048, 256, 8
    w13 = quantized(2 * i, h, scale=0.05, device="cuda")
    w2 = quantized(h, i, scale=0.05, device="cuda")
    a13, a2 = _scale(16.0), _scale(8.0)
    mlp = Nvfp4SharedMlp(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend=EMU)

    def ref(x):
        return reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT, "nvfp4", a13, a2)

    _graph_check(mlp, mlp, lambda: (_bf(m, h, scale=4.0),), ref, _calc_diff_ok, m)


@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe_graph(case: str) -> None:
    from cutedsl.moe import Nvfp4MoE

    e, h, i, m, k = 16, 2048, 256, 24, 6
    w13 = quantized(e, 2 * i, h, scale=0.1, device="cuda")
    w2 = quantized(e, h, i, scale=0.1, device="cuda")
    a13, a2 = _scale(8.0).expand(e), _scale(4.0).expand(e)
    moe = Nvfp4MoE(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend=EMU)

    def inputs():
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)]).int()
        if case == "one_expert":
            ids[:, 0], ids[:, 1:] = 3, -1
        elif case == "not_local":
            ids[::2, 2:] = -1
        w = torch.rand(m, k, device="cuda")
        out = torch.full((m, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        return _bf(m, h, scale=2.0), ids, w, out

    def ref(x, ids, w, out):
        return reference.nvfp4_moe_ref(x, ids, w, *w13, *w2, LIMIT, "nvfp4", a13[0], a2[0])

    _graph_check(moe, lambda *a: moe(*a), inputs, ref, _calc_diff_ok, m)


def test_emulated_statements_equal_on_gpu_and_cpu() -> None:
    """The grouped GEMM statement (tile -> expert by a device search of offs) gives the CPU's
    result on the GPU, for a routing with an empty expert and rows past offs[-1] (left NaN)."""
    from cutedsl.sm100 import emulate, layout
    from cutedsl.sm100.weight import prepare_weight

    e, n, k, m, topk = 6, 256, 512, 37, 2
    wp, wsf, _ = quantized(e, n, k, device="cuda")
    w = prepare_weight(wp, wsf)
    ids = torch.stack([torch.randperm(e - 1, device="cuda")[:topk] for _ in range(m)]).int()
    rows = layout.moe_max_rows(m, topk, e)
    offs, dest = layout.moe_layout(ids, e)
    a = layout.moe_gather(_bf(m, k), dest, topk, rows)
    q, sf = emulate.expected_quant(a, _scale(4.0).reshape(1), rows)
    alpha = torch.rand(e, device="cuda") + 0.5
    outs = []
    for dev in ("cuda", "cpu"):
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=dev)
        args = [t.to(dev) for t in (q, sf, w.w, w.sf, alpha)]
        emulate.emulate_gemm(*args, out[:, :, None], m_a=rows, k=k, offs=offs.to(dev))
        outs.append(out.cpu())
    used = int(offs[-1])
    assert torch.isnan(outs[0][used:].float()).all()
    assert torch.isfinite(outs[0][:used].float()).all()
    torch.testing.assert_close(outs[0][:used], outs[1][:used], rtol=2**-7, atol=1e-3)
