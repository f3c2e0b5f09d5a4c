"""Generate a random-weight DeepSeek V4 checkpoint that vLLM 0.21.0 and HF transformers 5.17.0 load.

    python -m cutedsl.tools.tiny_model OUT [--format native|native-fp8|nvfp4|nvidia-mixed|bf16]
        [--names native|hf] [--preset tiny|flash-layers] [--layers N] [--seed N]
        [--config JSON] [--device cpu|cuda] [--router-gain G] [--expert-shared R] [--force] [--list]

Formats (what each quantizable projection is stored as; everything else is identical):
  native        FP8 block-128 e4m3 + e8m0 `.scale` for attention, indexer.wq_b and shared expert;
                MXFP4 routed experts (uint8 e2m1x2 + e8m0 `.scale` per 32), as DeepSeek ships V4-Flash.
  native-fp8    FP8 block everywhere incl. experts, f32 `.scale` (`expert_dtype: fp8`, V4-Flash-Base).
  nvfp4         full ModelOpt NVFP4: every quantizable projection (fused_wqa_wkv pair, wq_b, wo_a,
                wo_b, indexer.wq_b, shared expert, routed experts): `.weight` uint8 [N, K/2],
                `.weight_scale` e4m3 [N, K/16], `.weight_scale_2` f32 [], `.input_scale` f32 [].
  nvidia-mixed  NVFP4 routed experts, FP8 block (e8m0) rest; `quant_method: fp8` +
                `moe_quant_algo: NVFP4`, NVIDIA's published DSv4 convention.
  bf16          every weight BF16, no quantization_config (HF / converter input; pristine vLLM
                0.21.0 cannot load it: DeepseekV4Attention reads quantization_config["scale_fmt"]).
Never quantized: compressor wkv/wgate, indexer weights_proj, ffn.gate, embed, head (BF16); mHC,
attn_sink, ape, gate.bias (f32); norms (BF16); tid2eid (int64).

All formats derive from the same BF16 master weights (per-tensor generator seeded from
(seed, native name)), so an nvfp4 and a native checkpoint of one seed describe the same model up
to quantization error. Fused pairs (wq_a+wkv, w1+w3) share one NVFP4 global scale.
Weights: N(0, 1/K) projections (unit gain), N(0, 1) embedding, norms 1 + N(0, 0.1^2),
hc_fn N(0, 0.25^2 / 4H), small random mHC bases/scales, sinks, gate bias and ape, so that a
swapped or dropped tensor changes the logits.

Conditioning for numerical comparison (every preset and format; the masters are shared): the
score-routed MoE layers pick top-k experts from continuous router scores, and in a random model
the k-th and (k+1)-th scores are often within bf16 noise, so a bf16 run (vLLM, or HF in bf16)
flips one expert at a few positions and those positions' logits jump (issue #8; diagnosis in
bench/results/cpu_2026-12-02_conditioning/). Two knobs bound that, both realistic for trained
MoEs (sharper routers, experts that share a common component):
  router_gain (DEFAULT_ROUTER_GAIN): ffn.gate is N(0, gain^2 / H), router logits of std ~gain, so
      sqrtsoftplus scores sit away from its flat offset near 0 and top-k margins are larger
      relative to bf16 rounding (about half the flips at 4 vs 1). gate.bias stays N(0, 0.05^2)
      (scaling it with the gain, 0.2, was tried: 2 of 1200 positions fell to 0.9948).
  expert_shared (DEFAULT_EXPERT_SHARED): variance fraction r of each routed expert projection
      that is common to the layer's experts: w = sqrt(1-r) * own + sqrt(r) * base, base seeded
      from `layers.L.ffn.experts.base.wX`; same per-weight std. Swapping two experts then moves
      the output by sqrt(1-r) of an unrelated swap (0.5 at 0.75), so a residual flip costs
      ~4x less in 1 - cosine. Experts still differ (half their amplitude is their own).
router_gain=1, expert_shared=0 give the unconditioned model. `input_scale` is not calibrated: a fixed
activation amax of DEFAULT_INPUT_AMAX.

Output: OUT/config.json, generation_config.json, model-0000i-of-0000n.safetensors (shards of at
most --max-shard-gb) and model.safetensors.index.json. Written into a temporary directory next to
OUT and renamed at the end: a failure never leaves a half-written OUT.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cutedsl.tools import names as N
from cutedsl.tools import tiny_tokenizer

__all__ = [
    "PRESETS",
    "FORMATS",
    "DEFAULT_INPUT_AMAX",
    "DEFAULT_ROUTER_GAIN",
    "DEFAULT_EXPERT_SHARED",
    "Spec",
    "make_config",
    "make_config_like",
    "check_config",
    "mhc_decode_hazard",
    "tensor_specs",
    "storage_of",
    "expected_tensors",
    "quantization_config",
    "master_tensor",
    "write_checkpoint",
    "generate",
]

FORMATS = ("native", "native-fp8", "nvfp4", "nvidia-mixed", "bf16")
DEFAULT_INPUT_AMAX = 32.0
DEFAULT_ROUTER_GAIN = 4.0  # std of the router logits (ffn.gate gain); see the module docstring
DEFAULT_EXPERT_SHARED = 0.75  # variance fraction of routed experts common to a layer

_BASE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "num_key_value_heads": 1,
    "head_dim": 512,  # fixed by vLLM 0.21.0: fp8_ds_mla 584 B/token, FlashMLA head_dim_v=512
    "qk_rope_head_dim": 64,  # fixed: 448 nope + 64 rope
    "sliding_window": 128,
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    # = original_max_position_embeddings * factor: HF's yarn derives its factor from this ratio.
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "index_n_heads": 64,  # DeepGEMM mqa-logits heads (the real value)
    "index_head_dim": 128,  # compressor head-128 path
    "index_topk": 512,  # 512/1024/2048 take the persistent radix top-k
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

PRESETS: dict[str, dict] = {
    # 4 layers: 0 = SWA + hash MoE, 1 = C4 (compressor + indexer) + hash MoE,
    # 2 = C128 + score-routed MoE, 3 = C4 + score-routed MoE.
    # hidden 2048, not 1024: vLLM 0.21.0 mhc_fused_post_pre (layers/mhc.py:679-683) uses
    # n_splits=8 for T<8 and mhc_fused_tilelang loops (H // n_splits) // 256 times per split
    # (mhc.py:428-430, 474): with H=1024 that is 0, so decode steps compute nothing (see
    # bench/upstream_baseline.py). H/8 and H/4 must be multiples of 256.
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,  # FlashMLA pads to 64: exercises the padding path
        "q_lora_rank": 256,
        "o_groups": 2,  # 8 heads per group -> wo_a K = 4096 like the real model
        "o_lora_rank": 128,  # multiple of 128 (fp8_einsum block scales)
        "compress_ratios": [0, 4, 128, 4, 0],  # per layer, +1 trailing entry (MTP)
        "n_routed_experts": 16,
        "moe_intermediate_size": 256,
        "num_hash_layers": 2,
    },
    # Real DSv4-Flash layer dimensions, few layers, small vocabulary: for benchmarks.
    "flash-layers": {
        "vocab_size": 4096,
        "hidden_size": 4096,
        "num_hidden_layers": 2,
        "num_attention_heads": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "compress_ratios": [4, 128, 0],
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "num_hash_layers": 1,
    },
}

# Compress-ratio cycle used when --layers changes a preset's depth.
_RATIO_CYCLE = {"tiny": [0, 4, 128, 4], "flash-layers": [4, 128]}


@dataclass(frozen=True)
class Spec:
    """One logical tensor of the checkpoint, in native naming.

    kind "linear" is a quantizable projection: `name` is the module (`layers.0.attn.wq_a`) and
    `shape` its logical [N, K]; `role` is "attn" (attention, indexer.wq_b), "shared" or "expert";
    `fuse` names the fused group sharing one NVFP4 global scale (None if alone).
    Other kinds are stored as is under `name`: "bf16_linear" (never quantized projections,
    stored as `name.weight`), "embed", "head", "norm", "hc_fn", "hc_base", "hc_scale", "sink",
    "ape", "gate_bias", "tid2eid".
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    role: str = ""
    fuse: str | None = None


