"""Torch references, one per public op: fp32 math on the operands as the kernels see them.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), H hidden size,
I intermediate size (per expert / shared MLP), E experts, topk experts per token, T tokens of the
o-projection, G o-proj groups, D = K of one group, R = rows (out features) of one group.

Weights are NVFP4 in the checkpoint layout of :mod:`cutedsl.formats`: packed uint8 [N, K//2],
linear float8_e4m3fn block scales [N, K//16] and an fp32 global scale (``weight_scale_2``).
Activations follow one of two paths (``act``):
  - ``"bf16"`` (W4A16, the SM90 path): the activation is used as given (bf16) in fp32 math;
  - ``"nvfp4"`` (W4A4, the SM100 path): the activation is quantize-dequantized with the static
    global scale ``input_scale`` and dynamic block scales (:func:`formats.quantize_nvfp4_activation`).
Intermediates between two GEMMs (MLP / MoE) are rounded like the kernel's operand: to bf16 for
``"bf16"``, NVFP4 quantize-dequantized with the second GEMM's ``input_scale`` for ``"nvfp4"``.
Outputs are fp32 (round them to the kernel's output dtype before comparing, if needed).
"""

from __future__ import annotations

from typing import Literal

import torch

from cutedsl import formats

Act = Literal["bf16", "nvfp4"]
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ROPE_DIM = 64


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(expected)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype}, expected bf16, fp16 or fp32")


def _check_k(name: str, t: torch.Tensor, what: str = "K") -> None:
    if t.shape[-1] % formats.BLOCK != 0:
        raise ValueError(
            f"{name}: shape {tuple(t.shape)}, expected the last dim ({what}) divisible by "
            f"{formats.BLOCK}"
        )


def _check_act(act: str) -> None:
    if act not in ("bf16", "nvfp4"):
        raise ValueError(f"act: {act!r}, expected 'bf16' or 'nvfp4'")


