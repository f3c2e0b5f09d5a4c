"""The DeepSeek V4 checkpoint schema the tools share: config keys and their types, the vLLM
0.21.0 constraints on their values, and the tensor layout a config implies in each format.

Formats (how each quantizable projection is stored; everything else is the same in all):
  native        FP8 block-128 e4m3 + e8m0 `.scale`; MXFP4 routed experts (DeepSeek's V4-Flash).
  native-fp8    FP8 block everywhere, f32 `.scale` (`expert_dtype: fp8`, V4-Flash-Base).
  nvfp4         ModelOpt NVFP4 for every quantizable projection.
  nvidia-mixed  NVIDIA ModelOpt's published DSv4 layout (nvidia/DeepSeek-V4-Flash-NVFP4, -Pro-NVFP4):
                DeepSeek's native checkpoint with the main layers' routed experts in ModelOpt
                NVFP4 (the MTP block's stay MXFP4), config.json `quantization_config` = DeepSeek's
                FP8 block config + `moe_quant_algo: NVFP4` and ModelOpt's keys (`quantized_layers`,
                `ignore`), and an `hf_quant_config.json` manifest.
  ct-nvfp4-fp8  compressed-tensors (RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8): routed and shared
                experts `nvfp4-pack-quantized` (`weight_packed`, `weight_scale`,
                `weight_global_scale`, `input_global_scale` of shape (1,); global scales are
                divisors, 1 / ModelOpt's), attention wq_a/wkv/wq_b/wo_a/wo_b and indexer.wq_b FP8
                block 128 (`weight` e4m3 + BF16 `weight_scale`), the rest BF16; an MTP block (the
                canada-quant variant) is BF16.
  bf16          every weight BF16, no quantization_config.

MTP: with `num_nextn_predict_layers` = n >= 1 a checkpoint also holds `mtp.{0..n-1}.*`: one decoder
block (layer index num_hidden_layers + i for its compress ratio and routing) plus e_proj, h_proj,
enorm, hnorm, norm, hc_head_{fn,base,scale}, emb.tok_emb and head (the names vLLM 0.21.0's
deepseek_v4_mtp.py and DeepSeek's inference/model.py `MTPBlock` use). Sources for every layout:
tests/test_checkpoint_layouts.py.
"""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass

import torch

from cutedsl import names as N
from cutedsl.tools.cli import UsageError

__all__ = [
    "FORMATS",
    "MODEL_TYPE",
    "CONFIG_SCHEMA",
    "REQUIRED_KEYS",
    "ConfigError",
    "validate_config",
    "check_config",
    "Spec",
    "tensor_specs",
    "mtp_layers",
    "storage_of",
    "PLAIN_DTYPES",
    "linear_tensors",
    "expected_tensors",
    "quantization_config",
    "hf_quant_config",
    "NVIDIA_IGNORE",
    "make_config_like",
    "detect_format",
]

FORMATS = ("native", "native-fp8", "nvfp4", "nvidia-mixed", "ct-nvfp4-fp8", "bf16")
MODEL_TYPE = "deepseek_v4"


class ConfigError(UsageError):
    """A config that is not a DeepSeek V4 config vLLM 0.21.0 can serve (names the key)."""


# --------------------------------------------------------------------------------------------
# Config keys and types

