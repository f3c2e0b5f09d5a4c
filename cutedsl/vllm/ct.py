"""compressed-tensors DeepSeek V4 checkpoints served as they are: NVFP4 experts through our
kernels, FP8 block linears through upstream's DeepSeek V4 FP8 path, the rest unquantized.

The layout is the one of RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 and its MTP variant (sources:
tests/test_checkpoint_layouts.py): what `re:.*ffn.*(gate|up|down)_proj$` matches (the routed
experts and the shared expert) `nvfp4-pack-quantized` (`.weight_packed` U8 [N, K/2],
`.weight_scale` E4M3 [N, K/16], `.weight_global_scale` and `.input_global_scale` F32 divisors),
what `re:.*attn.*(fused_wqa_wkv|wq_b|wo_a|wo_b)$` matches (indexer.wq_b too) FP8 block 128x128
(`.weight` E4M3, `.weight_scale` BF16 or F32 [N/128, K/128]), everything else BF16. Two pieces:
- `dsv4_ct_config(vllm_config)`: the quant config DSv4's attention and MoE blocks are built with
  (`cutedsl.vllm.quant.dsv4_quant_config`), a `DeepseekV4FP8Config` with `moe_quant_algo: NVFP4`
  and float32 block scales whose choice per layer is compressed-tensors' own matching of the
  checkpoint's config (its `ignore` list and `config_groups` targets, with DSv4's fused linears
  matched by their own name or through the checkpoint linears they load): unquantized ->
  upstream's unquantized method, FP8 block -> upstream's `Fp8LinearMethod`, NVFP4 routed
  experts and linears -> ours (the shared expert's two linears then run as one fused runner,
  `cutedsl.vllm.shared_mlp`). Any other scheme is refused at construction with one line naming
  the layer and config.json. A layer of an MTP block (built as `model.layers.N.*`,
  N = num_hidden_layers + J) is also matched under its checkpoint name `mtp.J.*`, which is what
  the recipes' `ignore` lists name.
- `ct_tensor(name, tensor)`: each checkpoint tensor renamed while it loads (`cutedsl.vllm.checks`)
  to the name ModelOpt gives it: `.weight_packed` -> `.weight`; `.weight_global_scale` ->
  `.weight_scale_2` and `.input_global_scale` -> `.input_scale`, each the reciprocal
  (compressed-tensors stores the global scales as divisors: vLLM 0.21.0's
  compressed_tensors_w4a4_nvfp4.py takes 1 / x too), one element of shape (1,) or (); an FP8
  block scale `.weight_scale` (not E4M3) -> `.scale`, DeepSeek's own name, which upstream's
  weights mapper turns into `.weight_scale_inv`.
Activations of the FP8 linears are quantized per token group at run time, as for DeepSeek's own
FP8 checkpoints (the recipe's FP8 group is weight-only).
"""

from __future__ import annotations

import functools
import os
import re

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
    find_matched_target,
    should_ignore_layer,
)

from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod, nvfp4_config

# DSv4's fused linears and the checkpoint linears loaded into them (DeepseekV4Model.load_weights'
# stacked_params_mapping): a target or ignore entry may name the fused module (Red Hat's targets
# do) or the checkpoint's linears (recipes' `ignore` lists, other exports).
FUSED = {"fused_wqa_wkv": ["wq_a", "wkv"], "gate_up_proj": ["w1", "w3"]}
# A routed-expert FusedMoE is matched through one expert's linears, in either naming.
_EXPERT_NAMES = ((".0.gate_proj", ".0.up_proj", ".0.down_proj"), (".0.w1", ".0.w3", ".0.w2"))
# A layer of index >= num_hidden_layers is an MTP block's (DeepSeekV4MTP builds block j as layer
# num_hidden_layers + j, under the prefix model.layers.N; it then sits at .mtp_block).
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(?:mtp_block\.)?(.+)$")
FP8, NVFP4, UNQUANTIZED = "FP8 block 128x128", "NVFP4", "unquantized"
SERVED = f"{FP8} linears, {NVFP4} routed experts, {UNQUANTIZED} layers"


def is_ct(quantization_config: object) -> bool:
    """Whether a config.json `quantization_config` is compressed-tensors'."""
    return (
        isinstance(quantization_config, dict)
        and quantization_config.get("quant_method") == "compressed-tensors"
    )


def _val(x: object) -> object:
    return getattr(x, "value", x)


def scheme_kind(scheme: dict | None) -> str:
    """FP8 / NVFP4 / UNQUANTIZED for a compressed-tensors scheme dict (None: unquantized), else
    a description of the scheme, which is not served."""
    if scheme is None:
        return UNQUANTIZED
    w, fmt = scheme.get("weights"), _val(scheme.get("format"))
    if w is None:
        return UNQUANTIZED
    bits, kind, strategy = w.num_bits, _val(w.type), _val(w.strategy)
    block = list(w.block_structure or [])
    if (bits, kind, strategy, block) == (8, "float", "block", [128, 128]):
        return FP8
    if (bits, kind, w.group_size, fmt) == (4, "float", 16, "nvfp4-pack-quantized"):
        return NVFP4
    return f"{bits}-bit {kind} {strategy} (block {w.block_structure}, group {w.group_size}, {fmt})"


