"""The sm100 backend glue of each runner (weight prep, w13 interleave, alphas, input scales) on
the CPU, with the two kernels replaced by their torch statements (`emulated_device`), against the
W4A4 torch reference. The kernels themselves are only compiled here (no Blackwell GPU)."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, bf16, fresh_gen, quantized

from cutedsl import formats, reference, sm100_runners
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp

LIMIT = 10.0


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
def test_linear(emulated_device, m: int) -> None:
    g = fresh_gen()
    x = bf16(m, 512, gen=g)
    wq, xs = quantized(256, 512, gen=g), _in_scale(x)
    r = Nvfp4Linear(*wq, input_scale=xs, backend="reference")
    got = sm100_runners.linear_impl(r)(x)
    assert_close_to_ref(got, reference.nvfp4_linear_ref(x, *wq, act="nvfp4", input_scale=xs))


def test_grouped_oproj(emulated_device) -> None:
    g = fresh_gen()
    t, grp, d, rr = 9, 2, 256, 128
    x = bf16(t, grp, d, gen=g)
    wq, xs = quantized(grp * rr, d, gen=g), _in_scale(x)
    r = Nvfp4GroupedOproj(*wq, input_scale=xs, n_groups=grp, backend="reference")
    got = sm100_runners.grouped_oproj_impl(r)(x)
    assert_close_to_ref(got, reference.nvfp4_grouped_oproj_ref(x, *wq, act="nvfp4", input_scale=xs))


def test_shared_mlp(emulated_device) -> None:
    g = fresh_gen()
    h, i, m = 256, 256, 5
    x = bf16(m, h, gen=g, scale=3.0)
    w13, w2 = quantized(2 * i, h, gen=g), quantized(h, i, gen=g, scale=0.3)
    a13, a2 = _in_scale(x), torch.tensor(12.0 / 2688)
    r = Nvfp4SharedMlp(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend="reference")
    got = sm100_runners.shared_mlp_impl(r)(x)
    want = reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT, "nvfp4", a13, a2)
    _check_requantized(got, want)


def test_moe_uses_max_input_scale(emulated_device) -> None:
    g = fresh_gen()
    e, h, i, m, k = 3, 256, 256, 10, 2
    x = bf16(m, h, gen=g, scale=2.0)
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.3), quantized(e, h, i, gen=g, scale=0.2)
    a13 = torch.full((e,), float(_in_scale(x))) * torch.tensor([0.5, 1.0, 0.25])
    a2 = torch.full((e,), 6.0 / 2688)
    r = Nvfp4MoE(*w13, a13, *w2, a2, swiglu_limit=LIMIT, backend="reference")
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    ids[0, 1] = -1
    tw = torch.rand(m, k, generator=g)
    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    sm100_runners.moe_impl(r)(x, ids, tw, out)
    want = reference.nvfp4_moe_ref(x, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.max(), a2.max())
    _check_requantized(out, want)
    # The per-expert a13 differ by 4x: using each expert's own scale instead of the max must show.
    wrong = reference.nvfp4_moe_ref(x, ids, tw, *w13, *w2, LIMIT, "nvfp4", a13.min(), a2.max())
    x_, y_ = out.double(), wrong.double()
    assert 1 - 2 * (x_ * y_).sum() / (x_ * x_ + y_ * y_).sum() > 2e-3


def test_missing_input_scale_is_refused() -> None:
    r = Nvfp4Linear(*quantized(256, 512, gen=fresh_gen()), backend="reference")
    with pytest.raises(ValueError, match="input_scale: the sm100 .* needs the static input scale"):
        sm100_runners.linear_impl(r)
