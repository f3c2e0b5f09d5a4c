"""Generate a random-weight DeepSeek V4 checkpoint that vLLM 0.21.0 and HF transformers 5.17.0 load.

    dsv4-tiny-model OUT [--format native|native-fp8|nvfp4|nvidia-mixed|ct-nvfp4-fp8|bf16]
        [--names native|hf] [--preset tiny|flash-layers] [--layers N] [--seed N]
        [--config JSON|FILE] [--device cpu|cuda] [--router-gain G] [--expert-shared R] [--force]
    dsv4-tiny-model --list [--preset P] [--format F] [--config JSON|FILE]
    (or python -m cutedsl.tools.tiny_model ...)

Formats (what each quantizable projection is stored as; everything else is identical):
  native        FP8 block-128 e4m3 + e8m0 `.scale` for attention, indexer.wq_b and shared expert;
                MXFP4 routed experts (int8 e2m1x2 + e8m0 `.scale` per 32), as DeepSeek ships V4-Flash.
  native-fp8    FP8 block everywhere incl. experts, f32 `.scale` (`expert_dtype: fp8`, V4-Flash-Base).
  nvfp4         full ModelOpt NVFP4: every quantizable projection (fused_wqa_wkv pair, wq_b, wo_a,
                wo_b, indexer.wq_b, shared expert, routed experts): `.weight` uint8 [N, K/2],
                `.weight_scale` e4m3 [N, K/16], `.weight_scale_2` f32 [], `.input_scale` f32 [].
  nvidia-mixed  NVIDIA ModelOpt's published layout (nvidia/DeepSeek-V4-Flash-NVFP4, -Pro-NVFP4):
                native, with the main layers' routed experts ModelOpt NVFP4 (the MTP block's
                stay MXFP4); config.json `quantization_config` = DeepSeek's FP8 config +
                `moe_quant_algo: NVFP4`, `quant_algo: MIXED_PRECISION`, `quantized_layers` (one
                `layers.L.ffn.experts` each) and `ignore`, plus ModelOpt's `hf_quant_config.json`.
  ct-nvfp4-fp8  compressed-tensors, RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8: routed and shared experts
                nvfp4-pack-quantized (`weight_packed` u8, `weight_scale` e4m3, `weight_global_scale`
                and `input_global_scale` f32 [1] = 1 / ModelOpt's weight_scale_2 / input_scale),
                wq_a/wkv/wq_b/wo_a/wo_b and indexer.wq_b FP8 block (`weight` e4m3 + `weight_scale`
                BF16 [N/128, K/128]), the rest BF16; an MTP block stays BF16 (canada-quant's variant).
  bf16          every weight BF16, no quantization_config (HF / converter input; pristine vLLM
                0.21.0 cannot load it: DeepseekV4Attention reads quantization_config["scale_fmt"]).
MTP: `--config '{"num_nextn_predict_layers": 1}'` adds the `mtp.0.*` block (a decoder block at
layer index num_hidden_layers, e_proj, h_proj, enorm, hnorm, norm, hc_head_*, emb.tok_emb, head),
stored like the format's main layers (ct-nvfp4-fp8: BF16); compress_ratios needs an entry for it.
The layouts and their sources: cutedsl/tools/schema.py and tests/test_checkpoint_layouts.py.
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
flips one expert at a few positions and those positions' logits jump (diagnosis in
bench/results/cpu/README.md). Two knobs bound that, both realistic for trained
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
most --max-shard-gb), model.safetensors.index.json, the tokenizer files and the marker
.cutedsl-checkpoint.json (what was written). Written into a temporary folder next to OUT and
renamed at the end: a failure, SIGTERM or Ctrl-C never leaves a half-written OUT or the temporary
folder. --force replaces an OUT that holds only what a cutedsl tool wrote, never other files.
--config keys and value types are checked against the DeepSeek V4 config schema.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import zlib
from collections.abc import Iterator

import torch

from cutedsl.tools import cli, tiny_tokenizer
from cutedsl.tools.checkpoint import check_output, encode_linear, write_checkpoint
from cutedsl.tools.cli import UsageError
from cutedsl.tools.schema import (
    FORMATS,
    PLAIN_DTYPES,
    ConfigError,
    Spec,
    check_config,
    expected_tensors,
    hf_quant_config,
    make_config_like,
    mtp_layers,
    quantization_config,
    storage_of,
    tensor_specs,
    validate_config,
)

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
    "mtp_layers",
    "tensor_specs",
    "storage_of",
    "expected_tensors",
    "quantization_config",
    "master_tensor",
    "write_checkpoint",
    "generate",
    "main",
]

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


def make_config(
    preset: str = "tiny",
    fmt: str = "native",
    overrides: dict | None = None,
    layers: int | None = None,
) -> dict:
    """Config dict (native DeepSeek keys, what vLLM 0.21.0 reads) for a preset and format.

    overrides: config keys to replace, checked against the DSv4 schema (unknown keys and wrong
    types are refused); raises ConfigError naming the key."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if layers is not None and (
        isinstance(layers, bool) or not isinstance(layers, int) or layers < 1
    ):
        raise ConfigError(f"layers must be an integer >= 1, got {layers!r}")
    if overrides:
        validate_config(overrides, where="config overrides", required=False)
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

    def master(s: Spec) -> torch.Tensor:
        return master_tensor(s, cfg, seed, device, router_gain, expert_shared)

    specs = tensor_specs(cfg, mtp=True)
    groups = _fused_partners(specs) if fmt in ("nvfp4", "nvidia-mixed", "ct-nvfp4-fp8") else {}
    cache: dict[str, torch.Tensor] = {}  # masters of fused partners generated ahead of time
    gamax: dict[str, float] = {}
    if progress:
        from tqdm import tqdm

        specs_it = tqdm(specs, desc=f"tiny_model {fmt}", unit="tensor")
    else:
        specs_it = specs
    for s in specs_it:
        layer = -1
        if s.name.startswith("layers."):
            layer = int(s.name.split(".")[1])
        elif s.name.startswith("mtp."):
            layer = cfg["num_hidden_layers"] + int(s.name.split(".")[1])
        m = cache.pop(s.name, None)
        if m is None:
            m = master(s)
        if s.kind == "linear":
            # Quantize from the BF16-rounded master so every format has one BF16 source.
            m = m.bfloat16().float()
            st = storage_of(s, fmt)
            ga = None
            if st in ("nvfp4", "ct_nvfp4") and s.fuse in groups:
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
            items = {s.name: m.to(PLAIN_DTYPES[s.kind])}
        yield layer, {k: v.contiguous().cpu() for k, v in items.items()}


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
    if not (math.isfinite(router_gain) and router_gain > 0.0):
        raise ValueError(f"router_gain={router_gain}, expected > 0")
    if not 0.0 <= expert_shared < 1.0:
        raise ValueError(f"expert_shared={expert_shared}, expected 0 <= r < 1")
    if max_shard_bytes < 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}, expected >= 0")
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
        extra = tiny_tokenizer.tokenizer_files(cfg["vocab_size"]) if tokenizer else {}
        hqc = hf_quant_config(cfg, fmt)
        if hqc is not None:
            extra = {**extra, "hf_quant_config.json": hqc}
        write_checkpoint(
            out, cfg, it, scheme=scheme, max_shard_bytes=max_shard_bytes, force=force,
            extra_files=extra or None, writer="cutedsl.tools.tiny_model",
        )  # fmt: skip
    return cfg


