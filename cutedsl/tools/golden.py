"""Golden reference: HF transformers 5.17.0 `DeepseekV4ForCausalLM` on dequantized weights.

    dsv4-golden CKPT (--tokens 1,2,3 | --random N [--seed S]) [--out logits.pt [--force]]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--swa-rope hf|vllm] [--act-quant nvfp4]
        [--rms]
    (or python -m cutedsl.tools.golden ...)

Loads any checkpoint `cutedsl.tools.tiny_model` writes (native, native-fp8, nvfp4, nvidia-mixed,
bf16; native or HF names; also the converter's output): every quantized projection is
dequantized (FP8 block, MXFP4, NVFP4 -> the exact real values), mapped to HF module names by
`cutedsl.names` (the one mapping) and loaded into the HF model, which nobody on this project
wrote. The model computes in float32 by default (the dequantized weights are exact in fp32, so
the only approximations are the HF model's own); `--dtype bfloat16` casts every parameter to
BF16 (HF 5.17's mixed fp32-norm/bf16 layout does not run: fp32 RMSNorm output meets bf16 q_a_proj).

`--swa-rope vllm` makes the sliding-window (ratio 0) layers use YaRN like vLLM 0.21.0 does
(deepseek_v4.py:1013-1026 mutates one shared rope dict and applies `deepseek_yarn` to every
layer), instead of plain RoPE theta=rope_theta as HF and DeepSeek's reference do (reference
`inference/model.py`: "disable YaRN ... in pure sliding-window attention"). Use it to separate that
known difference from real bugs.

`--act-quant nvfp4` rounds the input of every GEMM the SM100 backend runs W4A4 to NVFP4 with
its static input scale (`quantize_activations`): the golden reference of that backend, whose
activation rounding the default W4A16 golden does not model.

The arguments, the checkpoint's config.json, shard headers and tensor layout, the token ids
(inside the vocabulary) and the --out folder are all checked before the model is built; --out is
written beside itself and renamed (mode from the umask), and is not replaced without --force.

API: `load_model(ckpt, device, dtype, swa_rope, act_quant)`, `golden_logits(model, token_ids)`
-> float32 [T, V] (one full causal forward: logits at position t depend on tokens <= t only, so it
serves prefill and teacher-forced decode positions alike), `layer_rms(model, token_ids)`.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch

from cutedsl import formats
from cutedsl import names as N
from cutedsl.tools import cli
from cutedsl.tools.checkpoint import Checkpoint, read_input_scale, read_linear, validate_layout
from cutedsl.tools.cli import UsageError
from cutedsl.tools.schema import detect_format, tensor_specs

__all__ = [
    "hf_config",
    "dequantized_state_dict",
    "w4a4_input_scales",
    "quantize_activations",
    "load_model",
    "golden_logits",
    "logprob_cosine",
    "layer_rms",
    "main",
]


def hf_config(cfg: dict, swa_rope: str = "hf"):
    """transformers DeepseekV4Config from a checkpoint config.json dict (quantization dropped)."""
    from transformers import DeepseekV4Config

    c = copy.deepcopy(cfg)
    for k in ("quantization_config", "expert_dtype", "architectures", "model_type", "torch_dtype"):
        c.pop(k, None)
    hc = DeepseekV4Config(**c)
    hc._attn_implementation = "eager"
    if swa_rope == "vllm":
        main = copy.deepcopy(hc.rope_parameters["compress"])
        main["rope_theta"] = cfg.get("rope_theta", 10000.0)
        hc.rope_parameters = {"main": main, "compress": hc.rope_parameters["compress"]}
    elif swa_rope != "hf":
        raise ValueError(f"swa_rope must be 'hf' or 'vllm', got {swa_rope!r}")
    return hc


def dequantized_state_dict(
    ckpt: str, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """HF-named state dict of checkpoint `ckpt` with every projection dequantized to `dtype`.

    Floating non-projection tensors (norms, mHC, sinks, ape, gate bias, embed, head) are cast to
    `dtype` too; tid2eid stays int64. Experts are fused as HF stores them:
    gate_up_proj [E, 2I, H] = cat(w1, w3), down_proj [E, H, I].
    """
    ck = Checkpoint(ckpt)
    validate_layout(ck, detect_format(ck.config))
    cfg = ck.config
    sd: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def sname(native: str) -> str:
        return N.to_scheme(native, ck.scheme)

    for s in tensor_specs(cfg):
        if s.kind == "linear":
            w = read_linear(ck, sname(s.name)).to(dtype)
            if s.role == "expert":  # layers.L.ffn.experts.E.wX
                parts = s.name.split(".")
                layer, e, which = int(parts[1]), int(parts[4]), parts[5]
                experts.setdefault((layer, which), {})[e] = w
                continue
            sd[N.native_to_hf(f"{s.name}.weight")] = w
        elif s.kind == "bf16_linear":
            sd[N.native_to_hf(f"{s.name}.weight")] = ck.get(sname(f"{s.name}.weight")).to(dtype)
        else:
            t = ck.get(sname(s.name))
            sd[N.native_to_hf(s.name)] = t if s.kind == "tid2eid" else t.to(dtype)
    E = cfg["n_routed_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        w1, w3, w2 = (experts[(layer, w)] for w in ("w1", "w3", "w2"))
        sd[N.hf_expert_param(layer, "gate_up_proj")] = torch.stack(
            [torch.cat([w1[e], w3[e]], dim=0) for e in range(E)]
        )
        sd[N.hf_expert_param(layer, "down_proj")] = torch.stack([w2[e] for e in range(E)])
    return sd


def w4a4_input_scales(ckpt: str) -> dict[str, dict[str, float]]:
    """The static activation scale of every GEMM the SM100 backend runs with NVFP4 activations
    (W4A4), per HF module whose input that GEMM quantizes: {module: {"input": s}}, and for the
    routed experts {"model.layers.L.mlp.experts": {"input": s13, "down": s2}} (s2 quantizes the
    SwiGLU output that down_proj reads).

    Those GEMMs are the NVFP4 projections of our runners: fused_wqa_wkv (wq_a + wkv: q_a_proj
    and kv_proj read the same input), wq_b, the indexer's wq_b, wo_a, wo_b, the shared experts'
    w13 (w1 + w3) and w2, the routed experts' w13 and w2. One GEMM takes one scale: the max over
    its members (a fused pair, every expert), as vLLM keeps it and `cutedsl.sm100.runners` passes
    it. A projection stored in another format (FP8, MXFP4) has no input scale and is left out."""
    ck = Checkpoint(ckpt)
    cfg = ck.config
    groups: dict[str, list[str]] = {}  # GEMM -> its native projections
    for s in tensor_specs(cfg):
        if s.kind != "linear":
            continue
        if s.role == "expert":  # layers.L.ffn.experts.E.wX -> layers.L.ffn.experts.{w13,w2}
            head, _, which = s.name.rsplit(".", 2)
            key = f"{head}.{'w2' if which == 'w2' else 'w13'}"
        else:
            key = s.fuse or s.name
        groups.setdefault(key, []).append(s.name)
    out: dict[str, dict[str, float]] = {}
    for key, members in groups.items():
        scales = [read_input_scale(ck, N.to_scheme(m, ck.scheme)) for m in members]
        if any(v is None for v in scales):
            continue  # not NVFP4 (or a fused group stored otherwise): no W4A4 GEMM
        scale = max(float(v) for v in scales)
        if ".ffn.experts." in key:
            layer = int(key.split(".")[1])
            mod = N.hf_expert_param(layer, "down_proj").rsplit(".", 1)[0]
            out.setdefault(mod, {})["down" if key.endswith(".w2") else "input"] = scale
            continue
        for m in members:
            out[N.native_to_hf(f"{m}.weight").removesuffix(".weight")] = {"input": scale}
    return out


def _round_nvfp4(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to NVFP4 as one GEMM's activation: e2m1 values in blocks of 16 along the last
    dimension with dynamic e4m3 block scales under the static global `scale` (vLLM's
    ref_nvfp4_quant arithmetic, `cutedsl.formats`), dequantized back to x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).float()
    gs = torch.tensor(scale, dtype=torch.float32, device=x.device)
    q = formats.quantize_nvfp4_activation(rows, gs)
    return formats.dequantize_nvfp4(*q, torch.float32).reshape(x.shape).to(x.dtype)


def quantize_activations(model, ckpt: str) -> int:
    """Make `model` (`load_model`'s, of checkpoint `ckpt`) compute with NVFP4 activations where
    the SM100 backend does (`w4a4_input_scales`): each such GEMM's input is rounded to NVFP4 with
    its static scale before the fp32 product, so the model is the W4A4 golden reference of that
    backend. Returns the number of modules changed; raises ValueError when the checkpoint has no
    NVFP4 projection with an input scale (nothing would change)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    class _W4A4Experts(DeepseekV4Experts):
        """The SwiGLU output rounded to NVFP4 before down_proj reads it."""

        w4a4_down: float

        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            return _round_nvfp4(super()._apply_gate(gate_up), self.w4a4_down)

    scales = w4a4_input_scales(ckpt)
    if not scales:
        raise ValueError(
            f"golden: {ckpt} has no NVFP4 projection with an input scale: no W4A4 GEMM"
        )
    mods = dict(model.named_modules())
    missing = sorted(set(scales) - set(mods))
    if missing:
        raise RuntimeError(
            f"golden: the HF model has no module {missing[0]} ({len(missing)} missing)"
        )

    def rounding_hook(name: str, scale: float):
        def hook(_mod, args, kwargs):
            if not args:  # HF passes every such module its input positionally
                raise RuntimeError(f"golden: {name} was called without a positional input")
            return (_round_nvfp4(args[0], scale), *args[1:]), kwargs

        return hook

    for name, sc in scales.items():
        mod = mods[name]
        if "input" in sc:
            mod.register_forward_pre_hook(rounding_hook(name, sc["input"]), with_kwargs=True)
        if "down" in sc:
            if type(mod) is not DeepseekV4Experts:
                raise RuntimeError(f"golden: {name} is a {type(mod).__name__}, not the HF experts")
            mod.__class__ = _W4A4Experts
            mod.w4a4_down = sc["down"]
    return len(scales)


def load_model(
    ckpt: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    swa_rope: str = "hf",
    act_quant: str | None = None,
):
    """HF DeepseekV4ForCausalLM holding the dequantized weights of `ckpt`, eval mode, on device.

    Every parameter and persistent buffer is loaded from the checkpoint (strict); raises
    RuntimeError naming missing/unexpected keys otherwise. act_quant "nvfp4": the W4A4 golden
    of the SM100 backend (`quantize_activations`); None: activations stay in `dtype`.
    """
    if act_quant not in (None, "nvfp4"):
        raise ValueError(f"act_quant must be None or 'nvfp4', got {act_quant!r}")
    from transformers import DeepseekV4ForCausalLM
    from transformers.initialization import no_init_weights

    cfg = Checkpoint(ckpt).config
    hc = hf_config(cfg, swa_rope)
    sd = dequantized_state_dict(ckpt, dtype)
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with no_init_weights(), torch.device(device):
            model = DeepseekV4ForCausalLM(hc)
    finally:
        torch.set_default_dtype(prev)
    res = model.load_state_dict(sd, strict=False)
    # Non-persistent rotary buffers are recomputed by the model itself.
    missing = [k for k in res.missing_keys if "rotary_emb" not in k]
    if missing or res.unexpected_keys:
        raise RuntimeError(
            f"golden: checkpoint {ckpt} does not fill the HF model: missing {missing[:8]} "
            f"({len(missing)}), unexpected {res.unexpected_keys[:8]} ({len(res.unexpected_keys)})"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    if act_quant == "nvfp4":
        quantize_activations(model, ckpt)
    return model.eval()


def _ids(token_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    if ids.ndim != 1:
        raise ValueError(f"token_ids: shape {tuple(ids.shape)}, expected [T]")
    return ids[None]


@torch.no_grad()
def golden_logits(model, token_ids) -> torch.Tensor:
    """float32 logits [T, V] for token ids [T] (one causal forward, no cache)."""
    dev = next(model.parameters()).device
    out = model(input_ids=_ids(token_ids, dev), use_cache=False)
    return out.logits[0].float()


def logprob_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of the centred vectors a, b [..., V] (log-probs or logits: centring makes
    it shift-invariant), in float64: the agreement metric against the golden reference."""
    a, b = a.double(), b.double()
    return torch.nn.functional.cosine_similarity(
        a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True), dim=-1
    )


@torch.no_grad()
def layer_rms(model, token_ids) -> dict[str, float]:
    """RMS of the residual streams after each decoder layer, of each MoE block output, and of
    the final normed hidden state (checks that activations neither blow up nor collapse)."""
    rec: dict[str, float] = {}
    hooks = []

    def mk(name):
        def hook(mod, inp, out):
            o = out[0] if isinstance(out, tuple) else out
            rec[name] = float(o.float().pow(2).mean().sqrt())

        return hook

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(mk(f"layer{i}.residual")))
        hooks.append(layer.self_attn.register_forward_hook(mk(f"layer{i}.attn_out")))
        hooks.append(layer.mlp.register_forward_hook(mk(f"layer{i}.moe_out")))
    hooks.append(model.model.norm.register_forward_hook(mk("final_norm")))
    try:
        logits = golden_logits(model, token_ids)
    finally:
        for h in hooks:
            h.remove()
    rec["logits_std"] = float(logits.std())
    return rec


def _token_ids(text: str) -> list[int]:
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            ids.append(int(item))
        except ValueError:
            raise UsageError(f"--tokens: {item!r} is not an integer token id") from None
    if not ids:
        raise UsageError("--tokens: no token ids given")
    return ids


def _check_out(out: str, ckpt: str, force: bool) -> None:
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a folder; give a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"--out {out}: folder {parent} does not exist")
    if cli.is_within(out, ckpt):
        raise UsageError(f"--out {out} lies inside the checkpoint {ckpt}; write it elsewhere")
    if os.path.lexists(out) and not force:
        raise FileExistsError(f"--out {out} exists; pass --force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out}: folder {parent} is not writable")


def _save(obj: dict, out: str) -> None:
    """torch.save into a temporary file beside `out`, then rename (mode from the umask)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(
        os.path.abspath(out)))  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.chmod(tmp, cli.output_mode(directory=False))
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.golden", "dsv4-golden", __doc__)
    ap.add_argument("ckpt", metavar="CKPT", help="DeepSeek V4 checkpoint folder (any format)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma-separated token ids, each in [0, vocab_size)")
    g.add_argument(
        "--random", type=int, metavar="N", help="N >= 1 random token ids in [2, vocab_size)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    ap.add_argument("--out", default=None, help="torch.save {'token_ids', 'logits'} to this file")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:N)")
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype"
    )
    ap.add_argument(
        "--swa-rope",
        default="hf",
        choices=("hf", "vllm"),
        help="RoPE of the sliding-window layers: plain (hf) or YaRN as vLLM 0.21.0 applies it",
    )
    ap.add_argument(
        "--act-quant",
        default=None,
        choices=("nvfp4",),
        help="nvfp4: round the inputs of the GEMMs the SM100 backend runs W4A4 to NVFP4 with "
        "their static input scales (that backend's golden reference); default: none",
    )
    ap.add_argument("--rms", action="store_true", help="print per-layer activation RMS")
    a = ap.parse_args(argv)
    return cli.run(ap.prog, lambda: _main(a), a.debug)


def _main(a) -> int:
    ids = None
    if a.tokens is not None:
        ids = _token_ids(a.tokens)
    elif a.random < 1:
        raise UsageError(f"--random: must be >= 1, got {a.random}")
    try:
        dev = torch.device(a.device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: {a.device!r} is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: no CUDA GPU is visible")
    if a.out is not None:
        _check_out(a.out, a.ckpt, a.force)
    ck = Checkpoint(a.ckpt)
    validate_layout(ck, detect_format(ck.config))
    vocab = ck.config["vocab_size"]
    if ids is not None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UsageError(
                f"--tokens: id {bad[0]} is outside the vocabulary [0, {vocab}) of {a.ckpt}"
            )
    elif vocab <= 2:
        raise UsageError(f"--random: {a.ckpt} has vocab_size {vocab}; ids start at 2")
    else:
        gen = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(2, vocab, (a.random,), generator=gen).tolist()
    model = load_model(a.ckpt, a.device, getattr(torch, a.dtype), a.swa_rope, a.act_quant)
    if a.rms:
        for k, v in layer_rms(model, ids).items():
            print(f"{k:24s} {v:.4f}")
    logits = golden_logits(model, ids)
    if a.out:
        if os.path.lexists(a.out) and not a.force:  # appeared during the forward pass
            raise FileExistsError(f"--out {a.out} exists; pass --force to replace it")
        _save({"token_ids": ids, "logits": logits.cpu()}, a.out)
    top = logits.argmax(-1)
    print(
        f"T={len(ids)} V={logits.shape[-1]} logits std {logits.std():.4f}, "
        f"greedy next tokens (last 8 positions) {top[-8:].tolist()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
