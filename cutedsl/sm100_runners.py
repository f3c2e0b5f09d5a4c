"""The sm100 backend of each runner: weights prepared once for `cutedsl.sm100` (blocked scales,
w13 interleaved for the fused clamped SwiGLU), then the W4A4 launchers (activation quantization
with the static input scale, block-scaled GEMM, alpha = input_scale · weight_scale_2).

Never run on a GPU: we have no Blackwell machine (see README). Compiled for sm_100a in CI.

Hot path: no compile once warm, no host sync, no CPU tensor. The only allocations are the op
results (a linear's / the shared MLP's [M, N], the grouped o-proj's [T, G, R]: a torch.library
custom op returns new tensors) and a copy of a non-contiguous input. Intermediates (the NVFP4
activations and their scales, the shared MLP's h, the MoE layout, gathered rows, h, y and the
fp32 combine accumulator) are views of a `cutedsl.workspace` reserved by `warmup(max_tokens)`
(MoE and o-proj: role "main"; shared MLP: role "shared", vLLM may run it on a side stream; a
linear: a private one, DSv4 runs two linears concurrently), fetched per call; a call with more
rows than warmed up raises `cutedsl.workspace.WorkspaceError`. torch.sort / torch.cumsum of the
MoE layout allocate inside torch (an index arange, cub scratch), once per MoE call.
"""

from __future__ import annotations

import torch

from cutedsl import formats, sm100
from cutedsl.workspace import Workspace, for_role

# Routed rows reserved per token: topk <= 8 (DSv4 uses 6).
MAX_TOPK = 8


def _need(name: str, t: torch.Tensor | None) -> torch.Tensor:
    """The static activation scale(s) as fp32 (1,): one per GEMM (the max over experts, as vLLM
    keeps it). W4A4 cannot run without it."""
    if t is None:
        raise ValueError(f"{name}: the sm100 (W4A4) backend needs the static input scale, got None")
    return t.float().amax().reshape(1)


class _Warm:
    limit: float | None = None

    def warmup(self, max_tokens: int) -> None:  # one compile serves every M
        sm100.warmup(self.limit)
        self._reserve(max_tokens)

    def _reserve(self, max_tokens: int) -> None:
        raise NotImplementedError


class _Linear(_Warm):
    def __init__(self, r) -> None:
        self.w, self.sf = sm100.prepare_weight(r.weight, r.weight_scale)
        self.a_scale = _need("input_scale", r.input_scale)
        self.alpha = self.a_scale * r.weight_scale_2
        self.ws = Workspace(r.weight.device, "linear")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return sm100.nvfp4_linear_sm100(
            x.contiguous(), self.w, self.sf, self.a_scale, self.alpha, ws=self.ws
        )

    def _reserve(self, max_tokens: int) -> None:
        sm100.quant_reserve(
            self.ws, formats.round_up(max_tokens, sm100.TILE_M), self.w.shape[1] * 2
        )


class _GroupedOproj(_Warm):
    def __init__(self, r) -> None:
        self.w, self.sf = sm100.prepare_weight(r.weight, r.weight_scale)
        self.a_scale = _need("input_scale", r.input_scale)
        self.alpha = (self.a_scale * r.weight_scale_2).expand(r.n_groups).contiguous()
        self.g, self.device = r.n_groups, r.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, D] (read in place) → [T, G, R]
        ws = for_role(self.device, "main")
        return sm100.nvfp4_grouped_oproj_sm100(x, self.w, self.sf, self.a_scale, self.alpha, ws=ws)

    def _reserve(self, max_tokens: int) -> None:
        rows = self.g * sm100.oproj_padded_t(max_tokens)
        sm100.quant_reserve(for_role(self.device, "main"), rows, self.w.shape[1] * 2)


def _fused_limit(r) -> float:
    if r.swiglu_limit is None:
        raise NotImplementedError("sm100: only the fused clamped SwiGLU exists; swiglu_limit=None")
    return float(r.swiglu_limit)


class _SharedMlp(_Warm):
    def __init__(self, r) -> None:
        self.limit = _fused_limit(r)
        self.w13, self.sf13 = sm100.prepare_weight(
            sm100.interleave_w13(r.w13), sm100.interleave_w13(r.w13_scale)
        )
        self.w2, self.sf2 = sm100.prepare_weight(r.w2, r.w2_scale)
        self.a13 = _need("w13_input_scale", r.w13_input_scale)
        self.a2 = _need("w2_input_scale", r.w2_input_scale)
        self.alpha13, self.alpha2 = self.a13 * r.w13_scale_2, self.a2 * r.w2_scale_2
        self.device = r.w13.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = for_role(self.device, "shared")
        h = ws.get("h", (x.shape[0], self.w2.shape[1] * 2), torch.bfloat16)
        sm100.nvfp4_linear_sm100(
            x.contiguous(), self.w13, self.sf13, self.a13, self.alpha13, swiglu_limit=self.limit,
            out=h, ws=ws,
        )  # fmt: skip
        return sm100.nvfp4_linear_sm100(h, self.w2, self.sf2, self.a2, self.alpha2, ws=ws)

    def _reserve(self, max_tokens: int) -> None:
        ws = for_role(self.device, "shared")
        i, hid = self.w2.shape[1] * 2, self.w13.shape[1] * 2
        ws.reserve("h", (max_tokens, i), torch.bfloat16)
        sm100.quant_reserve(ws, formats.round_up(max_tokens, sm100.TILE_M), max(i, hid))


class _MoE(_Warm):
    def __init__(self, r) -> None:
        self.limit = _fused_limit(r)
        e, i2, h = r.e, 2 * r.i, r.h
        w13, sf13 = sm100.prepare_weight(
            sm100.interleave_w13(r.w13), sm100.interleave_w13(r.w13_scale)
        )
        self.w13, self.sf13 = w13.reshape(e * i2, h // 2), sf13.reshape(e * i2, h // 16)
        w2, sf2 = sm100.prepare_weight(r.w2, r.w2_scale)
        self.w2, self.sf2 = w2.reshape(e * h, r.i // 2), sf2.reshape(e * h, r.i // 16)
        self.a13 = _need("w13_input_scale", r.w13_input_scale)
        self.a2 = _need("w2_input_scale", r.w2_input_scale)
        self.alpha13, self.alpha2 = self.a13 * r.w13_scale_2, self.a2 * r.w2_scale_2
        self.e, self.h, self.i, self.device = e, h, r.i, r.w13.device

    def __call__(self, x, topk_ids, topk_weights, out) -> None:
        y = sm100.nvfp4_moe_sm100(
            x.contiguous(), topk_ids, topk_weights, self.w13, self.sf13, self.w2, self.sf2,
            self.a13, self.a2, self.alpha13, self.alpha2, self.limit,
            ws=for_role(self.device, "main"),
        )  # fmt: skip
        out.copy_(y)

    def _reserve(self, max_tokens: int) -> None:
        ws = for_role(self.device, "main")
        sm100.moe_reserve(ws, max_tokens, MAX_TOPK, self.e, self.h, self.i)


# The factories `Runner._make_impl` looks up by the runner's kind.
linear_impl = _Linear
grouped_oproj_impl = _GroupedOproj
shared_mlp_impl = _SharedMlp
moe_impl = _MoE