def make_config(
    preset: str = "tiny",
    fmt: str = "native",
    overrides: dict | None = None,
    layers: int | None = None,
) -> dict:
    """Config dict (native DeepSeek keys, what vLLM 0.21.0 reads) for a preset and format."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    cfg = copy.deepcopy(_BASE)
    cfg.update(copy.deepcopy(PRESETS[preset]))
    if layers is not None:
        cyc = _RATIO_CYCLE[preset]
        cfg["num_hidden_layers"] = layers
        cfg["compress_ratios"] = [cyc[i % len(cyc)] for i in range(layers)] + [0]
        cfg["num_hash_layers"] = min(cfg["num_hash_layers"], layers)
    if overrides:
        cfg.update(copy.deepcopy(overrides))
    cfg = make_config_like(cfg, fmt)
    check_config(cfg)
    return cfg


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


def check_config(cfg: dict) -> None:
    """Raise ValueError if `cfg` breaks a vLLM 0.21.0 DSv4 constraint (research §4)."""
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
    need("rope_scaling" in cfg, "rope_scaling (yarn) must be present")
    ratios = cfg["compress_ratios"]
    need(len(ratios) >= L, f"compress_ratios has {len(ratios)} entries < num_hidden_layers={L}")
    need(all(r in (0, 1, 4, 128) for r in ratios), f"compress_ratios {ratios}: entries in 0/4/128")
    need(0 <= cfg["num_hash_layers"] <= L, "num_hash_layers must be in [0, num_hidden_layers]")
    need(cfg["num_experts_per_tok"] <= cfg["n_routed_experts"], "top-k > n_routed_experts")
    need(cfg["vocab_size"] >= 2, "vocab_size too small")
    if errors:
        raise ValueError("config breaks vLLM 0.21.0 DSv4 constraints: " + "; ".join(errors))


def mhc_decode_hazard(cfg: dict) -> str | None:
    """The vLLM 0.21.0 mhc_fused_post_pre small-T hazard for this hidden size, or None."""
    H = cfg["hidden_size"]
    splits = (8, 4) if H <= 4096 else (4,)
    bad = [s for s in splits if (H // s) % 256 != 0 or H // s < 256]
    if bad:
        return (
            f"hidden_size={H}: vLLM 0.21.0 mhc_fused_tilelang with n_splits={bad} covers "
            f"{[((H // s) // 256) * 256 for s in bad]} of {[H // s for s in bad]} elements per "
            "split at T <= 16 tokens (decode); expect wrong decode steps"
        )
    return None


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
                "mtp*",
            ],
        }
    if fmt == "nvidia-mixed":
        # research/anchors.md §3.3 (nvidia/DeepSeek-V4-Flash-NVFP4 config).
        L = cfg["num_hidden_layers"]
        return {
            **fp8,
            "quant_algo": "MIXED_PRECISION",
            "moe_quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "producer": {"name": "modelopt"},
            "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"],
            "quantized_layers": {
                f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
                for i in range(L)
            },
        }
    if fmt == "bf16":
        return None
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def tensor_specs(cfg: dict) -> list[Spec]:
    """Every logical tensor of a DSv4 checkpoint for `cfg`, native names, in layer order."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    NH, D, Q = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    IH, ID = cfg["index_n_heads"], cfg["index_head_dim"]
    E, K, I = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    Is = I * cfg["n_shared_experts"]
    out: list[Spec] = []
    for L in range(cfg["num_hidden_layers"]):
        p = f"layers.{L}."
        a, f = p + "attn.", p + "ffn."
        ratio = cfg["compress_ratios"][L]
        out += [
            Spec(p + "attn_norm.weight", (H,), "norm"),
            Spec(p + "ffn_norm.weight", (H,), "norm"),
        ]
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
    out += [
        Spec("embed.weight", (V, H), "embed"),
        Spec("norm.weight", (H,), "norm"),
        Spec("head.weight", (V, H), "head"),
        Spec("hc_head_fn", (hc, hc * H), "hc_fn"),
        Spec("hc_head_base", (hc,), "hc_base"),
        Spec("hc_head_scale", (1,), "hc_scale"),
    ]
    return out


