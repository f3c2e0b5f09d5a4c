"""Runners on the reference backend (CPU): results vs float64 math written here, independently of
cutedsl.reference; the custom ops under torch.compile(fullgraph=True) and opcheck; M = 0; errors;
backend selection."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import bf16, fresh_gen, quantized

from cutedsl import formats, ops
from cutedsl.backends import BackendUnavailableError, select_backend
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp

LIMIT = 10.0


def _deq64(packed, sf, gs) -> torch.Tensor:
    return formats.dequantize_nvfp4(packed, sf, gs, torch.float32).double()


def _clamped_swiglu64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.fixture
def gen() -> torch.Generator:
    return fresh_gen()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 output vs float64: only the bf16 rounding of the result differs (inputs are exact)."""
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


# --- results -----------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 7, 129])
def test_linear_matches_float64(m: int, gen: torch.Generator) -> None:
    n, k = 96, 256
    wq = quantized(n, k, gen=gen)
    lin = Nvfp4Linear(*wq, input_scale=torch.tensor(0.01), backend="reference")
    x = bf16(m, k, gen=gen)
    _close(lin(x), x.double() @ _deq64(*wq).T)


@pytest.mark.parametrize("t", [1, 5])
def test_grouped_oproj_matches_float64(t: int, gen: torch.Generator) -> None:
    g, r, nh, hd = 2, 32, 4, 64  # D = NH·hd/G = 128
    d = nh * hd // g
    wq = quantized(g * r, d, gen=gen)
    op = Nvfp4GroupedOproj(*wq, n_groups=g, backend="reference")
    o = bf16(t, nh, hd, gen=gen)
    pos = torch.randint(0, 100, (t,), generator=gen)
    theta = torch.rand(100, 32, generator=gen, dtype=torch.float64) * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], dim=-1).float()
    # inverse rotation of interleaved pairs, in float64, then round to bf16 (the runner rotates in BF16)
    x = o.double().clone()
    c, s = cache[pos].double()[:, None, :32], cache[pos].double()[:, None, 32:]
    ev, od = x[..., -64::2].clone(), x[..., -63::2].clone()
    x[..., -64::2], x[..., -63::2] = ev * c + od * s, od * c - ev * s
    x = x.to(torch.bfloat16).double().view(t, g, d)
    w = _deq64(*wq).view(g, r, d)
    want = torch.stack([x[:, j] @ w[j].T for j in range(g)], dim=1)
    got = op(o, pos, cache)
    assert got.shape == (t, g, r)
    _close(got, want)


def test_shared_mlp_matches_float64(gen: torch.Generator) -> None:
    h, i, m = 128, 64, 9
    g13 = formats.global_scale_from_amax(torch.tensor(4.0))  # shared by w1 and w3
    w13 = formats.quantize_nvfp4(torch.randn(2 * i, h, generator=gen), g13)
    w2 = quantized(h, i, gen=gen, scale=0.3)
    mlp = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    x = bf16(m, h, gen=gen, scale=2.0)
    hmid = x.double() @ _deq64(*w13).T
    a = _clamped_swiglu64(hmid[:, :i], hmid[:, i:]).to(torch.bfloat16).double()
    _close(mlp(x), a @ _deq64(*w2).T)
    assert (hmid.abs() > LIMIT).any(), "the data must exercise the clamp"