# ---------------------------------------------------------------------------------------------
# Command line


def _parse_overrides(arg: str | None) -> dict | None:
    """--config: a JSON object, or the path of a file holding one; checked against the schema."""
    if arg is None:
        return None
    text, where = arg, "--config"
    if not arg.lstrip().startswith("{"):
        where = f"--config file {arg}"
        try:
            with open(arg) as f:
                text = f.read()
        except FileNotFoundError:
            raise UsageError(
                f"--config: {arg!r} is neither a JSON object nor an existing file"
            ) from None
        except OSError as e:
            raise UsageError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{where}: not valid JSON ({e})") from None
    validate_config(obj, where=where, required=False)
    return obj


def _positive(name: str, v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise UsageError(f"{name}: must be a positive number, got {v}")


def _check_device(dev: str) -> None:
    try:
        d = torch.device(dev)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: {dev!r} is not a device (cpu, cuda, cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: {dev!r}: only cpu and cuda are supported")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {dev}: no CUDA GPU is visible")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UsageError(f"--device {dev}: only {torch.cuda.device_count()} GPU(s) are visible")


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.tiny_model", "dsv4-tiny-model", __doc__)
    ap.add_argument("out", nargs="?", help="output checkpoint folder (without it: as --list)")
    ap.add_argument("--format", default="native", choices=FORMATS, help="weight format")
    ap.add_argument(
        "--names", default="native", choices=("native", "hf"), help="tensor naming scheme"
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model dimensions")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth (>= 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the master weights")
    ap.add_argument(
        "--config",
        default=None,
        metavar="JSON|FILE",
        help="JSON object (or a file holding one) overriding config keys; keys and value types "
        "are checked against the DeepSeek V4 config schema",
    )
    ap.add_argument(
        "--device", default="cpu", help="where to generate and quantize (cpu, cuda, cuda:N)"
    )
    ap.add_argument(
        "--max-shard-gb", type=float, default=2.0, help="shard size in GiB (> 0; default 2)"
    )
    ap.add_argument(
        "--router-gain", type=float, default=DEFAULT_ROUTER_GAIN,
        help="std of the router logits (> 0; 1: unconditioned)",
    )  # fmt: skip
    ap.add_argument(
        "--expert-shared", type=float, default=DEFAULT_EXPERT_SHARED,
        help="variance fraction common to a layer's routed experts (0 <= r < 1; 0: independent)",
    )  # fmt: skip
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace an existing OUT that holds only what a cutedsl tool wrote",
    )
    ap.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    ap.add_argument("--list", action="store_true", help="print the tensor table and exit")
    a = ap.parse_args(argv)
    return cli.run(ap.prog, lambda: _main(a), a.debug)


def _main(a) -> int:
    if a.layers is not None and a.layers < 1:
        raise UsageError(f"--layers: must be >= 1, got {a.layers}")
    _positive("--max-shard-gb", a.max_shard_gb)
    _positive("--router-gain", a.router_gain)
    if not 0.0 <= a.expert_shared < 1.0:
        raise UsageError(f"--expert-shared: must be in [0, 1), got {a.expert_shared}")
    _check_device(a.device)
    overrides = _parse_overrides(a.config)
    cfg = make_config(a.preset, a.format, overrides, a.layers)
    if a.list or not a.out:
        exp = expected_tensors(cfg, a.format, a.names)
        total = 0
        for n, (shape, dt) in exp.items():
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
            if ".experts." in n and ".experts.0." not in n:
                continue
            print(f"{n:70s} {str(list(shape)):18s} {str(dt).replace('torch.', '')}")
        print(f"# {len(exp)} tensors (experts.0 shown), {total / 2**20:.1f} MiB")
        return 0
    check_output(a.out, a.force)
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