def _weight_f32(
    name: str, packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor | float, n: int, k: int
) -> torch.Tensor:
    """Dequantize one NVFP4 weight [n, k] to fp32, checking the shapes against (n, k)."""
    _check_shape(f"{name}_packed", packed, (n, k // 2))
    _check_shape(f"{name}_sf", sf, (n, k // formats.BLOCK))
    return formats.dequantize_nvfp4(packed, sf, gs, torch.float32)


def _activation_f32(
    name: str, x: torch.Tensor, act: Act, input_scale: torch.Tensor | float | None
) -> torch.Tensor:
    """x [M, K] as the kernel's A operand, in fp32 (see the module docstring)."""
    if act == "bf16":
        return x.to(torch.float32)
    if input_scale is None:
        raise ValueError(f"{name}: act='nvfp4' needs its static input_scale, got None")
    if x.shape[0] == 0:
        return x.to(torch.float32)
    q = formats.quantize_nvfp4_activation(x.to(torch.float32), input_scale)
    return formats.dequantize_nvfp4(*q, torch.float32)


def _intermediate_f32(
    name: str, h: torch.Tensor, act: Act, input_scale: torch.Tensor | float | None
) -> torch.Tensor:
    """An fp32 intermediate [M, I] rounded to what the second GEMM reads."""
    if act == "bf16":
        return h.to(torch.bfloat16).to(torch.float32)
    return _activation_f32(name, h, act, input_scale)


def nvfp4_linear_ref(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_sf: torch.Tensor,
    w_gs: torch.Tensor | float,
    act: Act = "bf16",
    input_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """y = x · Wᵀ in fp32.

    x: [M, K] bf16 (or fp16/fp32). w_packed: uint8 [N, K//2]; w_sf: e4m3 [N, K//16] linear;
    w_gs: fp32 0-dim (``weight_scale_2``). act/input_scale: see the module docstring
    (input_scale fp32 0-dim, required for "nvfp4"). Returns fp32 [M, N].
    """
    _check_float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [M, K]")
    _check_k("x", x)
    _check_act(act)
    if w_packed.ndim != 2:
        raise ValueError(f"w_packed: shape {tuple(w_packed.shape)}, expected [N, K//2]")
    k, n = x.shape[1], w_packed.shape[0]
    w = _weight_f32("w", w_packed, w_sf, w_gs, n, k)
    return _activation_f32("x", x, act, input_scale) @ w.T


def nvfp4_grouped_oproj_ref(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_sf: torch.Tensor,
    w_gs: torch.Tensor | float,
    act: Act = "bf16",
    input_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The DSv4 grouped o-projection wo_a: out[t, g, :] = x[t, g, :] · W_gᵀ in fp32.

    x: [T, G, D] bf16 (the inverse-RoPE'd attention output viewed per group, D = heads/group·512).
    w_packed: uint8 [G·R, D//2], w_sf: e4m3 [G·R, D//16] linear, w_gs: fp32 0-dim: the checkpoint's
    2-D wo_a, where group g is rows [g·R, (g+1)·R). act/input_scale as in :func:`nvfp4_linear_ref`
    (one input_scale for all groups). Returns fp32 [T, G, R].
    """
    _check_float("x", x)
    if x.ndim != 3:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [T, G, D]")
    _check_k("x", x, "D")
    _check_act(act)
    t, g, d = x.shape
    if w_packed.ndim != 2 or w_packed.shape[0] % g != 0:
        raise ValueError(
            f"w_packed: shape {tuple(w_packed.shape)}, expected [G*R, D//2] with G = {g}"
        )
    r = w_packed.shape[0] // g
    w = _weight_f32("w", w_packed, w_sf, w_gs, g * r, d).reshape(g, r, d)
    a = _activation_f32("x", x.reshape(t * g, d), act, input_scale).reshape(t, g, d)
    return torch.einsum("tgd,grd->tgr", a, w)


def inverse_rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope_dim: int = ROPE_DIM,
) -> torch.Tensor:
    """Undo the GPT-J (interleaved) RoPE of the last ``rope_dim`` dims of each head.

    x: [T, NH, head_dim] bf16 (DSv4: head_dim 512 = 448 nope + 64 rope). positions: int [T].
    cos_sin_cache: fp32 [max_pos, rope_dim] = cos(rope_dim/2) ‖ sin(rope_dim/2), as vLLM's
    DeepseekV4ScalingRotaryEmbedding.cos_sin_cache. Pair j = dims (2j, 2j+1) of the rope part:
        y[2j]   = x[2j]·cos_j + x[2j+1]·sin_j
        y[2j+1] = x[2j+1]·cos_j − x[2j]·sin_j       (fp32 math, rounded back to x.dtype)
    The first head_dim − rope_dim dims pass through. Returns [T, NH, head_dim] in x.dtype.
    """
    _check_float("x", x)
    if x.ndim != 3 or x.shape[-1] < rope_dim:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [T, NH, head_dim >= {rope_dim}]")
    if rope_dim % 2 != 0:
        raise ValueError(f"rope_dim: {rope_dim}, expected an even number")
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != x.shape[:1]:
        raise ValueError(
            f"positions: {positions.dtype} {tuple(positions.shape)}, "
            f"expected int32/int64 ({x.shape[0]},)"
        )
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2:
        raise ValueError(
            f"cos_sin_cache: {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}, "
            f"expected float32 [max_pos, {rope_dim}]"
        )
    _check_shape("cos_sin_cache", cos_sin_cache, (cos_sin_cache.shape[0], rope_dim))
    half = rope_dim // 2
    cs = cos_sin_cache[positions.long()].unsqueeze(1)  # [T, 1, rope_dim]
    cos, sin = cs[..., :half], cs[..., half:]
    rope = x[..., -rope_dim:].to(torch.float32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


def swiglu_clamp_ref(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None = 10.0
) -> torch.Tensor:
    """DSv4 clamped SwiGLU in fp32: silu(min(gate, L)) · clamp(up, −L, L); limit None: no clamp.

    gate, up: [..., I] (same shape, float). Returns fp32 [..., I].
    """
    _check_float("gate", gate)
    _check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"up: shape {tuple(up.shape)}, expected {tuple(gate.shape)} (gate)")
    g, u = gate.to(torch.float32), up.to(torch.float32)
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def _mlp_f32(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None,
    act: Act,
    a13_scale: torch.Tensor | float | None,
    a2_scale: torch.Tensor | float | None,
) -> torch.Tensor:
    """x [M, H] -> [M, H]: gate_up (w13 [2I, H] fp32), clamped SwiGLU, down (w2 [H, I] fp32)."""
    i = w13.shape[0] // 2
    h = _activation_f32("x", x, act, a13_scale) @ w13.T
    a = swiglu_clamp_ref(h[:, :i], h[:, i:], limit)
    return _intermediate_f32("intermediate", a, act, a2_scale) @ w2.T


def nvfp4_shared_mlp_ref(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_sf: torch.Tensor,
    w13_gs: torch.Tensor | float,
    w2_packed: torch.Tensor,
    w2_sf: torch.Tensor,
    w2_gs: torch.Tensor | float,
    limit: float | None = 10.0,
    act: Act = "bf16",
    a13_scale: torch.Tensor | float | None = None,
    a2_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """DSv4 shared expert: down(swiglu_clamp(gate_up(x))) in fp32.

    x: [M, H]. w13_*: gate_up [2I, H] (rows 0..I-1 = w1/gate, I..2I-1 = w3/up; packed uint8
    [2I, H//2], e4m3 [2I, H//16], fp32 0-dim global shared by w1 and w3). w2_*: down [H, I]
    (uint8 [H, I//2], e4m3 [H, I//16], fp32 0-dim). a13_scale/a2_scale: the static input scales of
    gate_up and down (act="nvfp4" only). Returns fp32 [M, H].
    """
    _check_float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [M, H]")
    _check_k("x", x, "H")
    _check_act(act)
    hid = x.shape[1]
    if w13_packed.ndim != 2 or w13_packed.shape[0] % 2 != 0:
        raise ValueError(f"w13_packed: shape {tuple(w13_packed.shape)}, expected [2I, H//2]")
    i = w13_packed.shape[0] // 2
    if i % formats.BLOCK != 0:
        raise ValueError(f"w13_packed: shape {tuple(w13_packed.shape)}, expected I % 16 == 0")
    w13 = _weight_f32("w13", w13_packed, w13_sf, w13_gs, 2 * i, hid)
    w2 = _weight_f32("w2", w2_packed, w2_sf, w2_gs, hid, i)
    return _mlp_f32(x, w13, w2, limit, act, a13_scale, a2_scale)


def _per_expert(name: str, s: torch.Tensor | float | None, e: int) -> list:
    """A 0-dim or [E] scale -> a list of E per-expert scales (None stays None)."""
    if s is None:
        return [None] * e
    s = torch.as_tensor(s, dtype=torch.float32)
    if s.ndim == 0:
        return [s] * e
    _check_shape(name, s, (e,))
    return list(s.unbind(0))


def nvfp4_moe_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_sf: torch.Tensor,
    w13_gs: torch.Tensor | float,
    w2_packed: torch.Tensor,
    w2_sf: torch.Tensor,
    w2_gs: torch.Tensor | float,
    limit: float | None = 10.0,
    act: Act = "bf16",
    a13_scale: torch.Tensor | float | None = None,
    a2_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Routed experts: out[m] = Σ_j topk_weights[m, j] · expert_{topk_ids[m, j]}(x[m]), fp32.

    x: [M, H]. topk_ids: int32/int64 [M, topk] in [0, E), or -1 for "not local" (skipped).
    topk_weights: float [M, topk] (applied to the expert outputs). w13_packed: uint8
    [E, 2I, H//2] (per expert: w1 rows then w3 rows), w13_sf: e4m3 [E, 2I, H//16], w13_gs: fp32
    [E] or 0-dim; w2_packed: uint8 [E, H, I//2], w2_sf: e4m3 [E, H, I//16], w2_gs: [E] or 0-dim.
    Each expert = :func:`nvfp4_shared_mlp_ref` on its tokens; experts with no token are skipped.
    a13_scale/a2_scale: [E] or 0-dim static input scales (act="nvfp4"). Returns fp32 [M, H].
    """
    _check_float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [M, H]")
    _check_k("x", x, "H")
    _check_act(act)
    m, hid = x.shape
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.ndim != 2:
        raise ValueError(
            f"topk_ids: {topk_ids.dtype} {tuple(topk_ids.shape)}, expected int32/int64 [M, topk]"
        )
    _check_shape("topk_ids", topk_ids, (m, topk_ids.shape[1]))
    _check_float("topk_weights", topk_weights)
    _check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if w13_packed.ndim != 3 or w13_packed.shape[1] % 2 != 0:
        raise ValueError(f"w13_packed: shape {tuple(w13_packed.shape)}, expected [E, 2I, H//2]")
    e, i = w13_packed.shape[0], w13_packed.shape[1] // 2
    if i % formats.BLOCK != 0:
        raise ValueError(f"w13_packed: shape {tuple(w13_packed.shape)}, expected I % 16 == 0")
    _check_shape("w13_packed", w13_packed, (e, 2 * i, hid // 2))
    _check_shape("w13_sf", w13_sf, (e, 2 * i, hid // formats.BLOCK))
    _check_shape("w2_packed", w2_packed, (e, hid, i // 2))
    _check_shape("w2_sf", w2_sf, (e, hid, i // formats.BLOCK))
    bad = (topk_ids < -1) | (topk_ids >= e)
    if bool(bad.any()):
        raise ValueError(f"topk_ids: value {int(topk_ids[bad][0])}, expected -1 or in [0, {e})")
    g13, g2 = _per_expert("w13_gs", w13_gs, e), _per_expert("w2_gs", w2_gs, e)
    s13, s2 = _per_expert("a13_scale", a13_scale, e), _per_expert("a2_scale", a2_scale, e)
    out = torch.zeros(m, hid, dtype=torch.float32, device=x.device)
    for ex in range(e):
        tok, slot = torch.nonzero(topk_ids == ex, as_tuple=True)
        if tok.numel() == 0:
            continue
        w13 = _weight_f32("w13", w13_packed[ex], w13_sf[ex], g13[ex], 2 * i, hid)
        w2 = _weight_f32("w2", w2_packed[ex], w2_sf[ex], g2[ex], hid, i)
        y = _mlp_f32(x[tok], w13, w2, limit, act, s13[ex], s2[ex])
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(torch.float32)[:, None])
    return out
