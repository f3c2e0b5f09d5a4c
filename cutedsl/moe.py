"""The DSv4 routed experts: out[m] = Σ_j topk_weights[m, j] · expert_{topk_ids[m, j]}(x[m]).

Each expert is the clamped-SwiGLU MLP of `cutedsl.shared_mlp` with its own NVFP4 weights:
w13 u8 [E, 2I, H//2] (w1 rows then w3 rows), w13_scale e4m3 [E, 2I, H//16], w13_scale_2 fp32 [E],
w2 u8 [E, H, I//2], w2_scale e4m3 [E, H, I//16], w2_scale_2 fp32 [E]; input scales fp32 [E].
topk_ids int32 [M, topk]: local expert ids, −1 = not on this rank (expert parallelism).
The runner writes vLLM's `out` buffer (bf16 [M, H]) in place. Backends as in `cutedsl.linear`; the
GPU backends route on the device (no host sync, CUDA-graph capturable): sm90 by per-expert
offsets (`cutedsl.sm90.routing`), sm100 by per-expert padded segments (`cutedsl.sm100`).
"""

from __future__ import annotations

import torch

from cutedsl import formats, ops, reference
from cutedsl.runner import Runner
from cutedsl.sm90 import runners as sm90_runners
from cutedsl.sm100 import runners as sm100_runners
from cutedsl.validate import check_tensor, per_expert_f32


class Nvfp4MoE(Runner):
    impls = {
        "sm90": sm90_runners.MoE,
        "sm100": sm100_runners.MoE,
        "sm100-emulated": sm100_runners.EmulatedMoE,
    }
    checkpoint_tensors = ("w13", "w13_scale", "w2", "w2_scale")

    def __init__(
        self,
        w13: torch.Tensor,  # (E, 2I, H//2) uint8
        w13_scale: torch.Tensor,  # (E, 2I, H//16) e4m3
        w13_scale_2: torch.Tensor,  # (E,) fp32
        w13_input_scale: torch.Tensor | None,  # (E,) fp32
        w2: torch.Tensor,  # (E, H, I//2) uint8
        w2_scale: torch.Tensor,  # (E, H, I//16) e4m3
        w2_scale_2: torch.Tensor,  # (E,) fp32
        w2_input_scale: torch.Tensor | None,  # (E,) fp32
        *,
        swiglu_limit: float | None = 10.0,
        backend: str | None = None,
    ) -> None:
        check_tensor("w13", w13, (None, None, None), (torch.uint8,))
        self.e = w13.shape[0]
        if w13.shape[1] % 2:
            raise ValueError(f"w13: {w13.shape[1]} rows per expert, expected 2·I")
        self.i, self.h = w13.shape[1] // 2, w13.shape[2] * 2
        if self.i % formats.BLOCK or self.h % formats.BLOCK:
            raise ValueError(f"w13: I = {self.i}, H = {self.h}; both must be multiples of 16")
        dev, e4m3 = w13.device, (torch.float8_e4m3fn,)
        check_tensor("w13_scale", w13_scale, (self.e, 2 * self.i, self.h // 16), e4m3, dev)
        check_tensor("w2", w2, (self.e, self.h, self.i // 2), (torch.uint8,), dev)
        check_tensor("w2_scale", w2_scale, (self.e, self.h, self.i // 16), e4m3, dev)
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self.w13_scale_2 = per_expert_f32("w13_scale_2", w13_scale_2, self.e, dev)
        self.w2_scale_2 = per_expert_f32("w2_scale_2", w2_scale_2, self.e, dev)
        self.w13_input_scale = per_expert_f32("w13_input_scale", w13_input_scale, self.e, dev)
        self.w2_input_scale = per_expert_f32("w2_input_scale", w2_input_scale, self.e, dev)
        self.swiglu_limit = swiglu_limit
        self._setup(dev, backend)

    def _reference(self, x, topk_ids, topk_weights, out) -> None:
        y = reference.nvfp4_moe_ref(
            x, topk_ids, topk_weights, self.w13, self.w13_scale, self.w13_scale_2,
            self.w2, self.w2_scale, self.w2_scale_2, self.swiglu_limit,
        )  # fmt: skip
        out.copy_(y)

    def run(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        check_tensor("x", x, (None, self.h), (torch.bfloat16,), self.device)
        m = x.shape[0]
        check_tensor("topk_ids", topk_ids, (m, None), (torch.int32, torch.int64), self.device)
        k = topk_ids.shape[1]
        check_tensor("topk_weights", topk_weights, (m, k), (torch.float32,), self.device)
        check_tensor("out", out, (m, self.h), (torch.bfloat16,), self.device)
        if m == 0:
            return
        self._impl(x, topk_ids, topk_weights, out)

    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        ops.nvfp4_moe(x, topk_ids, topk_weights, out, self.id)
