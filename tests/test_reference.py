"""cutedsl.reference: every *_ref against independent float64 math and vLLM 0.21.0's torch code.

The float64 oracles dequantize by the E2M1 bit fields (not through cutedsl.formats), loop per group
/ per token, and apply the clamp and rotation written out here. The ``test_vllm_*`` functions
compare with vLLM's own ``SiluAndMulWithClamp.forward_native``, DeepseekV4ScalingRotaryEmbedding
(via ``get_rope`` with DSv4's parameters), the ROCm inverse-RoPE reference and the NVFP4
emulation path (``run_nvfp4_emulations``, ``ref_nvfp4_quant_dequant``).
"""

from __future__ import annotations

import types

import pytest
import torch

from cutedsl import formats as F
from cutedsl import reference as R

LIMIT = 10.0


def _rand(shape: tuple[int, ...], seed: int, std: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)


def _weight(shape: tuple[int, ...], seed: int, per_matrix: bool = False):
    """Random bf16 weight [..., N, K] -> NVFP4 (packed, sf, gs); gs per matrix when asked."""
    w = _rand(shape, seed, 0.5)
    gs = F.global_scale_from_amax(w.float().abs().amax(dim=(-2, -1))) if per_matrix else None
    return F.quantize_nvfp4(w, gs)