# key -> type: "int" (>= 0), "pos" (int >= 1), "float" (finite number), "bool", "str",
# "dict", "list[int]", "list[str]", "int|list[int]", "int|null", "any".
CONFIG_SCHEMA: dict[str, str] = {
    # Read by vLLM 0.21.0's DeepseekV4 model and by the tools (native DeepSeek keys).
    "architectures": "list[str]",
    "model_type": "str",
    "torch_dtype": "str",
    "dtype": "str",
    "vocab_size": "pos",
    "hidden_size": "pos",
    "num_hidden_layers": "pos",
    "num_attention_heads": "pos",
    "num_key_value_heads": "pos",
    "head_dim": "pos",
    "qk_rope_head_dim": "pos",
    "q_lora_rank": "pos",
    "o_groups": "pos",
    "o_lora_rank": "pos",
    "sliding_window": "pos",
    "compress_ratios": "list[int]",
    "compress_rope_theta": "float",
    "rope_theta": "float",
    "rope_scaling": "dict",
    "max_position_embeddings": "pos",
    "rms_norm_eps": "float",
    "index_n_heads": "pos",
    "index_head_dim": "pos",
    "index_topk": "pos",
    "hc_mult": "pos",
    "hc_sinkhorn_iters": "pos",
    "hc_eps": "float",
    "n_routed_experts": "pos",
    "n_shared_experts": "pos",
    "num_experts_per_tok": "pos",
    "moe_intermediate_size": "pos",
    "num_hash_layers": "int",
    "scoring_func": "str",
    "topk_method": "str",
    "norm_topk_prob": "bool",
    "routed_scaling_factor": "float",
    "swiglu_limit": "float",
    "hidden_act": "str",
    "num_nextn_predict_layers": "int",
    "tie_word_embeddings": "bool",
    "bos_token_id": "int|null",
    "eos_token_id": "int|list[int]",
    "pad_token_id": "int|null",
    "quantization_config": "dict",
    "expert_dtype": "str",
    # Further keys of transformers 5.17.0's DeepseekV4Config (vLLM reads the config through it).
    "transformers_version": "str",
    "layer_types": "list[str]",
    "mlp_layer_types": "list[str]",
    "compress_rates": "dict",
    "rope_parameters": "dict",
    "partial_rotary_factor": "float",
    "initializer_range": "float",
    "use_cache": "bool",
    "attention_bias": "bool",
    "mlp_bias": "bool",
    "attention_dropout": "float",
    "output_router_logits": "bool",
    "router_aux_loss_coef": "float",
    "router_jitter_noise": "float",
}

# What tensor_specs and check_config read: a config without one of these is not a DSv4 config.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "compress_ratios",
    "rope_scaling",
    "index_n_heads",
    "index_head_dim",
    "hc_mult",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "num_hash_layers",
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_error(key: str, kind: str, v: object) -> str | None:
    """Why value v does not fit `kind`, or None."""
    if kind == "any":
        return None
    if "|" in kind:
        errs = [_type_error(key, k, v) for k in kind.split("|")]
        return None if None in errs else f"{key} must be {kind.replace('|', ' or ')}, got {v!r}"
    if kind == "null":
        return None if v is None else "not null"
    if kind in ("int", "pos"):
        if not _is_int(v):
            return f"{key} must be an integer, got {v!r} ({type(v).__name__})"
        if v < (1 if kind == "pos" else 0):
            return f"{key} must be >= {1 if kind == 'pos' else 0}, got {v}"
        return None
    if kind == "float":
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            return f"{key} must be a finite number, got {v!r} ({type(v).__name__})"
        return None
    simple = {"bool": bool, "str": str, "dict": dict}
    if kind in simple:
        if not isinstance(v, simple[kind]):
            return f"{key} must be a {kind}, got {v!r} ({type(v).__name__})"
        return None
    if kind in ("list[int]", "list[str]"):
        ok = _is_int if kind == "list[int]" else (lambda x: isinstance(x, str))
        if not isinstance(v, list) or not all(ok(x) for x in v):
            return f"{key} must be a {kind} (JSON array), got {v!r}"
        return None
    raise AssertionError(f"unknown schema type {kind!r}")


