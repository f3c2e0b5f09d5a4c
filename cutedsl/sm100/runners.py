"""The sm100 implementation of each public runner (`cutedsl.linear.Nvfp4Linear` ->
`Linear`, `cutedsl.grouped_oproj.Nvfp4GroupedOproj` -> `GroupedOproj`,
`cutedsl.shared_mlp.Nvfp4SharedMlp` -> `SharedMlp`, `cutedsl.moe.Nvfp4MoE` -> `MoE`), each
constructed as `Impl(runner)`: weights prepared once (`cutedsl.sm100.weight`: blocked scales, w13
interleaved for the fused clamped SwiGLU), then the W4A4 steps of `cutedsl.sm100.gemm`
(activation quantization with the static input scale, block-scaled GEMM, alpha = input_scale *
weight_scale_2). Host-tested with the kernels emulated; compiled for sm_100a, never run on a GPU.

Hot path: no compile once warm, no host sync, no CPU tensor. The only allocations are the op
results (a linear's / the shared MLP's [M, N], the grouped o-proj's [T, G, R]: a torch.library
custom op returns new tensors) and a copy of an input whose rows the activation quantizer
cannot read in place (`cutedsl.validate.readable_rows`; the MoE's: any non-contiguous input).
Intermediates (the NVFP4 activations and their scales, the shared MLP's h, the MoE layout, gathered rows, h, y and the
fp32 combine accumulator) are views of a `cutedsl.workspace` reserved by `warmup(max_tokens)`
(MoE and o-proj: role "main"; shared MLP: role "shared", vLLM may run it on a side stream; a
linear: a private one, DSv4 runs two linears concurrently), fetched per call; a call with more
rows than warmed up raises `cutedsl.workspace.WorkspaceError`. torch.sort / torch.cumsum of the
MoE layout allocate inside torch (an index arange, cub scratch), once per MoE call.

`EmulatedLinear`, `EmulatedGroupedOproj`, `EmulatedSharedMlp` and `EmulatedMoE` (the
`sm100-emulated` backend) are these same classes with `kernels = cutedsl.sm100.emulate.EMULATED`:
the same weight preparation, workspaces, layouts and launcher checks, each kernel launch replaced
by its torch statement (which also allocates its own temporaries). Any device, CPU included.
"""

from __future__ import annotations

import torch

from cutedsl import formats
from cutedsl.sm100 import gemm
from cutedsl.sm100.emulate import EMULATED
from cutedsl.sm100.layout import TILE_M, oproj_padded_t
from cutedsl.sm100.weight import interleave_w13, prepare_weight
from cutedsl.validate import readable_rows
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
    kernels: gemm.Kernels = gemm.CUTEDSL  # what runs each kernel launch

    def warmup(self, max_tokens: int) -> None:
        """Compile every kernel variant (one compile serves every M) and reserve the workspace
        for up to `max_tokens` rows."""
        self.kernels.precompile(self.limit)
        self._reserve(max_tokens)

    def _reserve(self, max_tokens: int) -> None:
        raise NotImplementedError


class Linear(_Warm):
    """y = alpha * quant(x) . W^T: x bf16 [M, K] -> bf16 [M, N]; NVFP4 activations in a private
    workspace (DSv4 runs two linears concurrently)."""

    def __init__(self, r) -> None:
        self.w = prepare_weight(r.weight, r.weight_scale)
        self.a_scale = _need("input_scale", r.input_scale)
        self.alpha = self.a_scale * r.weight_scale_2
        self.ws = Workspace(r.weight.device, "linear")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = readable_rows(x, "sm100 linear input")
        return gemm.linear(x, self.w, self.a_scale, self.alpha, ws=self.ws, kernels=self.kernels)

    def _reserve(self, max_tokens: int) -> None:
        gemm.quant_reserve(self.ws, formats.round_up(max_tokens, TILE_M), self.w.k)


