"""Which quantization DSv4's layers get (called from the overlaid deepseek_v4.py).

- Full ModelOpt NVFP4 checkpoints (`quant_method: modelopt`, `quant_algo: NVFP4`) resolve, as
  upstream, to `ModelOptNvFp4Config`. `dsv4_quant_config` gives DeepseekV4Attention / DeepseekV4MoE
  a copy of it whose `LinearMethodCls` is `CuTeDSLNvFp4LinearMethod` and whose
  `FusedMoEMethodCls` is `nvfp4_moe_method` (`CuTeDSLModelOptNvFp4FusedMoE` for `--moe-backend
  auto`). These two attributes are ModelOptQuantConfigBase's own override points;
  `get_quant_method` stays upstream's, so `ignore` / `exclude_modules` work unchanged.
- NVIDIA's mixed checkpoints (`quant_method: fp8` + `moe_quant_algo: NVFP4`) resolve to
  `DeepseekV4FP8Config`; the routed experts its `quantized_layers` names (all of them where the
  config has no such list) get `nvfp4_moe_method_for_fp8_config`; the rest keep upstream's methods
  (the MTP block's MXFP4 experts, FP8 block linears everywhere else).
- compressed-tensors checkpoints (RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 and its MTP variant) get
  `cutedsl.vllm.ct.dsv4_ct_config`: NVFP4 routed and shared experts ours, FP8 block linears
  upstream's, each layer's scheme read from the checkpoint's own compressed-tensors config;
  their tensors are renamed while loading (`cutedsl.vllm.ct`).
- Anything else (native FP8 + MXFP4, FP8 experts, bf16 / no quantization, W4A16_NVFP4) is returned
  as is: upstream behaviour exactly.
"""

from __future__ import annotations

import copy

from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

from cutedsl.vllm.ct import dsv4_ct_config
from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod, nvfp4_config
from cutedsl.vllm.moe_experts import nvfp4_moe_method


def dsv4_quant_config(vllm_config: VllmConfig) -> QuantizationConfig | None:
    """The quant config DSv4's attention and MoE modules build their layers with."""
    qc = vllm_config.quant_config
    if isinstance(qc, CompressedTensorsConfig):
        return dsv4_ct_config(vllm_config)
    if type(qc) is not ModelOptNvFp4Config or qc.quant_method != "NVFP4":
        return qc  # W4A16_NVFP4 keeps upstream's Marlin method
    ours = copy.copy(qc)
    ours.LinearMethodCls = CuTeDSLNvFp4LinearMethod
    ours.FusedMoEMethodCls = nvfp4_moe_method  # called as (quant_config=, moe_config=)
    return ours


def nvfp4_moe_method_for_fp8_config(layer: FusedMoE) -> QuantizeMethodBase:
    """Routed experts of a `quant_method: fp8, moe_quant_algo: NVFP4` checkpoint: per expert
    `weight` u8, `weight_scale` e4m3 (blocks of 16), `weight_scale_2`, `input_scale` f32."""
    return nvfp4_moe_method(nvfp4_config(), layer.moe_config)


def is_nvfp4_experts(prefix: str, quantized_layers: dict | None) -> bool:
    """Whether the FusedMoE at vLLM `prefix` (`model.layers.3.ffn.experts`) holds NVFP4 experts in
    a checkpoint whose config lists them in ModelOpt's `quantized_layers`: by module
    (`layers.3.ffn.experts`, as NVIDIA's DeepSeek-V4 NVFP4 repositories write it) or by projection
    (`layers.3.ffn.experts.0.w1`, ModelOpt's per-linear form of an earlier revision); a leading
    `model.` is ignored. The MTP block (`model.layers.{L}.mtp_block.ffn.experts`) is never listed.
    No list: every routed expert is NVFP4."""
    if quantized_layers is None:
        return True
    module = prefix.removeprefix("model.")
    names = (k.removeprefix("model.") for k in quantized_layers)
    return any(k == module or k.startswith(module + ".") for k in names)
