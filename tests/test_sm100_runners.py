"""The sm100 backend glue of each runner (weight prep, w13 interleave, alphas, input scales) on
the CPU, with the two kernels replaced by their torch statements (`emulated_device`), against the
W4A4 torch reference. The kernels themselves are only compiled here (no Blackwell GPU).

Each impl is warmed up first (compiles stubbed); its workspace buffers are then poisoned with
0xFF bytes (NaN for bf16/fp32) and each call runs with `Workspace.reserve` forbidden (a hot-path
reservation would be an allocation), at two sizes, on fresh data; one row more than warmed up
raises the workspace's clear error."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, bf16, fresh_gen, quantized
from nvfp4_data import no_reserve as _no_reserve
from nvfp4_data import warm_and_poison as _warm

from cutedsl import formats, reference, workspace
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp
from cutedsl.sm100 import gemm as launchers
from cutedsl.sm100 import layout
from cutedsl.sm100 import runners as sm100_runners
from cutedsl.workspace import Workspace, WorkspaceError

LIMIT = 10.0


@pytest.fixture
def warm(emulated_device, monkeypatch: pytest.MonkeyPatch):
    """The emulated kernels, fresh shared workspaces, no compile; returns `_warm`."""
    monkeypatch.setattr(workspace, "_SHARED", {})
    monkeypatch.setattr(launchers, "precompile", lambda limit=None: None)
    return _warm


def _in_scale(x: torch.Tensor) -> torch.Tensor:
    return formats.global_scale_from_amax(x.float().abs().amax())


def _check_requantized(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two GEMMs with an NVFP4 re-quantized intermediate: the kernel quantizes the bf16 SwiGLU
    output, the reference the fp32 one, so single codes may flip at rounding boundaries; compare
    with DeepGEMM's calc_diff (1 - 2Σxy/Σ(x²+y²), float64), as STYLE.md prescribes for this case."""
    assert torch.isfinite(got).all()
    x, y = got.double(), want.double()
    diff = 1 - 2 * (x * y).sum() / (x * x + y * y).sum()
    assert diff < 2e-3, float(diff)


@pytest.mark.parametrize("m", [1, 130])
def test_linear(warm, monkeypatch, m: int) -> None:
    g = fresh_gen()
    x = bf16(m, 512, gen=g)
    wq, xs = quantized(256, 512, gen=g), _in_scale(x)
    r = Nvfp4Linear(*wq, input_scale=xs, backend="reference")
    impl = sm100_runners.Linear(r)
    warm(impl, 130)
    for xx in (x, bf16(m + 3, 512, gen=g)):
        with _no_reserve(monkeypatch):
            got = impl(xx)
        assert_close_to_ref(got, reference.nvfp4_linear_ref(xx, *wq, act="nvfp4", input_scale=xs))
    with pytest.raises(WorkspaceError, match=r"linear/q: needs .* reserved; Runner.warmup"):
        impl(bf16(257, 512, gen=g))  # 130 rows pad to 256; 257 do not fit


def test_grouped_oproj(warm, monkeypatch) -> None:
    g = fresh_gen()
    t, grp, d, rr = 9, 2, 256, 128
    x = bf16(t, grp, d, gen=g)
    wq, xs = quantized(grp * rr, d, gen=g), _in_scale(x)
    r = Nvfp4GroupedOproj(*wq, input_scale=xs, n_groups=grp, backend="reference")
    impl = sm100_runners.GroupedOproj(r)
    warm(impl, 128)
    for xx in (x, bf16(128, grp, d, gen=g)):
        with _no_reserve(monkeypatch):
            got = impl(xx)
        want = reference.nvfp4_grouped_oproj_ref(xx, *wq, act="nvfp4", input_scale=xs)
        assert_close_to_ref(got, want)
    with pytest.raises(WorkspaceError, match=r"main/q: needs .* reserved"):
        impl(bf16(129, grp, d, gen=g))


def test_shared_mlp(warm, monkeypatch) -> None:
    g = fresh_gen()
    h, i, m = 256, 256, 5
    x = bf16(m, h, gen=g, scale=3.0)
    w13, w2 = quantized(2 * i, h, gen=g), quantized(h, i, gen=g, scale=0.3)
    a13, a2 = _in_scale(x), torch.tensor(12.0 / 2688)
    r = Nvfp4SharedMlp(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend="reference")
    impl = sm100_runners.SharedMlp(r)
    warm(impl, 8)
    assert set(workspace._SHARED) == {(torch.device("cpu"), "shared")}  # not "main"
    for xx in (x, bf16(8, h, gen=g, scale=3.0)):
        with _no_reserve(monkeypatch):
            got = impl(xx)
        _check_requantized(
            got, reference.nvfp4_shared_mlp_ref(xx, *w13, *w2, LIMIT, "nvfp4", a13, a2)
        )
    with pytest.raises(WorkspaceError, match=r"shared/h: needs .* reserved"):
        impl(bf16(9, h, gen=g))


def test_moe_uses_max_input_scale(warm, monkeypatch) -> None:
    g = fresh_gen()
    e, h, i, m, k = 3, 256, 256, 10, 2
    x = bf16(m, h, gen=g, scale=2.0)
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.3), quantized(e, h, i, gen=g, scale=0.2)
    a13 = torch.full((e,), float(_in_scale(x))) * torch.tensor([0.5, 1.0, 0.25])
    a2 = torch.full((e,), 6.0 / 2688)
    r = Nvfp4MoE(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend="reference")
    impl = sm100_runners.MoE(r)
    monkeypatch.setattr(layout, "COMBINE_CHUNK", 7)  # several combine chunks
    warm(impl, m)
    for mm in (m, 4):
        xx = x[:mm] if mm == m else bf16(mm, h, gen=g, scale=2.0)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(mm)]).int()
        ids[0, 1] = -1
        tw = torch.rand(mm, k, generator=g)
        out = torch.full((mm, h), float("nan"), dtype=torch.bfloat16)
        with _no_reserve(monkeypatch):
            impl(xx, ids, tw, out)
        want = reference.nvfp4_moe_ref(xx, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.max(), a2.max())
        _check_requantized(out, want)
    # The per-expert a13 differ by 4x: using each expert's own scale instead of the max must show.
    wrong = reference.nvfp4_moe_ref(xx, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.min(), a2.max())
    x_, y_ = out.double(), wrong.double()
    assert 1 - 2 * (x_ * y_).sum() / (x_ * x_ + y_ * y_).sum() > 2e-3
    mm = m + 1
    with pytest.raises(WorkspaceError, match=r"main/combine\.acc: needs .* reserved"):
        impl(bf16(mm, h, gen=g), torch.zeros(mm, k, dtype=torch.int32), torch.rand(mm, k),
             torch.empty(mm, h, dtype=torch.bfloat16))  # fmt: skip


def test_moe_layout_gather_combine_into_workspace() -> None:
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
    r = Nvfp4Linear(*quantized(256, 512, gen=fresh_gen()), backend="reference")
    with pytest.raises(ValueError, match="input_scale: the sm100 .* needs the static input scale"):
        sm100_runners.Linear(r)
