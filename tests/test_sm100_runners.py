"""The public runners on the `sm100-emulated` backend, on the CPU: the sm100 backend's own code
(weight prep, w13 interleave, blocked scales, alphas, input scales, o-proj and MoE layouts,
workspaces, launcher checks) with only the two kernel launches replaced by their torch
statements (`cutedsl.sm100.emulate.EMULATED`), against the independent W4A4 torch reference
(`cutedsl.reference`, act="nvfp4") on fresh random data. The kernels themselves are only
compiled here (no Blackwell GPU); tests/test_sm100_emulated_gpu.py runs the same path on a GPU
inside CUDA graphs.

Each runner is warmed up first; its workspace buffers are then poisoned with 0xFF bytes (NaN for
bf16/fp32), and each call goes through the runner's torch.library op with `Workspace.reserve`
forbidden (a hot-path reservation would be an allocation), at two sizes; every output element
must be finite (written). One row more than warmed up raises the workspace's clear error."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, bf16, fresh_gen, quantized, workspaces
from nvfp4_data import no_reserve as _no_reserve

from cutedsl import formats, reference, workspace
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp
from cutedsl.sm100 import emulate, layout, runners
from cutedsl.sm100 import gemm as launchers
from cutedsl.sm100.weight import prepare_weight
from cutedsl.workspace import Workspace, WorkspaceError

LIMIT = 10.0
EMU = "sm100-emulated"


@pytest.fixture(autouse=True)
def _fresh_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workspace, "_SHARED", {})


def _warm(runner, max_tokens: int) -> None:
    """runner.warmup(max_tokens), then 0xFF (NaN) into every workspace byte it may read."""
    runner.warmup(max_tokens)
    wss = workspaces(runner._impl)
    assert wss and any(ws._bufs for ws in wss), "warm-up reserved nothing"
    for ws in wss:
        for b in ws._bufs.values():
            b.fill_(0xFF)


def _in_scale(x: torch.Tensor) -> torch.Tensor:
    return formats.global_scale_from_amax(x.float().abs().amax())


def _check_requantized(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two GEMMs with an NVFP4 re-quantized intermediate: the kernel quantizes the bf16 SwiGLU
    output, the reference the fp32 one, so single codes may flip at rounding boundaries; compare
    with DeepGEMM's calc_diff (1 - 2Σxy/Σ(x²+y²), float64), as STYLE.md prescribes for this case."""
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    x, y = got.double(), want.double()
    diff = 1 - 2 * (x * y).sum() / (x * x + y * y).sum()
    assert diff < 2e-3, float(diff)


def test_the_impls_are_the_sm100_classes_with_emulated_kernels() -> None:
    g = fresh_gen()
    lin = Nvfp4Linear(*quantized(256, 512, gen=g), input_scale=0.01, backend=EMU)
    assert lin.backend == EMU and type(lin._impl) is runners.EmulatedLinear
    assert isinstance(lin._impl, runners.Linear) and lin._impl.kernels is emulate.EMULATED
    assert lin.weight is None  # prepared copies only, as on sm100
    assert runners.Linear.kernels is launchers.CUTEDSL


@pytest.mark.parametrize("m", [1, 130])
def test_linear(monkeypatch, m: int) -> None:
    g = fresh_gen()
    x = bf16(m, 512, gen=g)
    wq, xs = quantized(256, 512, gen=g), _in_scale(x)
    lin = Nvfp4Linear(*wq, input_scale=xs, backend=EMU)
    _warm(lin, 130)
    for xx in (x, bf16(m + 3, 512, gen=g)):
        with _no_reserve(monkeypatch):
            got = lin(xx)
        assert_close_to_ref(got, reference.nvfp4_linear_ref(xx, *wq, act="nvfp4", input_scale=xs))
    with pytest.raises(WorkspaceError, match=r"linear/q: needs .* reserved; Runner.warmup"):
        lin(bf16(257, 512, gen=g))  # 130 rows pad to 256; 257 do not fit


