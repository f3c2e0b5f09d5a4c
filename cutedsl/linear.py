"""NVFP4 linear: y[M, N] = x[M, K] · Wᵀ, for the DSv4 attention projections (fused_wqa_wkv, wq_b,
wo_b, indexer wq_b).

Inputs: x bf16 [M, K]; the checkpoint's weight u8 [N, K//2] (e2m1 pairs along K), weight_scale
e4m3 [N, K//16] (linear layout), weight_scale_2 fp32 (global), input_scale fp32 (static activation
scale; used by the W4A4 sm100 path). Output bf16 [M, N].
Backends: sm100 (activation quantized to NVFP4, block-scaled MMA), sm90 (W4A16: weights dequantized
in the mainloop), reference (torch fp32 math on dequantized operands, W4A16 semantics).
CUDA graphs / torch.compile: call the runner (it goes through `dsv4_cutedsl::nvfp4_linear`);
`warmup(max_tokens)` before capture.
"""

from __future__ import annotations

import torch

from cutedsl import formats, ops, reference
from cutedsl.runner import Runner
from cutedsl.sm90 import runners as sm90_runners
from cutedsl.sm100 import runners as sm100_runners
from cutedsl.validate import check_tensor, scalar_f32


class Nvfp4Linear(Runner):
    impls = {
        "sm90": sm90_runners.Linear,
        "sm100": sm100_runners.Linear,
        "sm100-emulated": sm100_runners.EmulatedLinear,
    }
    checkpoint_tensors = ("weight", "weight_scale")

    def __init__(
        self,
        weight: torch.Tensor,  # (N, K//2) uint8 e2m1x2, K-major
        weight_scale: torch.Tensor,  # (N, K//16) float8_e4m3fn, linear
        weight_scale_2: torch.Tensor | float,  # () fp32 global scale
        input_scale: torch.Tensor | float | None = None,  # () fp32 static activation scale
        *,
        out_dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        check_tensor("weight", weight, (None, None), (torch.uint8,))
        self.n, self.k = weight.shape[0], weight.shape[1] * 2
        if self.k % formats.BLOCK:
            raise ValueError(
                f"weight: K = {self.k} (2 × {weight.shape[1]}), expected a multiple of 16"
            )
        dev = weight.device
        check_tensor(
            "weight_scale", weight_scale, (self.n, self.k // 16), (torch.float8_e4m3fn,), dev
        )
        self.weight, self.weight_scale = weight, weight_scale
        self.weight_scale_2 = scalar_f32("weight_scale_2", weight_scale_2, dev)
        self.input_scale = scalar_f32("input_scale", input_scale, dev)
        self.out_dtype = out_dtype
        self._setup(dev, backend)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        y = reference.nvfp4_linear_ref(x, self.weight, self.weight_scale, self.weight_scale_2)
        return y.to(self.out_dtype)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, (None, self.k), (torch.bfloat16,), self.device)
        if x.shape[0] == 0:
            return x.new_empty((0, self.n), dtype=self.out_dtype)
        return self._impl(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.nvfp4_linear(x, self.id)