def storage_of(spec: Spec, fmt: str) -> str:
    """How a linear spec is stored in `fmt`: "fp8" (e8m0 scales), "fp8_f32", "mxfp4", "nvfp4",
    "bf16"."""
    if spec.kind != "linear":
        raise ValueError(f"{spec.name}: storage_of applies to kind 'linear', got {spec.kind!r}")
    if fmt == "native":
        return "mxfp4" if spec.role == "expert" else "fp8"
    if fmt == "native-fp8":
        return "fp8_f32"
    if fmt == "nvfp4":
        return "nvfp4"
    if fmt == "nvidia-mixed":
        return "nvfp4" if spec.role == "expert" else "fp8"
    if fmt == "bf16":
        return "bf16"
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


_PLAIN_DTYPES = {
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
    if storage == "mxfp4":
        return {
            f"{name}.weight": ((n, k // 2), torch.uint8),
            f"{name}.scale": ((n, k // 32), torch.float8_e8m0fnu),
        }
    if storage == "nvfp4":
        return {
            f"{name}.weight": ((n, k // 2), torch.uint8),
            f"{name}.weight_scale": ((n, k // 16), torch.float8_e4m3fn),
            f"{name}.weight_scale_2": ((), torch.float32),
            f"{name}.input_scale": ((), torch.float32),
        }
    raise ValueError(f"{name}: unknown storage {storage!r}")


def expected_tensors(cfg: dict, fmt: str, scheme: str = "native") -> dict[str, tuple]:
    """Every checkpoint tensor {name: (shape tuple, torch dtype)} for `cfg` in `fmt`/`scheme`."""
    out: dict[str, tuple] = {}
    for s in tensor_specs(cfg):
        if s.kind == "linear":
            items = linear_tensors(s.name, s.shape, storage_of(s, fmt))
        elif s.kind == "bf16_linear":
            items = {f"{s.name}.weight": (s.shape, torch.bfloat16)}
        else:
            items = {s.name: (s.shape, _PLAIN_DTYPES[s.kind])}
        for n, v in items.items():
            out[N.to_scheme(n, scheme)] = v
    return out


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _expert_base_name(name: str) -> str:
    """`layers.L.ffn.experts.E.wX` -> `layers.L.ffn.experts.base.wX` (the layer's common part)."""
    parts = name.split(".")
    return ".".join(parts[:4] + ["base", parts[5]])


def master_tensor(
    spec: Spec,
    cfg: dict,
    seed: int,
    device: str | torch.device = "cpu",
    router_gain: float = DEFAULT_ROUTER_GAIN,
    expert_shared: float = DEFAULT_EXPERT_SHARED,
) -> torch.Tensor:
    """The deterministic master value of a spec (fp32 for linears/f32 kinds, else its dtype).

    Depends only on (seed, spec.name, shape) and the conditioning knobs (router_gain,
    expert_shared: module docstring), not on generation order or format.
    """
    if not 0.0 <= expert_shared < 1.0:
        raise ValueError(f"expert_shared={expert_shared}, expected 0 <= r < 1")
    if not router_gain > 0.0:
        raise ValueError(f"router_gain={router_gain}, expected > 0")
    dev = torch.device(device)
    g = _generator(seed, spec.name, dev)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32)

    k = spec.kind
    if k == "linear" and spec.role == "expert" and expert_shared > 0.0:
        own = randn(*spec.shape)
        gb = _generator(seed, _expert_base_name(spec.name), dev)
        base = torch.randn(*spec.shape, generator=gb, device=dev, dtype=torch.float32)
        w = math.sqrt(1.0 - expert_shared) * own + math.sqrt(expert_shared) * base
        return w / math.sqrt(spec.shape[-1])
    if k == "bf16_linear" and spec.name.endswith(".ffn.gate"):
        return randn(*spec.shape) * (router_gain / math.sqrt(spec.shape[-1]))
    if k in ("linear", "bf16_linear", "head"):
        return randn(*spec.shape) / math.sqrt(spec.shape[-1])
    if k == "embed":
        return randn(*spec.shape)
    if k == "norm":
        return 1.0 + 0.1 * randn(*spec.shape)
    if k == "hc_fn":  # mixes = (x @ fn.T) * rsqrt(mean x^2): std ~ 0.25
        return randn(*spec.shape) * (0.25 / math.sqrt(spec.shape[1]))
    if k == "hc_base":
        return 0.1 * randn(*spec.shape)
    if k == "hc_scale":
        return 1.0 + 0.1 * randn(*spec.shape)
    if k == "sink":
        return 0.5 * randn(*spec.shape)
    if k == "ape":
        return 0.1 * randn(*spec.shape)
    if k == "gate_bias":
        return 0.05 * randn(*spec.shape)
    if k == "tid2eid":  # distinct experts per token id
        V, topk = spec.shape
        perm = torch.argsort(
            torch.rand(V, cfg["n_routed_experts"], generator=g, device=dev), dim=-1
        )
        return perm[:, :topk].to(torch.int64)
    raise ValueError(f"{spec.name}: unknown kind {k!r}")


def _fused_partners(specs: list[Spec]) -> dict[str, list[Spec]]:
    groups: dict[str, list[Spec]] = {}
    for s in specs:
        if s.kind == "linear" and s.fuse is not None:
            groups.setdefault(s.fuse, []).append(s)
    return groups


def encode_linear(
    name: str,
    w: torch.Tensor,
    storage: str,
    group_amax: float | None = None,
    input_amax: float = DEFAULT_INPUT_AMAX,
) -> dict[str, torch.Tensor]:
    """Quantize a master weight w [N, K] into its checkpoint tensors for `storage`.

    group_amax: NVFP4 only, the amax shared by a fused group (None: this tensor's own amax).
    """
    from cutedsl.tools import quantize as Q

    if storage == "bf16":
        return {f"{name}.weight": w.to(torch.bfloat16)}
    if storage in ("fp8", "fp8_f32"):
        q, s = Q.quantize_fp8_block(w, e8m0=storage == "fp8")
        return {f"{name}.weight": q, f"{name}.scale": s}
    if storage == "mxfp4":
        q, s = Q.quantize_mxfp4(w)
        return {f"{name}.weight": q, f"{name}.scale": s}
    if storage == "nvfp4":
        return Q.encode_nvfp4(name, w, group_amax=group_amax, input_amax=input_amax)
    raise ValueError(f"{name}: unknown storage {storage!r}")


def _iter_tensors(
    cfg: dict,
    fmt: str,
    seed: int,
    device: torch.device,
    progress: bool,
    router_gain: float = DEFAULT_ROUTER_GAIN,
    expert_shared: float = DEFAULT_EXPERT_SHARED,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield (layer or -1, {native name: CPU tensor}) spec by spec."""
    from tqdm import tqdm

    def master(s: Spec) -> torch.Tensor:
        return master_tensor(s, cfg, seed, device, router_gain, expert_shared)

    specs = tensor_specs(cfg)
    groups = _fused_partners(specs) if fmt in ("nvfp4", "nvidia-mixed") else {}
    cache: dict[str, torch.Tensor] = {}  # masters of fused partners generated ahead of time
    gamax: dict[str, float] = {}
    for s in tqdm(specs, desc=f"tiny_model {fmt}", unit="tensor", disable=not progress):
        layer = int(s.name.split(".")[1]) if s.name.startswith("layers.") else -1
        m = cache.pop(s.name, None)
        if m is None:
            m = master(s)
        if s.kind == "linear":
            # Quantize from the BF16-rounded master so every format has one BF16 source.
            m = m.bfloat16().float()
            st = storage_of(s, fmt)
            ga = None
            if st == "nvfp4" and s.fuse in groups:
                if s.fuse not in gamax:  # first member: generate the partners now, share amax
                    a = float(m.abs().amax())
                    for p in groups[s.fuse]:
                        if p.name != s.name:
                            cache[p.name] = master(p).bfloat16().float()
                            a = max(a, float(cache[p.name].abs().amax()))
                    gamax[s.fuse] = a
                ga = gamax[s.fuse]
            items = encode_linear(s.name, m, st, group_amax=ga)
        elif s.kind == "bf16_linear":
            items = {f"{s.name}.weight": m.to(torch.bfloat16)}
        else:
            items = {s.name: m.to(_PLAIN_DTYPES[s.kind])}
        yield layer, {k: v.contiguous().cpu() for k, v in items.items()}


def write_checkpoint(
    out: str,
    cfg: dict,
    tensors: Iterator[tuple[int, dict[str, torch.Tensor]]],
    scheme: str = "native",
    max_shard_bytes: int = 2 << 30,
    force: bool = False,
    extra_files: dict[str, dict] | None = None,
    copy_from: str | None = None,
) -> None:
    """Write config.json + sharded safetensors + index atomically (temp dir next to OUT, rename).

    tensors yields (layer, {native name: tensor}); a new shard starts at each layer boundary
    once the current one holds more than max_shard_bytes, or when it would exceed 2x that
    (max_shard_bytes=0: one shard per distinct layer key). Names starting with `mtp.` are kept
    verbatim. copy_from: a source checkpoint whose other files (tokenizer, generation_config,
    ...; not safetensors, index or config.json) are copied over.
    """
    from safetensors.torch import save_file

    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        last_layer = None
        files: list[str] = []
        weight_map: dict[str, int] = {}
        total = 0

        def flush(final: bool = False) -> None:
            idx = len(files)
            fn = f"part-{idx:05d}.safetensors"
            save_file(shards[-1], os.path.join(tmp, fn), metadata={"format": "pt"})
            files.append(fn)
            for k in shards[-1]:
                weight_map[k] = idx
            shards[-1] = {}
            sizes[-1] = 0

        for layer, items in tensors:
            nbytes = sum(t.numel() * t.element_size() for t in items.values())
            boundary = layer != last_layer and sizes[-1] >= max_shard_bytes
            too_big = max_shard_bytes > 0 and sizes[-1] + nbytes > 2 * max_shard_bytes
            if shards[-1] and (boundary or too_big):
                flush()
            last_layer = layer
            for k, t in items.items():
                name = k if k.startswith("mtp.") else N.to_scheme(k, scheme)
                if name in shards[-1] or name in weight_map:
                    raise ValueError(f"duplicate tensor name {name!r}")
                shards[-1][name] = t
            sizes[-1] += nbytes
            total += nbytes
        if shards[-1] or not files:
            flush(final=True)
        n = len(files)
        final_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for fn, final in zip(files, final_names):
            os.rename(os.path.join(tmp, fn), os.path.join(tmp, final))
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: final_names[i] for k, i in sorted(weight_map.items())},
        }
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        gen = {
            "bos_token_id": cfg.get("bos_token_id", 0),
            "eos_token_id": cfg.get("eos_token_id", 1),
            "do_sample": False,
        }
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
        if copy_from is not None:
            skip = {"config.json", "model.safetensors.index.json"}
            for fn in sorted(os.listdir(copy_from)):
                full = os.path.join(copy_from, fn)
                if fn in skip or fn.endswith(".safetensors") or not os.path.isfile(full):
                    continue
                shutil.copy2(full, os.path.join(tmp, fn))
        for fn, obj in (extra_files or {}).items():
            with open(os.path.join(tmp, fn), "w") as f:
                json.dump(obj, f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def generate(
    out: str,
    fmt: str = "native",
    scheme: str = "native",
    preset: str = "tiny",
    seed: int = 0,
    overrides: dict | None = None,
    layers: int | None = None,
    device: str = "cpu",
    force: bool = False,
    progress: bool = False,
    max_shard_bytes: int = 2 << 30,
    tokenizer: bool | None = None,
    router_gain: float = DEFAULT_ROUTER_GAIN,
    expert_shared: float = DEFAULT_EXPERT_SHARED,
) -> dict:
    """Generate a checkpoint into `out`; returns its config. tokenizer: also write the byte-level
    tiny tokenizer (cutedsl.tools.tiny_tokenizer), so servers take text and chat requests; None
    writes it when the vocabulary is large enough (>= 265 ids) and warns otherwise.
    router_gain, expert_shared: the conditioning knobs of the module docstring."""
    if scheme not in ("native", "hf"):
        raise ValueError(f"unknown naming scheme {scheme!r}; expected 'native' or 'hf'")
    cfg = make_config(preset, fmt, overrides, layers)
    hazard = mhc_decode_hazard(cfg)
    if hazard:
        print(f"warning: {hazard}", file=sys.stderr)
    with torch.no_grad():
        it = _iter_tensors(
            cfg, fmt, seed, torch.device(device), progress, router_gain, expert_shared
        )
        if tokenizer is None:
            tokenizer = cfg["vocab_size"] >= tiny_tokenizer.MIN_VOCAB
            if not tokenizer:
                print(
                    f"warning: vocab_size {cfg['vocab_size']}: no tokenizer written",
                    file=sys.stderr,
                )
        extra = tiny_tokenizer.tokenizer_files(cfg["vocab_size"]) if tokenizer else None
        write_checkpoint(
            out, cfg, it, scheme=scheme, max_shard_bytes=max_shard_bytes, force=force,
            extra_files=extra,
        )  # fmt: skip
    return cfg


def _parse_overrides(arg: str | None) -> dict | None:
    if not arg:
        return None
    if os.path.exists(arg):
        with open(arg) as f:
            return json.load(f)
    obj = json.loads(arg)
    if not isinstance(obj, dict):
        raise ValueError(f"--config must be a JSON object, got {type(obj).__name__}")
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cutedsl.tools.tiny_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("out", nargs="?", help="output checkpoint directory")
    ap.add_argument("--format", default="native", choices=FORMATS)
    ap.add_argument("--names", default="native", choices=("native", "hf"))
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="JSON object (or file) overriding config keys")
    ap.add_argument("--device", default="cpu", help="where to generate/quantize (cpu, cuda)")
    ap.add_argument("--max-shard-gb", type=float, default=2.0)
    ap.add_argument(
        "--router-gain", type=float, default=DEFAULT_ROUTER_GAIN,
        help="std of the router logits (1: unconditioned)",
    )  # fmt: skip
    ap.add_argument(
        "--expert-shared", type=float, default=DEFAULT_EXPERT_SHARED,
        help="variance fraction common to a layer's routed experts (0: independent experts)",
    )  # fmt: skip
    ap.add_argument("--force", action="store_true", help="replace an existing OUT")
    ap.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    ap.add_argument("--list", action="store_true", help="print the tensor table and exit")
    a = ap.parse_args(argv)
    overrides = _parse_overrides(a.config)
    if a.list or not a.out:
        cfg = make_config(a.preset, a.format, overrides, a.layers)
        exp = expected_tensors(cfg, a.format, a.names)
        total = 0
        for n, (shape, dt) in exp.items():
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
            if ".experts." in n and ".experts.0." not in n:
                continue
            print(f"{n:70s} {str(list(shape)):18s} {str(dt).replace('torch.', '')}")
        print(f"# {len(exp)} tensors (experts.0 shown), {total / 2**20:.1f} MiB")
        return 0
    cfg = generate(
        a.out,
        a.format,
        a.names,
        a.preset,
        a.seed,
        overrides,
        a.layers,
        a.device,
        a.force,
        progress=True,
        max_shard_bytes=int(a.max_shard_gb * 2**30),
        tokenizer=False if a.no_tokenizer else None,
        router_gain=a.router_gain,
        expert_shared=a.expert_shared,
    )
    print(
        f"wrote {a.preset} ({cfg['num_hidden_layers']} layers, H={cfg['hidden_size']}) "
        f"{a.format}/{a.names} checkpoint to {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