def test_linear_and_shared_mlp_quantize_column_slices_in_place(monkeypatch) -> None:
    """A column slice of a wider tensor reaches the activation quantizer as it is (its row
    stride; no copy) and gives the bits of its contiguous copy; a transposed input is copied."""
    g = fresh_gen()
    k, m = 256, 5
    wq = quantized(256, k, gen=g)
    w13, w2 = quantized(2 * 256, k, gen=g), quantized(k, 256, gen=g, scale=0.3)
    wide = bf16(m, k + 64, gen=g, scale=3.0)
    x = wide[:, 32 : 32 + k]
    xs = _in_scale(x)
    lin = Nvfp4Linear(*wq, input_scale=xs, backend=EMU)
    mlp = Nvfp4SharedMlp(*w13, xs, *w2, torch.tensor(12.0 / 2688), swiglu_limit=LIMIT, backend=EMU)
    _warm(lin, 8)
    _warm(mlp, 8)
    seen = []
    quant = emulate.EMULATED.quant
    monkeypatch.setattr(
        emulate.EMULATED, "quant", lambda x3, *rest: (seen.append(x3), quant(x3, *rest))[1]
    )
    for run in (lin, mlp):
        got = run(x)
        assert seen[-1 if run is lin else -2].data_ptr() == x.data_ptr()
        assert torch.equal(got, run(x.contiguous()))
        xt = x.contiguous().T.contiguous().T  # same values, column-major
        assert torch.equal(run(xt), got)
        assert seen[-1 if run is lin else -2].data_ptr() != xt.data_ptr()


@pytest.mark.parametrize("t", [9, 128])
def test_grouped_oproj(monkeypatch, t: int) -> None:
    """o (T, NH, hd) -> inverse RoPE into the "main" workspace -> quant reads (T, G, D) in place
    -> the GEMM writes (T, G, R) through the strided view."""
    g = fresh_gen()
    grp, nh, hd, rr = 2, 4, 128, 128  # D = NH*hd/G = 256
    d = nh * hd // grp
    wq = quantized(grp * rr, d, gen=g)
    theta = torch.rand(300, 32, generator=g) * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    o = bf16(t, nh, hd, gen=g)
    xs = _in_scale(o)
    op = Nvfp4GroupedOproj(*wq, input_scale=xs, n_groups=grp, head_dim=hd, backend=EMU)
    _warm(op, 128)
    for oo in (o, bf16(5, nh, hd, gen=g)):
        pos = torch.randint(0, 300, (oo.shape[0],), generator=g)
        with _no_reserve(monkeypatch):
            got = op(oo, pos, cache)
        x = reference.inverse_rope_ref(oo, pos, cache).view(oo.shape[0], grp, d)
        want = reference.nvfp4_grouped_oproj_ref(x, *wq, act="nvfp4", input_scale=xs)
        assert_close_to_ref(got, want)
    with pytest.raises(WorkspaceError, match=r"main/rope\.x: needs .* reserved"):
        op(bf16(129, nh, hd, gen=g), torch.zeros(129, dtype=torch.int64), cache)


def test_shared_mlp(monkeypatch) -> None:
    g = fresh_gen()
    h, i, m = 256, 256, 5
    x = bf16(m, h, gen=g, scale=3.0)
    w13, w2 = quantized(2 * i, h, gen=g), quantized(h, i, gen=g, scale=0.3)
    a13, a2 = _in_scale(x), torch.tensor(12.0 / 2688)
    mlp = Nvfp4SharedMlp(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend=EMU)
    _warm(mlp, 8)
    assert set(workspace._SHARED) == {(torch.device("cpu"), "shared")}  # not "main"
    for xx in (x, bf16(8, h, gen=g, scale=3.0)):
        with _no_reserve(monkeypatch):
            got = mlp(xx)
        want = reference.nvfp4_shared_mlp_ref(xx, *w13, *w2, LIMIT, "nvfp4", a13, a2)
        _check_requantized(got, want)
    with pytest.raises(WorkspaceError, match=r"shared/h: needs .* reserved"):
        mlp(bf16(9, h, gen=g))


@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe(monkeypatch, case: str) -> None:
    """Per-expert input scales that differ 4x: the runner quantizes with their max (as vLLM
    keeps one); using the min instead must show. An expert gets no token in every case."""
    g = fresh_gen()
    e, h, i, m, k = 4, 256, 256, 10, 2
    x = bf16(m, h, gen=g, scale=2.0)
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.3), quantized(e, h, i, gen=g, scale=0.2)
    a13 = torch.full((e,), float(_in_scale(x))) * torch.tensor([0.5, 1.0, 0.25, 0.5])
    a2 = torch.full((e,), 6.0 / 2688)
    moe = Nvfp4MoE(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend=EMU)
    monkeypatch.setattr(layout, "COMBINE_CHUNK", 7)  # several combine chunks
    _warm(moe, m)
    for mm in (m, 4):
        xx = x if mm == m else bf16(mm, h, gen=g, scale=2.0)
        ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(mm)]).int()
        if case == "one_expert":
            ids[:, 0], ids[:, 1] = 2, -1
        elif case == "not_local":
            ids[::2, 1] = -1
        tw = torch.rand(mm, k, generator=g)
        out = torch.full((mm, h), float("nan"), dtype=torch.bfloat16)
        with _no_reserve(monkeypatch):
            moe(xx, ids, tw, out)
        want = reference.nvfp4_moe_ref(xx, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.max(), a2.max())
        _check_requantized(out, want)
    wrong = reference.nvfp4_moe_ref(xx, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.min(), a2.max())
    x_, y_ = out.double(), wrong.double()
    assert 1 - 2 * (x_ * y_).sum() / (x_ * x_ + y_ * y_).sum() > 2e-3
    mm = m + 1
    with pytest.raises(WorkspaceError, match=r"main/combine\.acc: needs .* reserved"):
        moe(bf16(mm, h, gen=g), torch.zeros(mm, k, dtype=torch.int32), torch.rand(mm, k),
            torch.empty(mm, h, dtype=torch.bfloat16))  # fmt: skip


