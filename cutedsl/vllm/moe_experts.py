"""DSv4 routed experts on NVFP4 weights: `CuTeDSLMoEExperts` (a `FusedMoEExpertsModular`, shaped
like vLLM's `FlashInferCuteDSLExperts`) over `cutedsl.moe.Nvfp4MoE`, with the SwiGLU clamp.

vLLM 0.21.0 has no registry for MoE backends (the NVFP4 oracle's enum, `--moe-backend` names and
format conversions are closed lists in oracle/nvfp4.py and config/kernel.py, outside our two
overlaid files). So the experts are not picked by `select_nvfp4_moe_backend`; the FusedMoE
gets `CuTeDSLModelOptNvFp4FusedMoE`, a `ModelOptNvFp4FusedMoE` whose kernel is built after
loading by vLLM's own `make_nvfp4_moe_kernel(quant_config, moe_config, CuTeDSLMoEExperts, ...)`
(prepare/finalize, shared experts and routing unchanged). `cutedsl.vllm.quant` chooses it for
`--moe-backend auto` (the default); naming an upstream backend (marlin, cutlass, flashinfer_*,
emulation) gets upstream's `ModelOptNvFp4FusedMoE`, which drops the clamp in 0.21.0 (a warning
says so).

Routing (hash-routed and score-routed layers alike) runs before the experts: `apply` receives
topk_ids int32 [M, topk] (global ids; `expert_map` maps them to local ids, −1 = elsewhere) and
topk_weights f32 [M, topk] (renormalised × routed_scaling_factor), and bf16 hidden states
(`expects_unquantized_inputs`: the runner quantizes itself on sm100). It writes
output[M, H] = Σ_j w_j · expert_j(x) (so the finalize step is a no-op).
The clamp limit travels in the quant config's `gemm1_clamp_limit` (from `FusedMoE.swiglu_limit`).
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import make_nvfp4_moe_kernel
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptNvFp4Config,
    ModelOptNvFp4FusedMoE,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kNvfp4Dynamic,
    kNvfp4Static,
)
from vllm.model_executor.utils import replace_parameter

from cutedsl.vllm.linear_kernel import install_runner

logger = init_logger(__name__)


class CuTeDSLMoEExperts(mk.FusedMoEExpertsModular):
    """NVFP4 routed experts through `cutedsl.moe.Nvfp4MoE` (sm100 / sm90 / reference backend)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> None:
        super().__init__(moe_config=moe_config, quant_config=quant_config)
        self.hidden_dim = moe_config.hidden_dim
        self.swiglu_limit = quant_config.gemm1_clamp_limit
        self.runner = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from cutedsl.moe import Nvfp4MoE

        self.runner = Nvfp4MoE(
            layer.w13_weight.data, layer.w13_weight_scale.data,
            layer.w13_weight_scale_2.data, layer.w13_input_scale.data,
            layer.w2_weight.data, layer.w2_weight_scale.data,
            layer.w2_weight_scale_2.data, layer.w2_input_scale.data,
            swiglu_limit=self.swiglu_limit,
        )  # fmt: skip
        release = (layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale)
        max_tokens = layer.vllm_config.scheduler_config.max_num_batched_tokens
        install_runner(layer, self.runner, max_tokens, release)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # sm100 / sm90 kernels, else the torch reference (cutedsl.backends)

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None, activation_key: QuantKey | None
    ) -> bool:
        return weight_key == kNvfp4Static and activation_key in (kNvfp4Dynamic, None)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not moe_parallel_config.use_batched_activation_format

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(
        self, M: int, N: int, K: int, topk: int, global_num_experts: int, local_num_experts: int,
        expert_tokens_meta: mk.ExpertTokensMetadata | None, activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:  # fmt: skip
        return (0,), (0,), (M, self.hidden_dim)

    def apply(
        self,
        output: torch.Tensor,  # (M, H) bf16, written
        hidden_states: torch.Tensor,  # (M, H) bf16
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,  # (M, topk) f32
        topk_ids: torch.Tensor,  # (M, topk) int32, global expert ids
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,  # (global E,) int32 local id or -1
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor | None,
        workspace2: torch.Tensor | None,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool | None,
    ) -> None:
        if apply_router_weight_on_input:
            raise NotImplementedError(f"{type(self).__name__}: apply_router_weight_on_input")
        local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
        self.runner(hidden_states, local_ids, topk_weights, output)


class CuTeDSLModelOptNvFp4FusedMoE(ModelOptNvFp4FusedMoE):
    """`ModelOptNvFp4FusedMoE` (same parameters and loading) with `CuTeDSLMoEExperts` as experts.

    The name must contain "ModelOpt": `FusedMoE.weight_loader` picks the per-tensor scale loading
    of `weight_scale_2` / `input_scale` by `"ModelOpt" in type(quant_method).__name__`.
    """

    def __init__(self, quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig) -> None:
        # Not super().__init__(): it runs the NVFP4 oracle (select_nvfp4_moe_backend).
        FusedMoEMethodBase.__init__(self, moe_config)
        self.quant_config = quant_config
        self.nvfp4_backend = None
        self.experts_cls = CuTeDSLMoEExperts
        self.use_global_sf = False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Checkpoint layout kept; one global scale per expert and GEMM (w1 and w3 share theirs).
        if not torch.equal(layer.w13_weight_scale_2[:, 0], layer.w13_weight_scale_2[:, 1]):
            logger.warning_once("w1 and w3 weight_scale_2 differ; using their max per expert.")
        for name in ("w13_weight_scale_2", "w13_input_scale"):
            replace_parameter(layer, name, getattr(layer, name).amax(dim=1).contiguous())
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = make_nvfp4_moe_kernel(
            moe_quant_config=self.moe_quant_config,
            moe_config=self.moe,
            experts_cls=CuTeDSLMoEExperts,
            shared_experts=layer.shared_experts,
            routing_tables=layer._maybe_init_expert_routing_tables(),
        )
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        # quant_dtype None: prepare passes bf16 activations through (W4A16-style, like Marlin's
        # nvfp4_w4a16_moe_quant_config); scales in checkpoint layout; the clamp for the experts.
        return FusedMoEQuantConfig.make(
            quant_dtype=None,
            w1_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
            g1_alphas=layer.w13_weight_scale_2,
            g2_alphas=layer.w2_weight_scale_2,
            weight_dtype="nvfp4",
            gemm1_clamp_limit=layer.swiglu_limit,
        )


def nvfp4_moe_method(
    quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig
) -> ModelOptNvFp4FusedMoE:
    """Ours for `--moe-backend auto`; upstream's oracle for an explicitly named backend."""
    if moe_config.moe_backend == "auto":
        return CuTeDSLModelOptNvFp4FusedMoE(quant_config, moe_config)
    logger.warning_once(
        "--moe-backend %s: DeepSeek V4 NVFP4 experts run vLLM's own backend, which in 0.21.0 "
        "does not apply the SwiGLU clamp (swiglu_limit); use 'auto' for the CuTeDSL experts.",
        moe_config.moe_backend,
    )
    return ModelOptNvFp4FusedMoE(quant_config, moe_config)
