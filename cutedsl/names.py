"""The one place that maps DeepSeek V4 checkpoint names between the two naming schemes.

Runtime code (the vLLM integration's `cutedsl.vllm.names`) and the tools (`cutedsl.tools`) both
read the tables here: `LAYER_MODULES` and `TOP_MODULES` are public.

Schemes:
  native  DeepSeek's own names, as in deepseek-ai/DeepSeek-V4-Flash and as vLLM 0.21.0's
          `DeepseekV4ForCausalLM.hf_to_vllm_mapper` expects them:
          `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.7.w1.weight`, `embed.weight`, ...
  hf      HF transformers 5.17.0 `DeepseekV4ForCausalLM` module names, i.e. what a ModelOpt export
          of the HF model looks like: `model.layers.3.self_attn.q_a_proj.weight`,
          `model.layers.3.mlp.experts.7.gate_proj.weight` (experts unfused, one module per
          expert), `model.embed_tokens.weight`, `lm_head.weight`, ...

Only the module path is renamed; the tensor leaf (`weight`, `scale`, `weight_scale`,
`weight_scale_2`, `input_scale`) is kept as is in both schemes, so the mapping is a bijection
that needs no knowledge of the quantization format. The derivation follows transformers
5.17.0's `conversion_mapping.py["deepseek_v4"]` (native -> HF renames) and the module tree of
`modeling_deepseek_v4.py`; tests/test_tiny_model.py checks it against both.

The HF model stores the routed experts fused as 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2I, H] = cat(w1, w3) along dim 1, `mlp.experts.down_proj`
[E, H, I]); `hf_expert_param` names those for the golden loader.
"""

from __future__ import annotations

import re

__all__ = [
    "QUANT_LEAVES",
    "LAYER_MODULES",
    "TOP_MODULES",
    "split_leaf",
    "native_to_hf",
    "hf_to_native",
    "to_scheme",
    "detect_scheme",
    "hf_expert_param",
]

# Tensor leaves that belong to a quantized linear (kept verbatim by the mapping).
QUANT_LEAVES = (
    "weight",
    "scale",
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "weight_scale_inv",
)

# (native module path relative to `layers.{L}.`, hf module path relative to `model.layers.{L}.`)
# Ordered: more specific first. `{E}` is an expert index.
LAYER_MODULES: tuple[tuple[str, str], ...] = (
    ("attn.indexer.compressor.wkv", "self_attn.compressor.indexer.kv_proj"),
    ("attn.indexer.compressor.wgate", "self_attn.compressor.indexer.gate_proj"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm", "self_attn.compressor.indexer.kv_norm"),
    ("attn.indexer.wq_b", "self_attn.compressor.indexer.q_b_proj"),
    ("attn.indexer.weights_proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    ("attn.compressor.wkv", "self_attn.compressor.kv_proj"),
    ("attn.compressor.wgate", "self_attn.compressor.gate_proj"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm", "self_attn.compressor.kv_norm"),
    ("attn.wq_a", "self_attn.q_a_proj"),
    ("attn.q_norm", "self_attn.q_a_norm"),
    ("attn.wq_b", "self_attn.q_b_proj"),
    ("attn.wkv", "self_attn.kv_proj"),
    ("attn.kv_norm", "self_attn.kv_norm"),
    ("attn.wo_a", "self_attn.o_a_proj"),
    ("attn.wo_b", "self_attn.o_b_proj"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.gate", "mlp.gate"),
    ("ffn.shared_experts.w1", "mlp.shared_experts.gate_proj"),
    ("ffn.shared_experts.w3", "mlp.shared_experts.up_proj"),
    ("ffn.shared_experts.w2", "mlp.shared_experts.down_proj"),
    ("ffn.experts.{E}.w1", "mlp.experts.{E}.gate_proj"),
    ("ffn.experts.{E}.w3", "mlp.experts.{E}.up_proj"),
    ("ffn.experts.{E}.w2", "mlp.experts.{E}.down_proj"),
)

TOP_MODULES: tuple[tuple[str, str], ...] = (
    ("embed", "model.embed_tokens"),
    ("norm", "model.norm"),
    ("head", "lm_head"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{E\}", r"(?P<E>\d+)"))


_N2H = [(_compile(n), h) for n, h in LAYER_MODULES]
_H2N = [(_compile(h), n) for n, h in LAYER_MODULES]
_TOP_N2H = dict(TOP_MODULES)
_TOP_H2N = {h: n for n, h in TOP_MODULES}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def split_leaf(name: str) -> tuple[str, str]:
    """Split `a.b.c.weight_scale` into (`a.b.c`, `weight_scale`); bare params give (name, "")."""
    head, _, leaf = name.rpartition(".")
    if head and leaf in QUANT_LEAVES:
        return head, leaf
    return name, ""


def _map_module(module: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pat, repl in table:
        m = pat.fullmatch(module)
        if m:
            return repl.replace("{E}", m.group("E")) if "E" in pat.groupindex else repl
    return None


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if leaf else module


def _convert(name: str, top: dict[str, str], layer_re: re.Pattern[str], table, prefix: str):
    # Try the whole name as a bare parameter first (e.g. HF `attn_hc.scale`), then module + leaf.
    for module, leaf in ((name, ""), split_leaf(name)):
        if module in top:
            return _join(top[module], leaf)
        m = layer_re.match(module)
        if m:
            mapped = _map_module(m.group(2), table)
            if mapped is not None:
                return _join(f"{prefix}{m.group(1)}.{mapped}", leaf)
    return None


def native_to_hf(name: str) -> str:
    """Native DeepSeek tensor name -> HF transformers 5.17 name. Raises KeyError if unknown."""
    out = _convert(name, _TOP_N2H, _NATIVE_LAYER, _N2H, "model.layers.")
    if out is None:
        raise KeyError(f"not a DeepSeek V4 native tensor name: {name!r}")
    return out


def hf_to_native(name: str) -> str:
    """HF transformers 5.17 tensor name -> native DeepSeek name. Raises KeyError if unknown."""
    out = _convert(name, _TOP_H2N, _HF_LAYER, _H2N, "layers.")
    if out is None:
        raise KeyError(f"not a DeepSeek V4 HF tensor name: {name!r}")
    return out


def to_scheme(native_name: str, scheme: str) -> str:
    """Native name -> the name in `scheme` ("native" or "hf")."""
    if scheme == "native":
        return native_name
    if scheme == "hf":
        return native_to_hf(native_name)
    raise ValueError(f"unknown naming scheme {scheme!r}; expected 'native' or 'hf'")


def detect_scheme(names: list[str] | set[str]) -> str:
    """Return "native" or "hf" for a checkpoint's tensor names; ValueError if mixed/unknown."""
    hf = sum(1 for n in names if n.startswith(("model.", "lm_head.")))
    if hf == len(names) and hf > 0:
        return "hf"
    if hf == 0 and len(names) > 0:
        return "native"
    raise ValueError(
        f"cannot tell the naming scheme: {hf} of {len(names)} tensor names look HF-style "
        "('model.'/'lm_head.' prefix); a checkpoint must use one scheme throughout"
    )


def hf_expert_param(layer: int, which: str) -> str:
    """HF fused expert parameter of layer `layer`: which in {"gate_up_proj", "down_proj"}."""
    if which not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"which must be 'gate_up_proj' or 'down_proj', got {which!r}")
    return f"model.layers.{layer}.mlp.experts.{which}"
