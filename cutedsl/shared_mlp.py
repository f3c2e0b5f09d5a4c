"""The DSv4 shared expert: x[M, H] → gate_up [M, 2I] → clamped SwiGLU [M, I] → down [M, H].

Weights in the checkpoint layout: w13 u8 [2I, H//2] (w1/gate rows, then w3/up rows, one global
scale shared by both), w13_scale e4m3 [2I, H//16]; w2 u8 [H, I//2], w2_scale e4m3 [H, I//16].
Clamp (DSv4, limit L): gate = min(gate, L), up = clamp(up, −L, L), silu(gate)·up.
Backends and graph notes as in `cutedsl.linear`.
"""

from __future__ import annotations

import torch

from cutedsl import formats, ops, reference
from cutedsl.runner import Runner
from cutedsl.sm90 import runners as sm90_runners
from cutedsl.sm100 import runners as sm100_runners
from cutedsl.validate import check_tensor, scalar_f32


class Nvfp4SharedMlp(Runner):
    impls = {
        "sm90": sm90_runners.SharedMlp,
        "sm100": sm100_runners.SharedMlp,
        "sm100-emulated": sm100_runners.EmulatedSharedMlp,
    }
    checkpoint_tensors = ("w13", "w13_scale", "w2", "w2_scale")

    def __init__(
        self,
        w13: torch.Tensor,  # (2I, H//2) uint8
        w13_scale: torch.Tensor,  # (2I, H//16) e4m3
        w13_scale_2: torch.Tensor | float,  # () fp32
        w13_input_scale: torch.Tensor | float | None,  # () fp32
        w2: torch.Tensor,  # (H, I//2) uint8
        w2_scale: torch.Tensor,  # (H, I//16) e4m3
        w2_scale_2: torch.Tensor | float,  # () fp32
        w2_input_scale: torch.Tensor | float | None,  # () fp32
        *,
        swiglu_limit: float | None = 10.0,
        out_dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        check_tensor("w13", w13, (None, None), (torch.uint8,))
        if w13.shape[0] % 2:
            raise ValueError(f"w13: {w13.shape[0]} rows, expected 2·I (w1 rows then w3 rows)")
        self.i, self.h = w13.shape[0] // 2, w13.shape[1] * 2
        if self.i % formats.BLOCK or self.h % formats.BLOCK:
            raise ValueError(f"w13: I = {self.i}, H = {self.h}; both must be multiples of 16")
        dev = w13.device
        check_tensor(
            "w13_scale", w13_scale, (2 * self.i, self.h // 16), (torch.float8_e4m3fn,), dev
        )
        check_tensor("w2", w2, (self.h, self.i // 2), (torch.uint8,), dev)
        check_tensor("w2_scale", w2_scale, (self.h, self.i // 16), (torch.float8_e4m3fn,), dev)
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self.w13_scale_2 = scalar_f32("w13_scale_2", w13_scale_2, dev)
        self.w2_scale_2 = scalar_f32("w2_scale_2", w2_scale_2, dev)
        self.w13_input_scale = scalar_f32("w13_input_scale", w13_input_scale, dev)
        self.w2_input_scale = scalar_f32("w2_input_scale", w2_input_scale, dev)
        self.swiglu_limit = swiglu_limit
        self.out_dtype = out_dtype
        self._setup(dev, backend)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        y = reference.nvfp4_shared_mlp_ref(
            x, self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale, self.w2_scale_2,
            self.swiglu_limit,
        )  # fmt: skip
        return y.to(self.out_dtype)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, (None, self.h), (torch.bfloat16,), self.device)
        if x.shape[0] == 0:
            return x.new_empty((0, self.h), dtype=self.out_dtype)
        return self._impl(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.nvfp4_shared_mlp(x, self.id)