class GroupedOproj(_Warm):
    """wo_a: x bf16 [T, G, D] (read in place) -> bf16 [T, G, R]; workspace role "main"."""

    def __init__(self, r) -> None:
        self.w = prepare_weight(r.weight, r.weight_scale, groups=r.n_groups)
        self.a_scale = _need("input_scale", r.input_scale)
        self.alpha = (self.a_scale * r.weight_scale_2).expand(r.n_groups).contiguous()
        self.g, self.device = r.n_groups, r.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = for_role(self.device, "main")
        return gemm.grouped(x, self.w, self.a_scale, self.alpha, ws=ws, kernels=self.kernels)

    def _reserve(self, max_tokens: int) -> None:
        rows = self.g * oproj_padded_t(max_tokens)
        gemm.quant_reserve(for_role(self.device, "main"), rows, self.w.k)


def _fused_limit(r) -> float:
    if r.swiglu_limit is None:
        raise NotImplementedError("sm100: only the fused clamped SwiGLU exists; swiglu_limit=None")
    return float(r.swiglu_limit)


class SharedMlp(_Warm):
    """x bf16 [M, H] -> w13 GEMM + fused clamped SwiGLU -> w2 GEMM -> bf16 [M, H]; h and the
    NVFP4 activations in workspace role "shared" (vLLM may run it on a side stream)."""

    def __init__(self, r) -> None:
        self.limit = _fused_limit(r)
        self.w13 = prepare_weight(interleave_w13(r.w13), interleave_w13(r.w13_scale))
        self.w2 = prepare_weight(r.w2, r.w2_scale)
        self.a13 = _need("w13_input_scale", r.w13_input_scale)
        self.a2 = _need("w2_input_scale", r.w2_input_scale)
        self.alpha13, self.alpha2 = self.a13 * r.w13_scale_2, self.a2 * r.w2_scale_2
        self.device = r.w13.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = for_role(self.device, "shared")
        h = ws.get("h", (x.shape[0], self.w2.k), torch.bfloat16)
        gemm.linear(
            readable_rows(x, "sm100 shared MLP input"), self.w13, self.a13, self.alpha13,
            swiglu_limit=self.limit, out=h, ws=ws, kernels=self.kernels,
        )  # fmt: skip
        return gemm.linear(h, self.w2, self.a2, self.alpha2, ws=ws, kernels=self.kernels)

    def _reserve(self, max_tokens: int) -> None:
        ws = for_role(self.device, "shared")
        i, hid = self.w2.k, self.w13.k
        ws.reserve("h", (max_tokens, i), torch.bfloat16)
        gemm.quant_reserve(ws, formats.round_up(max_tokens, TILE_M), max(i, hid))


class MoE(_Warm):
    """Routed experts: (x, topk_ids, topk_weights, out) -> out [M, H] (written in place); every
    intermediate in workspace role "main"."""

    def __init__(self, r) -> None:
        self.limit = _fused_limit(r)
        self.w13 = prepare_weight(interleave_w13(r.w13), interleave_w13(r.w13_scale))
        self.w2 = prepare_weight(r.w2, r.w2_scale)
        self.a13 = _need("w13_input_scale", r.w13_input_scale)
        self.a2 = _need("w2_input_scale", r.w2_input_scale)
        self.alpha13, self.alpha2 = self.a13 * r.w13_scale_2, self.a2 * r.w2_scale_2
        self.e, self.h, self.i, self.device = r.e, r.h, r.i, r.w13.device

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        y = gemm.moe(
            x.contiguous(), topk_ids, topk_weights, self.w13, self.w2, self.a13, self.a2,
            self.alpha13, self.alpha2, self.limit, ws=for_role(self.device, "main"),
            kernels=self.kernels,
        )  # fmt: skip
        out.copy_(y)

    def _reserve(self, max_tokens: int) -> None:
        ws = for_role(self.device, "main")
        gemm.moe_reserve(ws, max_tokens, MAX_TOPK, self.e, self.h, self.i)


# --------------------------------------------------------------------------- sm100-emulated


class EmulatedLinear(Linear):
    kernels = EMULATED


class EmulatedGroupedOproj(GroupedOproj):
    kernels = EMULATED


class EmulatedSharedMlp(SharedMlp):
    kernels = EMULATED


class EmulatedMoE(MoE):
    kernels = EMULATED