def validate_config(
    cfg: object, where: str = "config", unknown_keys: bool = False, required: bool = True
) -> None:
    """Raise ConfigError (one line, naming the key and `where`) if cfg is no DSv4 config.

    unknown_keys: accept keys outside CONFIG_SCHEMA (a shipped config.json carries more; an
    override must not). required: every key of REQUIRED_KEYS must be present.
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type", MODEL_TYPE if not required else None)
    if mt != MODEL_TYPE:
        raise ConfigError(
            f"{where}: model_type {mt!r} is not DeepSeek V4 (expected {MODEL_TYPE!r})"
        )
    for key, v in cfg.items():
        kind = CONFIG_SCHEMA.get(key)
        if kind is None:
            if unknown_keys:
                continue
            close = difflib.get_close_matches(key, list(CONFIG_SCHEMA), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown DeepSeek V4 config key {key!r}{hint}")
        err = _type_error(key, kind, v)
        if err:
            raise ConfigError(f"{where}: {err}")
    if required:
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ConfigError(
                f"{where}: missing DeepSeek V4 config key {missing[0]!r}"
                + (f" ({len(missing)} missing in all)" if len(missing) > 1 else "")
            )


def check_config(cfg: dict) -> None:
    """Raise ConfigError if `cfg` is no DSv4 config or breaks a vLLM 0.21.0 DSv4 constraint."""
    validate_config(cfg, unknown_keys=True)
    errors = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    H, NH, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    G, R, Q = cfg["o_groups"], cfg["o_lora_rank"], cfg["q_lora_rank"]
    L = cfg["num_hidden_layers"]
    need(D == 512, f"head_dim={D}, expected 512 (fp8_ds_mla cache, FlashMLA head_dim_v)")
    need(cfg["qk_rope_head_dim"] == 64, "qk_rope_head_dim must be 64 (nope 448 + rope 64)")
    need(H % 256 == 0, f"hidden_size={H}, expected a multiple of 256 (Marlin MXFP4 MoE)")
    need(512 % math.gcd(512, H) == 0, "hidden_size: mHC block gcd(512, H)")
    need(Q % 128 == 0, f"q_lora_rank={Q}, expected a multiple of 128 (FP8 block)")
    need(R % 128 == 0, f"o_lora_rank={R}, expected a multiple of 128 (fp8_einsum scale view)")
    need(NH % G == 0, f"o_groups={G} must divide num_attention_heads={NH}")
    need(NH <= 128, f"num_attention_heads={NH}, expected <= 128 per rank")
    need((NH * D // G) % 128 == 0, "wo_a K = NH*head_dim/o_groups must be a multiple of 128")
    need(cfg["moe_intermediate_size"] % 128 == 0, "moe_intermediate_size must be % 128")
    need(cfg["index_head_dim"] == 128, "index_head_dim must be 128 (compressor head-128 path)")
    need(cfg["index_n_heads"] == 64, "index_n_heads must be 64 (DeepGEMM mqa logits)")
    need(cfg["hc_mult"] == 4, "hc_mult must be 4")
    need(cfg["sliding_window"] == 128, "sliding_window must be 128")
    ratios = cfg["compress_ratios"]
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    need(
        len(ratios) >= L + n_mtp,
        f"compress_ratios has {len(ratios)} entries < num_hidden_layers + "
        f"num_nextn_predict_layers = {L + n_mtp}",
    )
    need(all(r in (0, 1, 4, 128) for r in ratios), f"compress_ratios {ratios}: entries in 0/4/128")
    need(0 <= cfg["num_hash_layers"] <= L, "num_hash_layers must be in [0, num_hidden_layers]")
    need(cfg["num_experts_per_tok"] <= cfg["n_routed_experts"], "top-k > n_routed_experts")
    need(cfg["vocab_size"] >= 2, "vocab_size too small")
    if errors:
        raise ConfigError("config breaks vLLM 0.21.0 DSv4 constraints: " + "; ".join(errors))


# --------------------------------------------------------------------------------------------
# Tensor layout


@dataclass(frozen=True)
class Spec:
    """One logical tensor of the checkpoint, in native naming.

    kind "linear" is a quantizable projection: `name` is the module (`layers.0.attn.wq_a`) and
    `shape` its logical [N, K]; `role` is "attn" (attention, indexer.wq_b), "shared", "expert"
    or "mtp_proj" (the MTP block's e_proj / h_proj); `fuse` names the fused group sharing one
    NVFP4 global scale (None if alone). Names starting with `mtp.` belong to an MTP block.
    Other kinds are stored as is under `name`: "bf16_linear" (never quantized projections,
    stored as `name.weight`), "embed", "head", "norm", "hc_fn", "hc_base", "hc_scale", "sink",
    "ape", "gate_bias", "tid2eid".
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    role: str = ""
    fuse: str | None = None


def mtp_layers(cfg: dict) -> int:
    """How many MTP blocks (`mtp.{i}.*`) a checkpoint for `cfg` holds."""
    return int(cfg.get("num_nextn_predict_layers") or 0)


def _block_specs(p: str, L: int, cfg: dict) -> list[Spec]:
    """The decoder block under prefix `p` (`layers.3.`, `mtp.0.`); L: its layer index (the
    compress ratio and hash routing read it)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    NH, D, Q = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    IH, ID = cfg["index_n_heads"], cfg["index_head_dim"]
    E, K, I = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    Is = I * cfg["n_shared_experts"]
    a, f = p + "attn.", p + "ffn."
    ratio = cfg["compress_ratios"][L]
    out = [Spec(p + "attn_norm.weight", (H,), "norm"), Spec(p + "ffn_norm.weight", (H,), "norm")]
    for s in ("attn", "ffn"):
        out += [
            Spec(p + f"hc_{s}_fn", (mix, hc * H), "hc_fn"),
            Spec(p + f"hc_{s}_base", (mix,), "hc_base"),
            Spec(p + f"hc_{s}_scale", (3,), "hc_scale"),
        ]
    out += [
        Spec(a + "wq_a", (Q, H), "linear", "attn", fuse=a + "fused_wqa_wkv"),
        Spec(a + "wkv", (D, H), "linear", "attn", fuse=a + "fused_wqa_wkv"),
        Spec(a + "q_norm.weight", (Q,), "norm"),
        Spec(a + "kv_norm.weight", (D,), "norm"),
        Spec(a + "wq_b", (NH * D, Q), "linear", "attn"),
        Spec(a + "wo_a", (G * R, NH * D // G), "linear", "attn"),
        Spec(a + "wo_b", (H, G * R), "linear", "attn"),
        Spec(a + "attn_sink", (NH,), "sink"),
    ]
    if ratio > 1:
        coff = 2 if ratio == 4 else 1
        c = a + "compressor."
        out += [
            Spec(c + "wkv", (coff * D, H), "bf16_linear"),
            Spec(c + "wgate", (coff * D, H), "bf16_linear"),
            Spec(c + "ape", (ratio, coff * D), "ape"),
            Spec(c + "norm.weight", (D,), "norm"),
        ]
    if ratio == 4:
        x = a + "indexer."
        out += [
            Spec(x + "wq_b", (IH * ID, Q), "linear", "attn"),
            Spec(x + "weights_proj", (IH, H), "bf16_linear"),
            Spec(x + "compressor.wkv", (2 * ID, H), "bf16_linear"),
            Spec(x + "compressor.wgate", (2 * ID, H), "bf16_linear"),
            Spec(x + "compressor.ape", (4, 2 * ID), "ape"),
            Spec(x + "compressor.norm.weight", (ID,), "norm"),
        ]
    out.append(Spec(f + "gate", (E, H), "bf16_linear"))
    if L < cfg["num_hash_layers"]:
        out.append(Spec(f + "gate.tid2eid", (V, K), "tid2eid"))
    else:
        out.append(Spec(f + "gate.bias", (E,), "gate_bias"))
    se = f + "shared_experts."
    out += [
        Spec(se + "w1", (Is, H), "linear", "shared", fuse=se + "gate_up"),
        Spec(se + "w3", (Is, H), "linear", "shared", fuse=se + "gate_up"),
        Spec(se + "w2", (H, Is), "linear", "shared"),
    ]
    for e in range(E):
        ex = f + f"experts.{e}."
        out += [
            Spec(ex + "w1", (I, H), "linear", "expert", fuse=ex + "w13"),
            Spec(ex + "w3", (I, H), "linear", "expert", fuse=ex + "w13"),
            Spec(ex + "w2", (H, I), "linear", "expert"),
        ]
    return out


def tensor_specs(cfg: dict, mtp: bool = False) -> list[Spec]:
    """Every logical tensor of a DSv4 checkpoint for `cfg`, native names, in layer order.

    mtp: also the `mtp.{i}.*` blocks of `num_nextn_predict_layers` (vLLM's main model skips
    them; its MTP draft model loads them)."""
    H, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    out: list[Spec] = []
    for L in range(cfg["num_hidden_layers"]):
        out += _block_specs(f"layers.{L}.", L, cfg)
    out += [
        Spec("embed.weight", (V, H), "embed"),
        Spec("norm.weight", (H,), "norm"),
        Spec("head.weight", (V, H), "head"),
        Spec("hc_head_fn", (hc, hc * H), "hc_fn"),
        Spec("hc_head_base", (hc,), "hc_base"),
        Spec("hc_head_scale", (1,), "hc_scale"),
    ]
    if mtp:
        for i in range(mtp_layers(cfg)):
            p = f"mtp.{i}."
            out += _block_specs(p, cfg["num_hidden_layers"] + i, cfg)
            out += [
                Spec(p + "e_proj", (H, H), "linear", "mtp_proj"),
                Spec(p + "h_proj", (H, H), "linear", "mtp_proj"),
                Spec(p + "enorm.weight", (H,), "norm"),
                Spec(p + "hnorm.weight", (H,), "norm"),
                Spec(p + "norm.weight", (H,), "norm"),
                Spec(p + "hc_head_fn", (hc, hc * H), "hc_fn"),
                Spec(p + "hc_head_base", (hc,), "hc_base"),
                Spec(p + "hc_head_scale", (1,), "hc_scale"),
                Spec(p + "emb.tok_emb.weight", (V, H), "embed"),
                Spec(p + "head.weight", (V, H), "head"),
            ]
    return out


def storage_of(spec: Spec, fmt: str) -> str:
    """How a linear spec is stored in `fmt`: "fp8" (e8m0 scales), "fp8_f32", "mxfp4", "nvfp4",
    "ct_nvfp4" (compressed-tensors NVFP4), "ct_fp8" (compressed-tensors FP8 block), "bf16"."""
    if spec.kind != "linear":
        raise ValueError(f"{spec.name}: storage_of applies to kind 'linear', got {spec.kind!r}")
    if fmt == "native":
        return "mxfp4" if spec.role == "expert" else "fp8"
    if fmt == "native-fp8":
        return "fp8_f32"
    if fmt == "nvfp4":
        return "nvfp4"
    if fmt == "nvidia-mixed":  # the MTP block's experts stay MXFP4, as DeepSeek ships them
        if spec.role == "expert":
            return "mxfp4" if spec.name.startswith("mtp.") else "nvfp4"
        return "fp8"
    if fmt == "ct-nvfp4-fp8":  # the config groups' targets, matched against vLLM's modules
        if spec.name.startswith("mtp."):
            return "bf16"
        if spec.role in ("expert", "shared"):  # `re:.*ffn.*(gate|up|down)_proj$`
            return "ct_nvfp4"
        if spec.role == "attn":  # `re:.*attn.*(fused_wqa_wkv|wq_b|wo_a|wo_b)$`: indexer.wq_b too
            return "ct_fp8"
        return "bf16"
    if fmt == "bf16":
        return "bf16"
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


PLAIN_DTYPES = {
    "bf16_linear": torch.bfloat16,
    "embed": torch.bfloat16,
    "head": torch.bfloat16,
    "norm": torch.bfloat16,
    "hc_fn": torch.float32,
    "hc_base": torch.float32,
    "hc_scale": torch.float32,
    "sink": torch.float32,
    "ape": torch.float32,
    "gate_bias": torch.float32,
    "tid2eid": torch.int64,
}


def linear_tensors(name: str, shape: tuple[int, ...], storage: str) -> dict[str, tuple]:
    """Checkpoint tensors {name: (shape, dtype)} of one linear [N, K] stored as `storage`."""
    n, k = shape
    if storage == "bf16":
        return {f"{name}.weight": ((n, k), torch.bfloat16)}
    if storage in ("fp8", "fp8_f32"):
        sdt = torch.float8_e8m0fnu if storage == "fp8" else torch.float32
        return {
            f"{name}.weight": ((n, k), torch.float8_e4m3fn),
            f"{name}.scale": ((math.ceil(n / 128), math.ceil(k / 128)), sdt),
        }
    if storage == "mxfp4":  # DeepSeek's packed bytes are I8
        return {
            f"{name}.weight": ((n, k // 2), torch.int8),
            f"{name}.scale": ((n, k // 32), torch.float8_e8m0fnu),
        }
    if storage == "nvfp4":
        return {
            f"{name}.weight": ((n, k // 2), torch.uint8),
            f"{name}.weight_scale": ((n, k // 16), torch.float8_e4m3fn),
            f"{name}.weight_scale_2": ((), torch.float32),
            f"{name}.input_scale": ((), torch.float32),
        }
    if storage == "ct_nvfp4":
        return {
            f"{name}.weight_packed": ((n, k // 2), torch.uint8),
            f"{name}.weight_scale": ((n, k // 16), torch.float8_e4m3fn),
            f"{name}.weight_global_scale": ((1,), torch.float32),
            f"{name}.input_global_scale": ((1,), torch.float32),
        }
    if storage == "ct_fp8":
        return {
            f"{name}.weight": ((n, k), torch.float8_e4m3fn),
            f"{name}.weight_scale": ((math.ceil(n / 128), math.ceil(k / 128)), torch.bfloat16),
        }
    raise ValueError(f"{name}: unknown storage {storage!r}")


def expected_tensors(cfg: dict, fmt: str, scheme: str = "native") -> dict[str, tuple]:
    """Every checkpoint tensor {name: (shape tuple, torch dtype)} for `cfg` in `fmt`/`scheme`
    (`mtp.*` names, not renamed by the schemes, included)."""
    out: dict[str, tuple] = {}
    for s in tensor_specs(cfg, mtp=True):
        if s.kind == "linear":
            items = linear_tensors(s.name, s.shape, storage_of(s, fmt))
        elif s.kind == "bf16_linear":
            items = {f"{s.name}.weight": (s.shape, torch.bfloat16)}
        else:
            items = {s.name: (s.shape, PLAIN_DTYPES[s.kind])}
        for n, v in items.items():
            out[n if n.startswith("mtp.") else N.to_scheme(n, scheme)] = v
    return out


# --------------------------------------------------------------------------------------------
# quantization_config


def quantization_config(cfg: dict, fmt: str) -> dict | None:
    """config.json `quantization_config` for a format (None for bf16)."""
    fp8 = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    if fmt in ("native", "native-fp8"):
        return fp8
    if fmt == "nvfp4":
        # Read by ModelOptNvFp4Config.from_config's config.json branch (modelopt.py:299-315):
        # quant_algo, group_size, ignore, kv_cache_scheme. Every projection built with a
        # quant_config is NVFP4 here; the BF16 modules are built with quant_config=None by vLLM
        # anyway, so `ignore` only documents them. scale_fmt: read by DeepseekV4Attention.
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "producer": {"name": "cutedsl.tools", "version": "0.1.0"},
            "scale_fmt": "ue8m0",
            "ignore": [
                "lm_head",
                "layers.*.attn.compressor*",
                "layers.*.attn.indexer.compressor*",
                "layers.*.attn.indexer.weights_proj",
                "layers.*.ffn.gate",
            ],
        }
    if fmt == "nvidia-mixed":
        # Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py
        # `_rewrite_config_json`: the source (DeepSeek) FP8 config plus ModelOpt's keys; the
        # main layers' routed experts are NVFP4 (`quantized_layers`), the MTP block stays native.
        return {
            **fp8,
            "quant_algo": "MIXED_PRECISION",
            "moe_quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "producer": dict(NVIDIA_PRODUCER),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": dict(_NVFP4_ARGS),
                    "input_activations": dict(_NVFP4_ARGS),
                }
            },
            "quantized_layers": _nvidia_quantized_layers(cfg),
            "ignore": list(NVIDIA_IGNORE),
        }
    if fmt == "ct-nvfp4-fp8":
        return _ct_quantization_config()
    if fmt == "bf16":
        return None
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def _ct_args(num_bits: int, strategy: str, **kw) -> dict:
    args = {
        "num_bits": num_bits,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": strategy,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "scale_dtype": None,
        "zp_dtype": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    args.update(kw)
    return args


def _ct_quantization_config() -> dict:
    """compressed-tensors `quantization_config` of RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 (its
    config groups' targets name vLLM's modules; sources: tests/test_checkpoint_layouts.py)."""
    nvfp4 = _ct_args(4, "tensor_group", group_size=16)
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["re:.*attn.*(fused_wqa_wkv|wq_b|wo_a|wo_b)$"],
                "weights": _ct_args(8, "block", block_structure=[128, 128]),
                "input_activations": None,
                "output_activations": None,
                "format": "float-quantized",
            },
            "group_1": {
                "targets": ["re:.*ffn.*(gate|up|down)_proj$"],
                "weights": nvfp4,
                "input_activations": {**nvfp4, "dynamic": "local"},
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            },
        },
        "ignore": [
            "lm_head",
            r"re:.*\.embed_tokens$",
            r"re:.*\.norm$",
            r"re:.*\.gate$",
            r"re:.*\.q_norm$",
            r"re:.*\.k_norm$",
            r"re:.*mtp\..*",
        ],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


# Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py (`_build_hf_quant_config`,
# `_rewrite_config_json`): what nvidia/DeepSeek-V4-Flash-NVFP4 and -Pro-NVFP4 publish.
NVIDIA_PRODUCER = {"name": "modelopt", "version": "dsv4-nvfp4-experts"}
NVIDIA_IGNORE = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
_NVFP4_ARGS = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}


def _nvidia_quantized_layers(cfg: dict) -> dict[str, dict]:
    """ModelOpt's `quantized_layers`: one `layers.L.ffn.experts` entry per main decoder layer."""
    return {
        f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
        for i in range(cfg["num_hidden_layers"])
    }


def hf_quant_config(cfg: dict, fmt: str) -> dict | None:
    """The `hf_quant_config.json` a format ships beside config.json (None: no such file).

    nvidia-mixed: ModelOpt's manifest, the same `quantized_layers` as config.json and its `ignore`
    list as `exclude_modules`. vLLM 0.21.0 reads this file only when config.json has no
    quantization_config (transformers_utils/config.py), so it is informational for these
    checkpoints."""
    if fmt != "nvidia-mixed":
        return None
    return {
        "producer": dict(NVIDIA_PRODUCER),
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "quantized_layers": _nvidia_quantized_layers(cfg),
            "exclude_modules": list(NVIDIA_IGNORE),
        },
    }