def _deq64(packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Float64 dequantization from the bit fields: c = low nibble first; (s, e, m) = E2M1."""
    c = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    s, e, m = (c >> 3) & 1, (c >> 1) & 3, (c & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).double()) * (1 + m / 2))
    val = torch.where(s == 1, -mag, mag)
    g = gs.double().reshape(*gs.shape, 1, 1)
    return val * sf.double().repeat_interleave(16, dim=-1) * g


def _qdq64(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return _deq64(*F.quantize_nvfp4_activation(x, input_scale))


def _swiglu64(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1 + torch.exp(-g)) * u


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """fp32 result vs float64 oracle: max-abs error relative to the oracle's magnitude."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert bool(torch.isfinite(got).all())
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"max err {err:.3e} > {rel:.0e} * {scale:.3e}"


@pytest.fixture(scope="module")
def vllm_ops() -> types.SimpleNamespace:
    """vLLM 0.21.0's torch implementations (imported once; `import vllm` takes ~20 s)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMulWithClamp
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse

    # This CPU box has no vLLM platform (device_type ""): RoPE builds its cache on device_type.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "device_type", "cpu")
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            # DeepseekV4Attention's rope (deepseek_v4.py:1013-1035): yarn, mscale disabled, GPT-J
            rope = get_rope(
                512,
                max_position=65536,
                is_neox_style=False,
                rope_parameters={
                    "rope_type": "deepseek_yarn",
                    "factor": 16,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "rope_theta": 160000.0,
                    "mscale": 0,
                    "mscale_all_dim": 0,
                    "is_deepseek_v4": True,
                    "rope_dim": 64,
                },  # fmt: skip
                dtype=torch.bfloat16,
            )
            clamp = SiluAndMulWithClamp(LIMIT)
    return types.SimpleNamespace(
        rope=rope,
        clamp=clamp,
        emu=nvfp4_emulation_utils,
        rocm_inv_rope=rocm_aiter_mla_sparse._apply_gptj_inv_rope_ref,
    )


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("m", [0, 1, 7, 129])
def test_linear_w4a16_matches_float64(m: int) -> None:
    x = _rand((m, 64), m)
    w = _weight((48, 64), 100 + m)
    y = R.nvfp4_linear_ref(x, *w)
    assert y.shape == (m, 48)
    if m:
        _close(y, x.double() @ _deq64(*w).T)


def test_linear_w4a4_matches_float64_on_quantized_activations() -> None:
    x = _rand((33, 96), 1)
    w = _weight((40, 96), 2)
    s = F.global_scale_from_amax(x.float().abs().max())
    y = R.nvfp4_linear_ref(x, *w, act="nvfp4", input_scale=s)
    _close(y, _qdq64(x, s) @ _deq64(*w).T)
    y16 = R.nvfp4_linear_ref(x, *w)  # the activation quantization is really applied ...
    assert (y - y16).abs().max() > 1e-3 * y16.abs().max()
    assert (y - y16).norm() < 0.2 * y16.norm()  # ... within NVFP4 error


def test_vllm_nvfp4_emulation_linear_matches(vllm_ops) -> None:
    """vLLM's W4A4 emulation: ref_nvfp4_quant_dequant(x, 1/input_scale) @ dequantize_to_dtype(W)."""
    x = _rand((21, 128), 3).float()
    wp, wsf, wgs = _weight((72, 128), 4)
    s = F.global_scale_from_amax(x.abs().max()) * 0.75  # static scale: some blocks saturate
    theirs = vllm_ops.emu.run_nvfp4_emulations(
        x, (1.0 / s).float(), wp, F.swizzle_scales(wsf), wgs, swizzle=True
    )
    ours = R.nvfp4_linear_ref(x, wp, wsf, wgs, act="nvfp4", input_scale=s)
    _close(ours, theirs.double(), rel=1e-5)


# --------------------------------------------------------------------------- grouped o-proj


@pytest.mark.parametrize("t", [1, 5])
def test_grouped_oproj_matches_float64_per_group(t: int) -> None:
    g, r, d = 4, 32, 128
    x = _rand((t, g, d), t)
    w = _weight((g * r, d), 10 + t)  # the checkpoint's 2-D wo_a: group g = rows g*R:(g+1)*R
    y = R.nvfp4_grouped_oproj_ref(x, *w)
    assert y.shape == (t, g, r)
    w64 = _deq64(*w)
    want = torch.stack([x[:, i].double() @ w64[i * r : (i + 1) * r].T for i in range(g)], dim=1)
    _close(y, want)


def test_grouped_oproj_w4a4_equals_per_group_linear() -> None:
    t, g, r, d = 6, 2, 48, 64
    x = _rand((t, g, d), 20)
    wp, wsf, wgs = _weight((g * r, d), 21)
    s = F.global_scale_from_amax(x.float().abs().max())
    y = R.nvfp4_grouped_oproj_ref(x, wp, wsf, wgs, act="nvfp4", input_scale=s)
    for i in range(g):
        rows = slice(i * r, (i + 1) * r)
        yi = R.nvfp4_linear_ref(x[:, i], wp[rows], wsf[rows], wgs, act="nvfp4", input_scale=s)
        torch.testing.assert_close(y[:, i], yi, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- inverse RoPE


def _positions(t: int, seed: int, max_pos: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, max_pos, (t,), generator=g)
    p[0] = 0
    return p


def _cache(max_pos: int = 4096) -> torch.Tensor:
    """An fp32 [max_pos, 64] cos‖sin cache with 32 distinct frequencies."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv
    return torch.cat([f.cos(), f.sin()], dim=-1)


def test_inverse_rope_matches_float64() -> None:
    t, h = 9, 3
    x = _rand((t, h, 512), 30)
    pos, cache = _positions(t, 31, 4096), _cache()
    y = R.inverse_rope_ref(x, pos, cache)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y[..., :448], x[..., :448])  # nope dims pass through bit for bit
    cs = cache[pos].double()[:, None]
    cos, sin = cs[..., :32], cs[..., 32:]
    xr = x[..., 448:].double()
    ev, od = xr[..., 0::2], xr[..., 1::2]
    want = torch.empty_like(xr)
    want[..., 0::2] = ev * cos + od * sin  # conjugate rotation of pair (2j, 2j+1) by angle_j
    want[..., 1::2] = od * cos - ev * sin
    torch.testing.assert_close(y[..., 448:].double(), want, rtol=2**-8, atol=1e-6)


def test_vllm_inverse_rope_undoes_vllm_rope(vllm_ops) -> None:
    rope = vllm_ops.rope
    assert rope.rotary_dim == 64 and rope.cos_sin_cache.shape == (65536, 64)
    assert rope.cos_sin_cache.dtype == torch.float32 and not rope.is_neox_style
    t, h = 17, 4
    x = _rand((t, h, 512), 40)
    pos = _positions(t, 41, 65536)
    rotated, _ = rope.forward_native(pos, x.clone(), None)  # vLLM's forward RoPE, bf16 out
    assert (rotated[..., 448:] - x[..., 448:]).abs().max() > 0.5  # it did rotate
    back = R.inverse_rope_ref(rotated, pos, rope.cos_sin_cache)
    assert torch.equal(back[..., :448], x[..., :448])
    tol = 2**-7 * x[..., 448:].float().abs().max().item()  # two bf16 roundings
    torch.testing.assert_close(back.float(), x.float(), rtol=2**-7, atol=tol)


def test_vllm_inverse_rope_bit_exact_with_vllm_inverse(vllm_ops) -> None:
    rope = vllm_ops.rope
    t, h = 11, 8
    x = _rand((t, h, 512), 50)
    pos = _positions(t, 51, 65536)
    ours = R.inverse_rope_ref(x, pos, rope.cos_sin_cache)
    theirs, _ = rope.forward_native(pos, x.clone(), None, inverse=True)
    assert torch.equal(ours, theirs)
    rocm = vllm_ops.rocm_inv_rope(x, pos, rope.cos_sin_cache, 64)
    assert torch.equal(ours, rocm)


# --------------------------------------------------------------------------- SwiGLU clamp


def test_swiglu_clamp_matches_float64() -> None:
    g, u = _rand((50, 64), 60, 8.0), _rand((50, 64), 61, 8.0)
    assert bool((g > LIMIT).any() and (u.abs() > LIMIT).any())  # the clamp is exercised
    y = R.swiglu_clamp_ref(g, u, LIMIT)
    _close(y, _swiglu64(torch.cat([g, u], -1).double(), LIMIT), rel=1e-6)
    y_free = R.swiglu_clamp_ref(g, u, None)
    _close(y_free, _swiglu64(torch.cat([g, u], -1).double(), None), rel=1e-6)
    assert (y - y_free).abs().max() > 1.0


def test_vllm_swiglu_clamp_forward_native(vllm_ops) -> None:
    g, u = _rand((40, 96), 70, 8.0), _rand((40, 96), 71, 8.0)
    theirs = vllm_ops.clamp.forward_native(torch.cat([g, u], -1).float())
    assert torch.equal(R.swiglu_clamp_ref(g, u, LIMIT), theirs)
    theirs_bf16 = vllm_ops.clamp.forward_native(torch.cat([g, u], -1))  # bf16 math in vLLM
    torch.testing.assert_close(R.swiglu_clamp_ref(g, u, LIMIT).bfloat16(), theirs_bf16)


# --------------------------------------------------------------------------- shared MLP


def _mlp64(x, w13, w2, limit, act="bf16", s13=None, s2=None) -> torch.Tensor:
    """Float64 shared-expert oracle; the intermediate is rounded like the kernel's operand."""
    a = x.double() if act == "bf16" else _qdq64(x, s13)
    h = _swiglu64(a @ _deq64(*w13).T, limit)
    h = h.to(torch.bfloat16).double() if act == "bf16" else _qdq64(h.float(), s2)
    return h @ _deq64(*w2).T


def test_shared_mlp_matches_float64() -> None:
    m, hid, i = 13, 64, 48
    x = _rand((m, hid), 80, 4.0)
    w13, w2 = _weight((2 * i, hid), 81), _weight((hid, i), 82)
    h = x.double() @ _deq64(*w13).T
    assert bool((h[:, :i] > LIMIT).any() and (h[:, i:].abs() > LIMIT).any())
    y = R.nvfp4_shared_mlp_ref(x, *w13, *w2, limit=LIMIT)
    _close(y, _mlp64(x, w13, w2, LIMIT), rel=1e-3)  # 1e-3: bf16-rounded intermediate may flip
    no_clamp = R.nvfp4_shared_mlp_ref(x, *w13, *w2, limit=None)
    assert (y - no_clamp).abs().max() > 0.05 * y.abs().max()


def test_shared_mlp_w4a4_matches_float64() -> None:
    m, hid, i = 9, 64, 32
    x = _rand((m, hid), 90, 2.0)
    w13, w2 = _weight((2 * i, hid), 91), _weight((hid, i), 92)
    s13 = F.global_scale_from_amax(x.float().abs().max())
    s2 = torch.tensor(5.0 / 2688)
    y = R.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT, "nvfp4", s13, s2)
    _close(y, _mlp64(x, w13, w2, LIMIT, "nvfp4", s13, s2), rel=1e-4)


def test_vllm_shared_mlp_w4a4_from_vllm_blocks(vllm_ops) -> None:
    """vLLM building blocks: quant-dequant, dequantize_to_dtype, SiluAndMulWithClamp."""
    m, hid, i = 10, 128, 64
    x = _rand((m, hid), 95, 2.0).float()
    (p13, sf13, g13), (p2, sf2, g2) = _weight((2 * i, hid), 96), _weight((hid, i), 97)
    s13, s2 = F.global_scale_from_amax(x.abs().max()), torch.tensor(4.0 / 2688)
    emu = vllm_ops.emu
    h = emu.run_nvfp4_emulations(x, 1 / s13, p13, F.swizzle_scales(sf13), g13)
    a = vllm_ops.clamp.forward_native(h)
    theirs = emu.run_nvfp4_emulations(a, 1 / s2, p2, F.swizzle_scales(sf2), g2)
    ours = R.nvfp4_shared_mlp_ref(x, p13, sf13, g13, p2, sf2, g2, LIMIT, "nvfp4", s13, s2)
    _close(ours, theirs.double(), rel=1e-4)


# --------------------------------------------------------------------------- MoE


def _moe_weights(e: int, hid: int, i: int, seed: int):
    return _weight((e, 2 * i, hid), seed, per_matrix=True), _weight((e, hid, i), seed + 1, True)


def _moe64(x, ids, wts, w13, w2, limit) -> torch.Tensor:
    """gpt-fast style token loop in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            w13e = tuple(a[e] for a in w13)
            w2e = tuple(a[e] for a in w2)
            out[t] += float(wts[t, j]) * _mlp64(x[t : t + 1], w13e, w2e, limit)[0]
    return out


@pytest.mark.parametrize("case", ["random", "one_expert", "with_minus_one"])
def test_moe_matches_float64(case: str) -> None:
    e, hid, i, m, k = 6, 64, 32, 11, 2
    g = torch.Generator().manual_seed(["random", "one_expert", "with_minus_one"].index(case))
    x = _rand((m, hid), 110, 4.0)
    w13, w2 = _moe_weights(e, hid, i, 111)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(m)])  # no expert 5
    if case == "one_expert":
        ids = torch.full((m, 1), 3)
    if case == "with_minus_one":
        ids[::3, 1] = -1
    wts = torch.rand(ids.shape, generator=g) + 0.1
    y = R.nvfp4_moe_ref(x, ids.int(), wts, *w13, *w2, limit=LIMIT)
    assert y.shape == (m, hid)
    assert not bool((ids == 5).any())  # expert 5 has no token
    _close(y, _moe64(x, ids, wts, w13, w2, LIMIT), rel=1e-3)


def test_moe_all_tokens_on_one_expert_equals_shared_mlp_weighted() -> None:
    e, hid, i, m = 4, 64, 32, 7
    x = _rand((m, hid), 120, 3.0)
    w13, w2 = _moe_weights(e, hid, i, 121)
    ids = torch.full((m, 1), 2, dtype=torch.int64)
    wts = torch.rand((m, 1), generator=torch.Generator().manual_seed(122))
    y = R.nvfp4_moe_ref(x, ids, wts, *w13, *w2, limit=LIMIT)
    mlp = R.nvfp4_shared_mlp_ref(x, *(a[2] for a in w13), *(a[2] for a in w2), limit=LIMIT)
    torch.testing.assert_close(y, mlp * wts, rtol=1e-6, atol=1e-6)


def test_moe_w4a4_per_expert_scales_equal_per_token_mlp() -> None:
    e, hid, i, m, k = 5, 64, 32, 8, 2
    x = _rand((m, hid), 130, 2.0)
    w13, w2 = _moe_weights(e, hid, i, 131)
    g = torch.Generator().manual_seed(132)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    wts = torch.rand((m, k), generator=g)
    s13 = torch.linspace(0.5, 1.5, e) * F.global_scale_from_amax(x.float().abs().max())
    s2 = torch.linspace(2.0, 6.0, e) / 2688
    y = R.nvfp4_moe_ref(x, ids, wts, *w13, *w2, LIMIT, "nvfp4", s13, s2)
    want = torch.zeros(m, hid)
    for t in range(m):
        for j in range(k):
            ex = int(ids[t, j])
            mlp = R.nvfp4_shared_mlp_ref(
                x[t : t + 1], *(a[ex] for a in w13), *(a[ex] for a in w2),
                LIMIT, "nvfp4", s13[ex], s2[ex],
            )  # fmt: skip
            want[t] += wts[t, j] * mlp[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_moe_no_tokens() -> None:
    w13, w2 = _moe_weights(3, 32, 16, 140)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    ids, wts = torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2)
    y = R.nvfp4_moe_ref(x, ids, wts, *w13, *w2)
    assert y.shape == (0, 32) and y.dtype == torch.float32


# --------------------------------------------------------------------------- bad input


def test_errors_name_the_tensor_and_expected_value() -> None:
    w = _weight((8, 32), 150)
    x = _rand((4, 32), 151)
    with pytest.raises(ValueError, match=r"x: shape \(4, 24\), expected the last dim \(K\)"):
        R.nvfp4_linear_ref(_rand((4, 24), 1), *w)
    with pytest.raises(ValueError, match=r"x: dtype torch.int32"):
        R.nvfp4_linear_ref(torch.ones(4, 32, dtype=torch.int32), *w)
    with pytest.raises(ValueError, match=r"w_packed: shape \(8, 16\), expected \(8, 32\)"):
        R.nvfp4_linear_ref(_rand((4, 64), 1), *w)
    with pytest.raises(ValueError, match=r"w_sf: shape \(8, 1\), expected \(8, 2\)"):
        R.nvfp4_linear_ref(x, w[0], w[1][:, :1], w[2])
    with pytest.raises(ValueError, match=r"packed: dtype torch.int8"):
        R.nvfp4_linear_ref(x, w[0].view(torch.int8), w[1], w[2])
    with pytest.raises(ValueError, match=r"act: 'fp8', expected 'bf16' or 'nvfp4'"):
        R.nvfp4_linear_ref(x, *w, act="fp8")
    with pytest.raises(ValueError, match=r"x: act='nvfp4' needs its static input_scale"):
        R.nvfp4_linear_ref(x, *w, act="nvfp4")
    with pytest.raises(ValueError, match=r"w_packed: shape \(8, 16\), expected \[G\*R, D//2\]"):
        R.nvfp4_grouped_oproj_ref(_rand((2, 3, 32), 1), *w)
    with pytest.raises(ValueError, match=r"x: shape \(2, 64\), expected \[T, G, D\]"):
        R.nvfp4_grouped_oproj_ref(_rand((2, 64), 1), *w)
    x3, cache = _rand((2, 1, 512), 1), _cache(16)
    with pytest.raises(ValueError, match=r"positions: torch.float32 \(2,\), expected int32/int64"):
        R.inverse_rope_ref(x3, torch.zeros(2), cache)
    with pytest.raises(ValueError, match=r"cos_sin_cache: torch.float16 \(16, 64\)"):
        R.inverse_rope_ref(x3, torch.zeros(2, dtype=torch.long), cache.half())
    with pytest.raises(ValueError, match=r"cos_sin_cache: shape \(16, 32\), expected \(16, 64\)"):
        R.inverse_rope_ref(x3, torch.zeros(2, dtype=torch.long), cache[:, :32])
    with pytest.raises(ValueError, match=r"up: shape \(3, 4\), expected \(3, 5\) \(gate\)"):
        R.swiglu_clamp_ref(torch.ones(3, 5), torch.ones(3, 4))
    w13, w2 = _weight((2 * 24, 32), 152), _weight((32, 32), 153)
    with pytest.raises(ValueError, match=r"w13_packed: shape \(48, 16\), expected I % 16 == 0"):
        R.nvfp4_shared_mlp_ref(x, *w13, *w2)
    m13, m2 = _moe_weights(4, 32, 16, 154)
    ids, wts = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"topk_ids: value 4, expected -1 or in \[0, 4\)"):
        R.nvfp4_moe_ref(x, ids + 4, wts, *m13, *m2)
    with pytest.raises(ValueError, match=r"topk_ids: torch.float32"):
        R.nvfp4_moe_ref(x, ids.float(), wts, *m13, *m2)
    with pytest.raises(ValueError, match=r"topk_weights: shape \(4, 1\), expected \(4, 2\)"):
        R.nvfp4_moe_ref(x, ids, wts[:, :1], *m13, *m2)
    with pytest.raises(ValueError, match=r"w2_packed: shape \(4, 32, 16\), expected \(4, 32, 8\)"):
        R.nvfp4_moe_ref(x, ids, wts, *m13, *_weight((4, 32, 32), 155))
    with pytest.raises(ValueError, match=r"w13_gs: shape \(3,\), expected \(4,\)"):
        R.nvfp4_moe_ref(x, ids, wts, m13[0], m13[1], torch.ones(3), *m2)
