"""`CuTeDSLNvFp4LinearKernel`: vLLM's `NvFp4LinearKernel` interface over our runners.

Selected explicitly (not through `_POSSIBLE_NVFP4_KERNELS`, which would change every NVFP4 model
in the process): `cutedsl.vllm.quant` gives DSv4's layers a `ModelOptNvFp4Config` whose
`LinearMethodCls` is `CuTeDSLNvFp4LinearMethod`, the ModelOpt method with this kernel in place of
`init_nvfp4_linear_kernel()`. Weight creation, loading and the global-scale bookkeeping stay
upstream's (`ModelOptNvFp4LinearMethod`); the kernel then builds one runner per layer from the
checkpoint-layout tensors:
  - a layer flagged `is_bmm` (DSv4 wo_a, `bmm_batch_size` = local groups G) -> `Nvfp4GroupedOproj`,
    consumed by the attention wrapper through `cutedsl.vllm.oproj` (never by `apply_weights`);
  - a layer flagged `cutedsl_fused` (the shared expert's gate_up/down, run by one fused runner
    built by `cutedsl.vllm.shared_mlp`) -> no runner of its own;
  - any other layer (fused_wqa_wkv, wq_b, wo_b, indexer wq_b) -> `Nvfp4Linear`.
Layer attributes read (set by `ModelOptNvFp4LinearMethod.process_weights_after_loading`):
weight u8 [N, K//2], weight_scale e4m3 [N, K//16], weight_global_scale fp32 (), input_global_scale
fp32 (). The runner's backend (sm100 / sm90 / reference) follows the device and
$CUTEDSL_BACKEND (`cutedsl.backends`). A GPU backend repacks the weights into its own layout at
load; `install_runner` then turns the layer's weight and weight_scale into zero-stride
placeholders (`release_checkpoint_tensors`), so they are not held twice. The reference backend
reads the checkpoint tensors at every call: they stay.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from vllm.model_executor.kernels.linear.nvfp4.base import (
    NvFp4LinearKernel,
    NvFp4LinearLayerConfig,
)
from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptNvFp4Config,
    ModelOptNvFp4LinearMethod,
)

RUNNER_ATTR = "cutedsl_runner"


def max_tokens() -> int:
    """Rows a runner must handle: read at model construction (the current vLLM config is set)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().scheduler_config.max_num_batched_tokens


@functools.cache
def nvfp4_config() -> ModelOptNvFp4Config:
    """The ModelOpt NVFP4 config (blocks of 16) of the NVFP4 layers in a checkpoint whose own
    config is another method's (NVIDIA's mixed and compressed-tensors layouts), loaded under
    ModelOpt's tensor names."""
    return ModelOptNvFp4Config("NVFP4", is_checkpoint_nvfp4_serialized=True, group_size=16)


def _head_dim() -> int:
    """The attention head_dim of the model being loaded (sizes wo_a's inverse RoPE)."""
    from vllm.config import get_current_vllm_config

    return int(get_current_vllm_config().model_config.hf_config.head_dim)


def release_checkpoint_tensors(runner, tensors: Iterable[torch.Tensor]) -> None:
    """Once `runner` runs a GPU backend (its impl holds its own prepared copies and the runner has
    let go of the checkpoint layout, `Runner.checkpoint_tensors`), make each of `tensors` (the
    layer's parameters it was built from) a zero-stride placeholder of the same shape, dtype and
    device: one element of storage. vLLM reads only their shapes from here on (the MoE modular
    kernel's problem size); upstream's own NVFP4 / MXFP4 methods likewise replace or delete the
    checkpoint tensors after repacking. Nothing for the reference backend, which reads them at
    every call."""
    if runner.backend == "reference":
        return
    for t in tensors:
        t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def install_runner(
    layer: torch.nn.Module, runner, max_tokens: int, release: Iterable[torch.Tensor] = ()
) -> None:
    """Keep `runner` on its layer (the ops registry holds runners weakly), compile its kernels
    now, at load time, for up to `max_tokens` rows (never during CUDA-graph capture), and let go
    of the checkpoint-layout tensors in `release` (`release_checkpoint_tensors`)."""
    setattr(layer, RUNNER_ATTR, runner)
    runner.warmup(max_tokens)
    release_checkpoint_tensors(runner, release)


class CuTeDSLNvFp4LinearKernel(NvFp4LinearKernel):
    """NVFP4 linear through `cutedsl.linear.Nvfp4Linear` (or the grouped o-projection for wo_a)."""

    def __init__(self, config: NvFp4LinearLayerConfig) -> None:
        super().__init__(config)
        self.max_tokens = max_tokens()

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        # Every device: sm100 / sm90 kernels, else the torch reference; the runner raises
        # BackendUnavailableError for a forced backend that cannot run.
        return True, None

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "cutedsl_fused", False):
            return
        args = (layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data,
                layer.input_global_scale.data)  # fmt: skip
        if getattr(layer, "is_bmm", False):
            from cutedsl.grouped_oproj import Nvfp4GroupedOproj

            runner = Nvfp4GroupedOproj(*args, n_groups=layer.bmm_batch_size, head_dim=_head_dim())
        else:
            from cutedsl.linear import Nvfp4Linear

            runner = Nvfp4Linear(*args)
        install_runner(layer, runner, self.max_tokens, (layer.weight, layer.weight_scale))

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        runner = getattr(layer, RUNNER_ATTR, None)
        if runner is None or getattr(layer, "is_bmm", False):
            raise NotImplementedError(
                f"{type(self).__name__}: this layer has no linear runner (is_bmm wo_a is run by "
                "cutedsl.vllm.oproj, a fused shared-expert linear by its DeepseekV4MLP)"
            )
        y = runner(x.reshape(-1, runner.k)).reshape(*x.shape[:-1], runner.n)
        return y if bias is None else y + bias


@register_weight_loader_v2_supported_method  # as upstream's (LinearBase checks the class name)
class CuTeDSLNvFp4LinearMethod(ModelOptNvFp4LinearMethod):
    """`ModelOptNvFp4LinearMethod` with `CuTeDSLNvFp4LinearKernel` as its kernel."""

    def __init__(self, quant_config: ModelOptNvFp4Config) -> None:
        # Not super().__init__(): it runs init_nvfp4_linear_kernel() (and logs its choice).
        self.quant_config = quant_config
        self.marlin_input_dtype = None
        self.kernel = CuTeDSLNvFp4LinearKernel(NvFp4LinearLayerConfig())