def make_config_like(src_cfg: dict, fmt: str) -> dict:
    """`src_cfg` (any DSv4 config) with the quantization_config / expert_dtype of `fmt`."""
    cfg = copy.deepcopy(src_cfg)
    cfg.pop("quantization_config", None)
    qc = quantization_config(cfg, fmt)
    if qc is not None:
        old = src_cfg.get("quantization_config") or {}
        if "scale_fmt" in old:
            qc["scale_fmt"] = old["scale_fmt"]
        cfg["quantization_config"] = qc
    if fmt == "native-fp8":
        cfg["expert_dtype"] = "fp8"
    elif fmt != "bf16":
        cfg["expert_dtype"] = "fp4"
    else:
        cfg.pop("expert_dtype", None)
    return cfg


def detect_format(cfg: dict) -> str:
    """The format name of a config: native, native-fp8, nvidia-mixed, nvfp4, ct-nvfp4-fp8, bf16.
    Raises ConfigError for a quantization_config no DSv4 layout has."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "bf16"
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if "NVFP4" in algo:
            return "nvfp4"
        raise ConfigError(
            f"quantization_config: modelopt quant_algo {algo!r} is not a known DSv4 layout"
        )
    if method in ("fp8", "deepseek_v4_fp8"):
        if str(qc.get("moe_quant_algo", "")).upper() == "NVFP4":
            return "nvidia-mixed"
        ed = cfg.get("expert_dtype", "fp4")
        if ed == "fp4":
            return "native"
        if ed == "fp8":
            return "native-fp8"
        raise ConfigError(f"config: expert_dtype {ed!r}, expected 'fp4' or 'fp8'")
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        fmts = (
            {g.get("format") for g in groups.values() if isinstance(g, dict)}
            if isinstance(groups, dict)
            else set()
        )
        if "nvfp4-pack-quantized" in fmts:
            return "ct-nvfp4-fp8"
        raise ConfigError(
            "quantization_config: compressed-tensors without an nvfp4-pack-quantized group "
            f"(formats {sorted(str(f) for f in fmts)}) is not a known DSv4 layout"
        )
    raise ConfigError(f"quantization_config: quant_method {method!r} is not a known DSv4 layout")
