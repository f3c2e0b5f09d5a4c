"""The DSv4 shared expert (`DeepseekV4MLP`: gate_up -> clamped SwiGLU -> down) as one fused runner.

Hooks in deepseek_v4.py: `DeepseekV4MLP.__init__` ends with
    self.quant_method = shared_mlp_method(self, swiglu_limit)
and `forward` starts with
    if self.quant_method is not None: return self.quant_method.apply(self, x)
`shared_mlp_method` returns None (upstream MLP unchanged) unless both projections are NVFP4
layers of `CuTeDSLNvFp4LinearMethod`. vLLM's `process_weights_after_loading(model)` calls
`module.quant_method.process_weights_after_loading(module)` for every module that has one, so the
fused `Nvfp4SharedMlp` is built once after loading, from the checkpoint-layout tensors of the two
linears; they are flagged `cutedsl_fused` so they build no runner of their own.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from cutedsl.vllm.linear_kernel import (
    RUNNER_ATTR,
    CuTeDSLNvFp4LinearMethod,
    install_runner,
    max_tokens,
)


def _global_scale(layer: torch.nn.Module, raw: str, processed: str) -> torch.Tensor:
    """A per-tensor scale before (`raw`, one per shard: keep the max, as ModelOpt does) or after
    (`processed`, 0-dim) `ModelOptNvFp4LinearMethod.process_weights_after_loading`."""
    t = getattr(layer, processed, None)
    if t is None:
        t = getattr(layer, raw)
    return t.data.max().to(torch.float32)


class CuTeDSLSharedMlpMethod(QuantizeMethodBase):
    """Runs `DeepseekV4MLP` (gate_up_proj, down_proj: NVFP4) as one `Nvfp4SharedMlp`."""

    def __init__(self, swiglu_limit: float | None) -> None:
        self.swiglu_limit = swiglu_limit
        self.max_tokens = max_tokens()

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs) -> None:
        pass  # the two linears own the weights

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from cutedsl.shared_mlp import Nvfp4SharedMlp

        gu, dn = layer.gate_up_proj, layer.down_proj
        runner = Nvfp4SharedMlp(
            gu.weight.data,
            gu.weight_scale.data,
            _global_scale(gu, "weight_scale_2", "weight_global_scale"),
            _global_scale(gu, "input_scale", "input_global_scale"),
            dn.weight.data,
            dn.weight_scale.data,
            _global_scale(dn, "weight_scale_2", "weight_global_scale"),
            _global_scale(dn, "input_scale", "input_global_scale"),
            swiglu_limit=self.swiglu_limit,
        )
        release = (gu.weight, gu.weight_scale, dn.weight, dn.weight_scale)
        install_runner(layer, runner, self.max_tokens, release)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        runner = getattr(layer, RUNNER_ATTR)
        return runner(x.reshape(-1, runner.h)).reshape(x.shape)


def shared_mlp_method(
    mlp: torch.nn.Module, swiglu_limit: float | None
) -> QuantizeMethodBase | None:
    """The fused method for a `DeepseekV4MLP` whose two linears are ours, else None."""
    linears = (mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(lin.quant_method, CuTeDSLNvFp4LinearMethod) for lin in linears):
        return None
    if mlp.down_proj.reduce_results and mlp.down_proj.tp_size > 1:
        return None  # the fused runner has no all-reduce; keep the two linears (MegaMoE + TP)
    for lin in linears:
        lin.cutedsl_fused = True
    return CuTeDSLSharedMlpMethod(swiglu_limit)
