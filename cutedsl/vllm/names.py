"""HF-transformers 5.17 / ModelOpt tensor names -> DeepSeek native names, as `WeightsMapper` rules.

`HF_TO_NATIVE_REGEX` goes first in `DeepseekV4ForCausalLM.hf_to_vllm_mapper.orig_to_new_regex`;
the upstream rules then map native names to vLLM parameters as before. Every rule is anchored at
`model.layers.{L}.` / `model.` / `lm_head.`, which no native name starts with, so a native
checkpoint maps exactly as upstream, and a rename happens at most once per name (the result no
longer starts with `model.`). The table itself is `cutedsl.names` (the one source of truth;
e.g. `model.layers.3.mlp.experts.7.gate_proj.weight_scale` ->
`layers.3.ffn.experts.7.w1.weight_scale`,
`self_attn.q_a_proj` -> `attn.wq_a`, `mlp.shared_experts.down_proj` -> `ffn.shared_experts.w2`).
Tensor leaves (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`, ...) are kept.
"""

from __future__ import annotations

import regex as re

from cutedsl.names import LAYER_MODULES, TOP_MODULES


def _module_pattern(hf: str) -> str:
    # A module path, matched whole: followed by `.leaf` or the end of the name.
    return re.escape(hf).replace(r"\{E\}", r"(\d+)") + r"(?=\.|$)"


def _build() -> dict[re.Pattern, str]:
    rules: dict[re.Pattern, str] = {}
    for native, hf in LAYER_MODULES:  # ordered: more specific first
        repl = native.replace("{E}", r"\2") if "{E}" in hf else native
        rules[re.compile(r"^model\.layers\.(\d+)\." + _module_pattern(hf))] = r"layers.\1." + repl
    for native, hf in TOP_MODULES:
        rules[re.compile("^" + _module_pattern(hf))] = native
    return rules


HF_TO_NATIVE_REGEX: dict[re.Pattern, str] = _build()