def test_ops_compile_fullgraph_match_eager() -> None:
    """torch.compile(fullgraph=True) over the four emulated runners' ops (shape-only fakes with
    the sm100 shapes) gives the eager results bit for bit."""
    g = fresh_gen()
    h, i, e = 256, 256, 3
    lin = Nvfp4Linear(*quantized(128, h, gen=g), input_scale=0.01, backend=EMU)
    op = Nvfp4GroupedOproj(
        *quantized(2 * 128, 256, gen=g), input_scale=0.01, n_groups=2, head_dim=128, backend=EMU
    )
    mlp = Nvfp4SharedMlp(
        *quantized(2 * i, h, gen=g), 0.01, *quantized(h, i, gen=g), 0.01, backend=EMU
    )
    moe = Nvfp4MoE(
        *quantized(e, 2 * i, h, gen=g), torch.full((e,), 0.01),
        *quantized(e, h, i, gen=g), torch.full((e,), 0.01), backend=EMU,
    )  # fmt: skip
    for r in (lin, op, mlp, moe):
        r.warmup(17)
    cache = torch.randn(64, 64, generator=g)

    def block(x, o, pos, ids, tw):
        out = torch.empty_like(x)
        moe(x, ids, tw, out)
        z = op(o, pos, cache)
        return lin(x).float().sum(-1) + z.float().sum((1, 2)) + mlp(x).float().sum(-1) + out.sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=True)
    for m in (3, 17):
        args = (bf16(m, h, gen=g), bf16(m, 4, 128, gen=g), torch.randint(0, 64, (m,), generator=g),
                torch.randint(0, e, (m, 2), generator=g).int(), torch.rand(m, 2, generator=g))  # fmt: skip
        torch.testing.assert_close(compiled(*args), block(*args), rtol=0, atol=0)


# --------------------------------------------------------------------------- the kernel statements


def _grouped_case(g: torch.Generator, e: int, n: int, k: int, counts: list[int]):
    """A grouped A of per-expert segments padded to 128 rows, its offs, and the operands."""
    rows = sum(formats.round_up(c, 128) for c in counts) + 128  # one tile past offs[-1]
    x = bf16(rows, k, gen=g)
    gs = _in_scale(x).reshape(1)
    q, sf = emulate.expected_quant(x, gs, rows)
    wp, ws_, _ = quantized(e, n, k, gen=g)
    w = prepare_weight(wp, ws_)
    ends = torch.tensor(counts).add(127).div(128, rounding_mode="floor").mul(128).cumsum(0)
    return x, gs, q, sf, w, ends.to(torch.int32), wp, ws_


def test_emulated_grouped_gemm_tiles_and_untouched_rows() -> None:
    """The sync-free grouped statement against a per-expert host loop written here: each
    128-row tile belongs to #{e : offs[e] <= its first row} (an empty expert owns none), rows
    past offs[-1] are never written (they keep their NaN poison), alpha is per expert."""
    g = fresh_gen()
    e, n, k = 4, 128, 256
    counts = [130, 0, 5, 128]
    x, gs, q, sf, w, offs, wp, ws_ = _grouped_case(g, e, n, k, counts)
    alpha = torch.rand(e, generator=g) + 0.5
    out = torch.full((q.shape[0], n), float("nan"), dtype=torch.bfloat16)
    emulate.emulate_gemm(q, sf, w.w, w.sf, alpha, out[:, :, None], m_a=q.shape[0], k=k, offs=offs)
    used = int(offs[-1])
    assert torch.isnan(out[used:].float()).all()
    xq = formats.dequantize_nvfp4(*formats.quantize_nvfp4(x.float(), gs.reshape(()))[:2], 1.0)
    start = 0
    for ex in range(e):
        end = int(offs[ex])
        wd = formats.dequantize_nvfp4(wp[ex], ws_[ex], 1.0, torch.float32)
        want = alpha[ex] * (xq[start:end].float() @ wd.T)
        torch.testing.assert_close(out[start:end].float(), want, rtol=2**-7, atol=1e-3)
        start = end


