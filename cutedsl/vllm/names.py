"""HF-transformers 5.17 / ModelOpt tensor names -> DeepSeek native names, as a `WeightsMapper` rule.

`HF_TO_NATIVE_REGEX` goes first in `DeepseekV4ForCausalLM.hf_to_vllm_mapper.orig_to_new_regex`;
the upstream rules then map native names to vLLM parameters as before. It is one pattern, matching
a whole name that starts with `model.` or `lm_head.` (which no native name does), whose
replacement is `hf_to_native(name)`: the first of the per-module rules (`RULES`, each anchored at
`model.layers.{L}.` / `model.` / `lm_head.`) that matches, applied once (the result no longer
starts with `model.`). So a native checkpoint maps exactly as upstream, and the mapper tests each
of the hundreds of thousands of names of a full checkpoint against one pattern, not against every
module rule. The table itself is `cutedsl.names` (the one source of truth;
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


RULES: dict[re.Pattern, str] = _build()
_HF = re.compile(r"^(?:model|lm_head)\..*$")


def hf_to_native(name: str | re.Match) -> str:
    """The native name of an HF / ModelOpt tensor name (a name no rule matches is unchanged);
    also the mapper's replacement function (it is given the whole-name match)."""
    if not isinstance(name, str):
        name = name.group(0)
    if not name.startswith(("model.", "lm_head.")):
        return name
    for pattern, repl in RULES.items():
        if pattern.search(name):
            return pattern.sub(repl, name)
    return name


HF_TO_NATIVE_REGEX: dict[re.Pattern, object] = {_HF: hf_to_native}


_EXPERT_KEY = re.compile(r"experts\.\d+\.[^.]+\.")
_expert_index: list = [None, {}]  # [the mapping list indexed, its index]


def expert_mappings(mapping: list[tuple[str, str, int, str]], name: str) -> list:
    """The entries of an expert params mapping ((param_name, weight_name, expert_id, shard_id),
    FusedMoE.make_expert_params_mapping) whose weight_name is in `name`, in mapping order: what
    DeepseekV4Model.load_weights' scan over all 3 x E entries finds, by an index of the mapping
    (built once per mapping list) instead of one substring test per entry and tensor."""
    if _expert_index[0] is not mapping:
        index: dict[str, list] = {}
        for entry in mapping:  # weight_name = experts.{id}.{w}.[base_layer.]
            m = _EXPERT_KEY.match(entry[1])
            index.setdefault(m.group(0) if m else None, []).append(entry)
        _expert_index[:] = [mapping, index]
    index = _expert_index[1]
    m = _EXPERT_KEY.search(name)
    if m is None or None in index or m.group(0) not in index:
        return [e for e in mapping if e[1] in name]  # an unusual name or mapping: the scan
    return [e for e in index[m.group(0)] if e[1] in name]