def _names(prefix: str, n_layers: int) -> list[str]:
    """The names a layer is matched under: its own, and an MTP block's also its checkpoint name."""
    m = _LAYER.match(prefix)
    if m and int(m.group(1)) >= n_layers:
        return [prefix, f"mtp.{int(m.group(1)) - n_layers}.{m.group(2)}"]
    return [prefix]


@functools.cache
def _config_class() -> type:
    # the overlaid deepseek_v4.py imports this package: its class is read once it is built
    from vllm.model_executor.models.deepseek_v4 import DeepseekV4FP8Config

    class CompressedTensorsDsv4Config(DeepseekV4FP8Config):
        """DeepseekV4FP8Config (NVFP4 routed experts, float32 block scales) choosing each layer's
        method by compressed-tensors' matching of the checkpoint's config (module docstring)."""

        is_scale_e8m0 = False  # compressed-tensors block scales are BF16 / F32, not E8M0

        def __init__(self, ct: CompressedTensorsConfig, n_layers: int, config_json: str) -> None:
            super().__init__(
                is_checkpoint_fp8_serialized=True,
                activation_scheme="dynamic",
                weight_block_size=[128, 128],
            )
            self.moe_quant_algo = "NVFP4"
            self.ct, self.n_layers, self.config_json = ct, n_layers, config_json
            self.packed_modules_mapping = dict(ct.packed_modules_mapping)
            self.fused = {**ct.packed_modules_mapping, **FUSED}

        def _kind(self, layer: torch.nn.Module, name: str) -> str:
            ct = self.ct
            for n in _names(name, self.n_layers):
                if should_ignore_layer(n, ignore=ct.ignore, fused_mapping=self.fused):
                    return UNQUANTIZED
            target = find_matched_target(name, layer, ct.target_scheme_map.keys(), self.fused)
            return scheme_kind(None if target is None else ct.target_scheme_map[target])

        def _refuse(self, prefix: str, kind: str) -> NotImplementedError:
            return NotImplementedError(
                f"{self.config_json}: quantization_config (compressed-tensors) gives {prefix} "
                f"{kind}; DeepSeek V4 is served with {SERVED}"
            )

        def get_quant_method(
            self, layer: torch.nn.Module, prefix: str
        ) -> QuantizeMethodBase | None:
            if isinstance(layer, FusedMoE):
                self.ct._add_fused_moe_to_target_scheme_map()  # as upstream's MoE dispatch
                for names in _EXPERT_NAMES:
                    kinds = {self._kind(layer, prefix + n) for n in names}
                    if kinds != {UNQUANTIZED}:
                        break
                if len(kinds) > 1:
                    raise self._refuse(prefix, f"experts of several schemes ({sorted(kinds)})")
                (kind,) = kinds
                if kind == UNQUANTIZED:
                    return UnquantizedFusedMoEMethod(layer.moe_config)
                if kind != NVFP4:
                    raise self._refuse(prefix, f"routed experts {kind}")
                return super().get_quant_method(layer, prefix)  # ours (moe_quant_algo NVFP4)
            if isinstance(layer, LinearBase):
                kind = self._kind(layer, prefix)
                if kind == UNQUANTIZED:
                    return UnquantizedLinearMethod()
                if kind == NVFP4:  # the shared expert's (`re:.*ffn.*(gate|up|down)_proj$`)
                    return CuTeDSLNvFp4LinearMethod(nvfp4_config())
                if kind != FP8:
                    raise self._refuse(prefix, f"a linear {kind}")
                return super().get_quant_method(layer, prefix)  # upstream's Fp8LinearMethod
            return super().get_quant_method(layer, prefix)

    return CompressedTensorsDsv4Config


def dsv4_ct_config(vllm_config: VllmConfig) -> QuantizationConfig:
    """The config DSv4's attention and MoE blocks are built with for a compressed-tensors
    checkpoint (module docstring); one per compressed-tensors config object."""
    ct = vllm_config.quant_config
    if not isinstance(ct, CompressedTensorsConfig):
        raise TypeError(f"expected a CompressedTensorsConfig, got {type(ct).__name__}")
    cfg = getattr(ct, "_cutedsl_dsv4_config", None)
    if cfg is None:
        model = vllm_config.model_config
        config_json = os.path.join(str(model.model), "config.json")
        cfg = _config_class()(ct, int(model.hf_config.num_hidden_layers), config_json)
        ct._cutedsl_dsv4_config = cfg
    return cfg


def ct_tensor(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A compressed-tensors checkpoint tensor under the name (and value) ModelOpt's layout gives
    it (module docstring); other tensors unchanged."""
    head, _, leaf = name.rpartition(".")
    if leaf == "weight_packed":
        return f"{head}.weight", t
    if leaf == "weight_global_scale":
        return f"{head}.weight_scale_2", (1.0 / t.float()).reshape(())
    if leaf == "input_global_scale":
        return f"{head}.input_scale", (1.0 / t.float()).reshape(())
    if leaf == "weight_scale" and t.dtype != torch.float8_e4m3fn:
        return f"{head}.scale", t
    return name, t