def test_launchers_refuse_what_the_kernels_would_misread() -> None:
    """The kernels address every operand with compact strides from its pointer, read one alpha
    per batch group, write a grouped output as one group and read one input scale; the launchers
    refuse anything else before either launch (the emulation's reshape would silently copy a
    strided operand and compute what the kernel would not)."""
    g = fresh_gen()
    k, n, run = 256, 128, emulate.EMULATED
    x = bf16(200, k, gen=g)
    q = torch.zeros(256, k // 2, dtype=torch.uint8)
    sf = torch.zeros(256, k // 16, dtype=torch.uint8)
    w = prepare_weight(*quantized(2 * n, k, gen=g)[:2])
    one, two = torch.ones(1), torch.ones(2)
    out = torch.zeros(200, 2, n, dtype=torch.bfloat16)
    launchers.quantize_act(x, one, 256, q, sf, kernels=run)  # well-formed calls run
    launchers.gemm(q, sf, w.w[:n], w.sf[:n], one, out[:, 0, :, None], m_a=256, k=k, kernels=run)
    with pytest.raises(ValueError, match=r"b: .* strides \(1, 128\), expected a contiguous"):
        b_strided = w.w[:n].T.contiguous().T
        launchers.gemm(q, sf, b_strided, w.sf[:n], one, out[:, 0, :, None], m_a=256, k=k)
    with pytest.raises(ValueError, match=r"a_sf: .* expected .* shape \(256, 16\)"):
        launchers.gemm(q, sf[:128], w.w[:n], w.sf[:n], one, out[:, 0, :, None], m_a=256, k=k)
    with pytest.raises(ValueError, match=r"alpha: 1 values, expected one per output group \(2\)"):
        launchers.gemm(q, sf, w.w, w.sf, one, layout.oproj_out_view(out[:100]), m_a=128, k=k)
    with pytest.raises(ValueError, match=r"out: 2 groups, a grouped GEMM writes one"):
        offs = torch.tensor([128, 256], dtype=torch.int32)
        launchers.gemm(q, sf, w.w, w.sf, two, out.permute(0, 2, 1), m_a=256, k=k, offs=offs)
    with pytest.raises(ValueError, match=r"gs: .* expected one fp32"):
        launchers.quantize_act(x, two, 256, q, sf, kernels=run)
    with pytest.raises(ValueError, match=r"q: .* expected a contiguous"):
        launchers.quantize_act(x, one, 256, torch.zeros(256, 256, dtype=torch.uint8)[:, :128], sf)


def test_layout_helpers_into_workspace() -> None:
    """The workspace forms of the MoE layout helpers equal their allocating forms (poisoned
    workspace, fresh routing with non-local entries)."""
    g = fresh_gen()
    m, topk, e, hid = 37, 3, 4, 64
    ids = torch.randint(-1, e, (m, topk), generator=g).int()
    x, tw = bf16(m, hid, gen=g), torch.rand(m, topk, generator=g)
    rows = layout.moe_max_rows(m, topk, e)
    ws = Workspace("cpu", "t")
    launchers.moe_reserve(ws, m, topk, e, hid, 32)
    for b in ws._bufs.values():
        b.fill_(0xFF)
    offs, dest = layout.moe_layout(ids, e, ws)
    offs0, dest0 = layout.moe_layout(ids, e)
    assert torch.equal(offs, offs0) and torch.equal(dest, dest0)
    a = layout.moe_gather(x, dest, topk, rows, ws, out=ws.get("a", (rows, hid), torch.bfloat16))
    assert torch.equal(a, layout.moe_gather(x, dest0, topk, rows))
    # independent statement of the combine: Σ_s w[m, s] · y[dest[m, s]] over local slots
    y = bf16(rows, hid, gen=g)
    d = dest0.view(m, topk)
    want = torch.zeros(m, hid)
    for s in range(topk):
        ok = d[:, s] >= 0
        want[ok] += tw[ok, s, None] * y[d[ok, s]].float()
    got = layout.moe_combine(y, dest, tw, ws)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)


def test_missing_input_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="input_scale: the sm100 .* needs the static input scale"):
        Nvfp4Linear(*quantized(256, 512, gen=fresh_gen()), backend=EMU)