@pytest.mark.parametrize("case", ["random", "one_expert", "empty_experts", "not_local"])
def test_moe_matches_per_token_loop(case: str, gen: torch.Generator) -> None:
    e, h, i, m, k = 6, 64, 32, 11, 3
    w13 = quantized(e, 2 * i, h, gen=gen)
    w2 = quantized(e, h, i, gen=gen, scale=0.5)
    moe = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    x = bf16(m, h, gen=gen, scale=2.0)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).int()
    if case == "one_expert":
        ids[:, 0], ids[:, 1:] = 2, -1
    elif case == "empty_experts":
        ids = ids % 2  # experts 2..5 get nothing
        ids[:, 1] = 1 - ids[:, 0]
        ids[:, 2] = -1
    elif case == "not_local":
        ids[::2, 1] = -1
    tw = torch.rand(m, k, generator=gen)
    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    moe(x, ids, tw, out)
    w13d = [_deq64(w13[0][j], w13[1][j], w13[2][j]) for j in range(e)]
    w2d = [_deq64(w2[0][j], w2[1][j], w2[2][j]) for j in range(e)]
    want = torch.zeros(m, h, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            ex = int(ids[t, j])
            if ex < 0:
                continue
            hm = x[t].double() @ w13d[ex].T
            a = _clamped_swiglu64(hm[:i], hm[i:]).to(torch.bfloat16).double()
            want[t] += tw[t, j].double() * (a @ w2d[ex].T)
    _close(out, want)


# --- graph / compile ---------------------------------------------------------------------------
def _all_runners(gen: torch.Generator):
    h, i, e = 64, 32, 4
    lin = Nvfp4Linear(*quantized(48, h, gen=gen), backend="reference")
    op = Nvfp4GroupedOproj(*quantized(2 * 32, 64, gen=gen), n_groups=2, backend="reference")
    mlp = Nvfp4SharedMlp(
        *quantized(2 * i, h, gen=gen), None, *quantized(h, i, gen=gen), None, backend="reference"
    )
    moe = Nvfp4MoE(
        *quantized(e, 2 * i, h, gen=gen),
        None,
        *quantized(e, h, i, gen=gen),
        None,
        backend="reference",
    )
    return lin, op, mlp, moe


def _inputs(m: int, gen: torch.Generator):
    cache = torch.randn(64, 64, generator=gen)
    return (
        bf16(m, 64, gen=gen),
        bf16(m, 2, 64, gen=gen),
        torch.randint(0, 64, (m,), generator=gen),
        cache,
        torch.randint(0, 4, (m, 2), generator=gen).int(),
        torch.rand(m, 2, generator=gen),
    )


def test_ops_compile_fullgraph_and_match_eager(gen: torch.Generator) -> None:
    lin, op, mlp, moe = _all_runners(gen)

    def block(x, o, pos, cache, ids, tw):
        y = lin(x)
        z = op(o, pos, cache)
        s = mlp(x)
        out = torch.empty_like(x)
        moe(x, ids, tw, out)
        return y.float().sum(-1) + z.float().sum((-1, -2)) + s.float().sum(-1) + out.float().sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for m in (3, 17):
        args = _inputs(m, gen)
        torch.testing.assert_close(compiled(*args), block(*args), rtol=0, atol=0)


def test_opcheck_fakes_match_real(gen: torch.Generator) -> None:
    """torch.library.opcheck: schema, fake (shape-only) impl vs the real one, dispatch."""
    lin, op, mlp, moe = _all_runners(gen)
    for m in (0, 5):
        x, o, pos, cache, ids, tw = _inputs(m, gen)
        torch.library.opcheck(ops.nvfp4_linear, (x, lin.id))
        torch.library.opcheck(ops.nvfp4_grouped_oproj, (o, pos, cache, op.id))
        torch.library.opcheck(ops.nvfp4_shared_mlp, (x, mlp.id))
        torch.library.opcheck(ops.nvfp4_moe, (x, ids, tw, torch.empty_like(x), moe.id))


def test_m_zero(gen: torch.Generator) -> None:
    lin, op, mlp, moe = _all_runners(gen)
    x, o, pos, cache, ids, tw = _inputs(0, gen)
    assert lin(x).shape == (0, 48)
    assert op(o, pos, cache).shape == (0, 2, 32)
    assert mlp(x).shape == (0, 64)
    moe(x, ids, tw, torch.empty_like(x))


# --- errors ------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors(gen: torch.Generator) -> None:
    wq = quantized(48, 64, gen=gen)
    lin = Nvfp4Linear(*wq, backend="reference")
    with pytest.raises(ValueError, match=r"x: shape \[3, 32\], expected \[\*, 64\]"):
        lin(bf16(3, 32, gen=gen))
    with pytest.raises(ValueError, match=r"x: dtype float32, expected bfloat16"):
        lin(torch.randn(3, 64))
    with pytest.raises(ValueError, match=r"weight_scale: shape \[48, 2\], expected \[48, 4\]"):
        Nvfp4Linear(wq[0], wq[1][:, :2], wq[2])
    with pytest.raises(ValueError, match=r"weight: dtype int8"):
        Nvfp4Linear(wq[0].view(torch.int8), wq[1], wq[2])
    with pytest.raises(ValueError, match="weight: 48 rows, expected a multiple of n_groups=5"):
        Nvfp4GroupedOproj(*wq, n_groups=5)
    with pytest.raises(ValueError, match=r"w2: shape"):
        w13 = quantized(64, 64, gen=gen)
        Nvfp4SharedMlp(*w13, None, *quantized(64, 16, gen=gen), None)
    moe = _all_runners(gen)[3]
    x, _, _, _, ids, tw = _inputs(4, gen)
    with pytest.raises(ValueError, match=r"topk_weights: shape \[4, 1\], expected \[4, 2\]"):
        moe(x, ids, tw[:, :1], torch.empty_like(x))


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUTEDSL_BACKEND", raising=False)
    assert select_backend("cpu") == "reference"
    for forced in ("sm90", "sm100"):
        with pytest.raises(BackendUnavailableError, match=f"'{forced}' needs an SM"):
            select_backend("cpu", forced)
        monkeypatch.setenv("CUTEDSL_BACKEND", forced)
        with pytest.raises(BackendUnavailableError, match="found a CPU tensor"):
            Nvfp4Linear(*formats.quantize_nvfp4(torch.randn(16, 32)))
    monkeypatch.setenv("CUTEDSL_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"\$CUTEDSL_BACKEND='cuda': expected one of"):
        select_backend("cpu")
    monkeypatch.setenv("CUTEDSL_BACKEND", "reference")
    assert select_backend("cpu") == "reference"
    # sm100-emulated runs on any device, and only when named: never the automatic choice.
    assert select_backend("cpu", "sm100-emulated") == "sm100-emulated"
    monkeypatch.setenv("CUTEDSL_BACKEND", "sm100-emulated")
    lin = Nvfp4Linear(*formats.quantize_nvfp4(torch.randn(128, 256)), input_scale=0.01)
    assert lin.backend == "sm100-emulated"
    assert select_backend("cpu", "reference") == "reference"  # backend= wins over the variable
    monkeypatch.delenv("CUTEDSL_BACKEND")
    assert select_backend("cpu") == "reference"


def test_route_groups_assignments_by_expert(gen: torch.Generator) -> None:
    from cutedsl.sm90.routing import route

    e, m, k = 5, 13, 3
    ids = torch.randint(-1, e + 2, (m, k), generator=gen).int()  # e, e+1: not local either
    ids[0] = torch.tensor([4, 4, -1])  # duplicates and non-local in one row
    offs, tok, inv = route(ids, e)
    assert offs.dtype == tok.dtype == inv.dtype == torch.int32 and inv.shape == (k, m)
    local = (ids >= 0) & (ids < e)
    n = int(local.sum())
    rows = [int(inv[s, t]) for t in range(m) for s in range(k) if local[t, s]]
    assert sorted(rows) == list(range(n))  # every local assignment: one row of its own
    assert (inv.T[~local] == -1).all()
    for t in range(m):
        for s in range(k):
            if local[t, s]:
                r = int(inv[s, t])
                assert int(offs[ids[t, s]]) <= r < int(offs[ids[t, s] + 1]) and tok[r] == t
    assert int(offs[0]) == 0 and int(offs[-1]) == n
    assert torch.equal(offs.diff(), torch.bincount(ids[local].long(), minlength=e).int())
    # the non-local rows: the tokens of the non-local assignments, each once
    assert sorted(tok[n:].tolist()) == sorted(torch.nonzero(~local)[:, 0].tolist())


def test_inverse_rope_kernel_launcher_refuses_bad_operands() -> None:
    """The launcher's checks run before any kernel (CPU tensors here): dtype and layout of out,
    equal shapes, unit stride along head_dim (tests/test_rope_kernel_gpu.py runs the kernel)."""
    from cutedsl.grouped_oproj import inverse_rope

    cache = torch.zeros(16, 64)
    o = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="out must be contiguous bfloat16"):
        inverse_rope(torch.empty(2, 4, 512), o, pos, cache)
    with pytest.raises(ValueError, match="expected equal shapes"):
        inverse_rope(torch.empty_like(o), o, pos[:1], cache)
    with pytest.raises(ValueError, match="unit stride along head_dim"):
        inverse_rope(
            torch.empty_like(o), o.transpose(1, 2).contiguous().transpose(1, 2), pos, cache
        )
