"""The sm90 backend glue of each runner (weight prep, group/expert layouts, routing, clamp,
combine) on the CPU, with the kernel launch replaced by a torch statement of its contract on the
exact buffers the launchers pass, against the W4A16 torch references. The kernels themselves run
in tests/test_gemm_sm90.py and tests/test_runners_gpu.py on an SM90 GPU."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, bf16, fresh_gen, quantized

from cutedsl import formats, reference, sm90, sm90_runners
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp

LIMIT = 10.0


@pytest.fixture
def emulated_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sm90._launch` as torch: out3[l] = a3[l] · dequant(wp[l])ᵀ (dense / groups), or per expert
    rows [offs[e], offs[e+1]) of a3[0] (MoE); rows outside the experts are left untouched."""

    def launch(a3, wp, out3, offs, tactic):
        sf = wp.sf.transpose(1, 2).view(torch.float8_e4m3fn)  # back to [L, N, K/16]
        w = formats.dequantize_nvfp4(wp.w, sf, 1.0, torch.float32) * wp.gs[:, None, None]
        if offs is None:
            out3.copy_(torch.einsum("lmk,lnk->lmn", a3.float(), w))
            return
        o = offs.tolist()
        for e in range(wp.groups):
            s, t = o[e], o[e + 1]
            out3[0, s:t] = (a3[0, s:t].float() @ w[e].T).to(out3.dtype)

    monkeypatch.setattr(sm90, "_launch", launch)


def test_linear(emulated_launch) -> None:
    g = fresh_gen()
    wq, x = quantized(128, 256, gen=g), bf16(9, 256, gen=g)
    r = Nvfp4Linear(*wq, backend="reference")
    assert_close_to_ref(sm90_runners.linear_impl(r)(x), reference.nvfp4_linear_ref(x, *wq))


def test_grouped_oproj(emulated_launch) -> None:
    g = fresh_gen()
    t, grp, d, rr = 5, 4, 128, 64
    wq, x = quantized(grp * rr, d, gen=g), bf16(t, grp, d, gen=g)
    r = Nvfp4GroupedOproj(*wq, n_groups=grp, backend="reference")
    assert_close_to_ref(
        sm90_runners.grouped_oproj_impl(r)(x), reference.nvfp4_grouped_oproj_ref(x, *wq)
    )


def test_shared_mlp(emulated_launch) -> None:
    g = fresh_gen()
    h, i, m = 128, 64, 6
    w13, w2, x = (
        quantized(2 * i, h, gen=g),
        quantized(h, i, gen=g, scale=0.3),
        bf16(m, h, gen=g, scale=3.0),
    )
    r = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    want = reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT)
    assert_close_to_ref(sm90_runners.shared_mlp_impl(r)(x), want)


@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe(emulated_launch, case: str) -> None:
    g = fresh_gen()
    e, h, i, m, k = 5, 128, 64, 11, 3
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.5), quantized(e, h, i, gen=g, scale=0.3)
    x = bf16(m, h, gen=g, scale=2.0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    if case == "one_expert":
        ids[:, 0], ids[:, 1:] = 4, -1
    elif case == "not_local":
        ids[::2, 1:] = -1
    tw = torch.rand(m, k, generator=g)
    r = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    sm90_runners.moe_impl(r)(x, ids, tw, out)
    assert_close_to_ref(out, reference.nvfp4_moe_ref(x, ids, tw, *w13, *w2, LIMIT))
