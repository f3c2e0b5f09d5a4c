"""Convert a DeepSeek V4 checkpoint into a full-NVFP4 ModelOpt checkpoint; DSv4 checkpoint codecs.

    python -m cutedsl.tools.quantize SRC DST [--names native|hf] [--input-amax A] [--force]

SRC: a DSv4 checkpoint in one of the layouts `cutedsl.tools.tiny_model` knows (and DeepSeek or
NVIDIA ship): native (FP8 block + e8m0 scales, MXFP4 experts), native-fp8 (FP8 block + f32
scales everywhere, `expert_dtype: fp8`), nvidia-mixed (NVFP4 experts, FP8 rest) or bf16; native
or HF tensor names. DST: the same model with every quantizable projection (fused_wqa_wkv pair,
wq_b, wo_a, wo_b, indexer.wq_b, shared expert, routed experts) in ModelOpt NVFP4
(`.weight` uint8 [N, K/2], `.weight_scale` e4m3 [N, K/16], `.weight_scale_2` f32 [],
`.input_scale` f32 []), fused pairs (wq_a+wkv, w1+w3) sharing one global scale, everything else
copied bit for bit, and a config.json whose quantization_config is ModelOpt NVFP4 (scale_fmt kept).
Already-NVFP4 experts (nvidia-mixed) are copied, not re-quantized.

The whole SRC layout is checked against the layout its config implies before anything is written:
unknown tensors, missing tensors and wrong shapes/dtypes are refused with a message naming the
tensor. Conversion runs shard by shard (one output shard per input shard, one tensor in memory at
a time besides the shard being written), into a temporary directory next to DST that is renamed at
the end, so DST is never half-written. `mtp.*` tensors (not used by vLLM 0.21.0) are copied as is.
`input_scale` is not calibrated: amax --input-amax (default 32) / (6*448).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator

import torch

from cutedsl import formats as F
from cutedsl.tools import names as N

__all__ = [
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "encode_nvfp4",
    "Checkpoint",
    "detect_format",
    "read_linear",
    "ConversionError",
    "convert",
]

FP8_BLOCK = 128
MX_BLOCK = 32


class ConversionError(ValueError):
    """A source checkpoint the converter refuses (names the offending tensor)."""


# ---------------------------------------------------------------------------------------------
# Codecs (torch only)


def _e8m0_from_exp(exp: torch.Tensor) -> torch.Tensor:
    return (exp + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _exp_from_e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8).to(torch.int32) - 127


def quantize_fp8_block(w: torch.Tensor, e8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale [ceil(N/128), ceil(K/128)]), DeepSeek's FP8 block layout.

    e8m0=True: power-of-two scales 2^ceil(log2(amax/448)) stored as float8_e8m0fnu (V4-Flash);
    False: f32 scales amax/448 (V4-Flash-Base). Dequant: e4m3 * scale per 128x128 block.
    """
    n, k = w.shape
    nb, kb = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    wp = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    if e8m0:
        exp = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / F.E4M3_MAX)).to(torch.int32)
        exp = exp.clamp(-127, 127)
        scale = torch.exp2(exp.float())
        stored = _e8m0_from_exp(exp)
    else:
        scale = torch.where(amax > 0, amax / F.E4M3_MAX, torch.ones_like(amax))
        stored = scale
    q = (blocks / scale[:, None, :, None]).clamp(-F.E4M3_MAX, F.E4M3_MAX)
    q = q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), stored.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 [N, K], e8m0 or f32 scale [ceil(N/128), ceil(K/128)]) -> fp32 [N, K]."""
    n, k = q.shape
    exp_shape = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale.shape) != exp_shape:
        raise ValueError(f"FP8 block scale: shape {tuple(scale.shape)}, expected {exp_shape}")
    s = (
        torch.exp2(_exp_from_e8m0(scale).float())
        if scale.dtype == torch.float8_e8m0fnu
        else scale.float()
    )
    s = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return q.float() * s


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (uint8 e2m1x2 [N, K/2] low nibble = even k, e8m0 [N, K/32]).

    Scale 2^ceil(log2(amax/6)) per 32 along K (DeepSeek's MXFP4 experts); e2m1 round to nearest
    even. Dequant: e2m1 * 2^e.
    """
    n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4: K={k} must be a multiple of {MX_BLOCK}")
    blocks = w.float().view(n, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = (
        torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / F.FP4_MAX))
        .to(torch.int32)
        .clamp(-127, 127)
    )
    x = blocks / torch.exp2(exp.float())[..., None]
    codes = F.encode_e2m1(x.view(n, k))
    return F.pack_e2m1(codes).contiguous(), _e8m0_from_exp(exp).contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(uint8 [N, K/2], e8m0 [N, K/32]) -> fp32 [N, K]."""
    n, kh = packed.shape
    k = kh * 2
    if tuple(scale.shape) != (n, k // MX_BLOCK):
        raise ValueError(f"MXFP4 scale: shape {tuple(scale.shape)}, expected {(n, k // MX_BLOCK)}")
    vals = F.decode_e2m1(F.unpack_e2m1(packed)).view(n, k // MX_BLOCK, MX_BLOCK)
    return (vals * torch.exp2(_exp_from_e8m0(scale).float())[..., None]).view(n, k)


def encode_nvfp4(
    name: str, w: torch.Tensor, group_amax: float | None = None, input_amax: float = 32.0
) -> dict[str, torch.Tensor]:
    """w [N, K] -> ModelOpt NVFP4 tensors of linear `name` (weight, weight_scale,
    weight_scale_2, input_scale). group_amax: the amax shared by a fused pair (else w's own)."""
    amax = float(w.abs().amax()) if group_amax is None else float(group_amax)
    gs = F.global_scale_from_amax(torch.tensor(amax, dtype=torch.float32))
    packed, sf, gs = F.quantize_nvfp4(w.float(), gs.to(w.device))
    return {
        f"{name}.weight": packed,
        f"{name}.weight_scale": sf,
        f"{name}.weight_scale_2": gs.reshape(()).float().cpu(),
        f"{name}.input_scale": F.global_scale_from_amax(torch.tensor(input_amax))
        .reshape(())
        .float(),
    }


# ---------------------------------------------------------------------------------------------
# Reading checkpoints

_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class Checkpoint:
    """Read-only view of a safetensors checkpoint directory (single file or sharded with index).

    `.config` the config.json dict, `.files` tensor name -> shard file name, `.meta(name)` ->
    (shape, dtype) without reading data, `.get(name)` -> CPU tensor, `.scheme` "native"/"hf".
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = os.path.abspath(path)
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConversionError(f"{self.path}: no config.json")
        with open(cfg_path) as f:
            self.config = json.load(f)
        idx = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(idx):
            with open(idx) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(self.path, "model.safetensors")):
            with safe_open(os.path.join(self.path, "model.safetensors"), "pt") as h:
                self.files = {k: "model.safetensors" for k in h.keys()}
        else:
            raise ConversionError(f"{self.path}: no model.safetensors(.index.json)")
        self._handles: dict[str, object] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for fn in sorted(set(self.files.values())):
            full = os.path.join(self.path, fn)
            if not os.path.isfile(full):
                raise ConversionError(f"{self.path}: shard {fn} listed in the index is missing")
            h = self._handle(fn)
            for k in h.keys():
                if self.files.get(k) != fn:
                    continue
                sl = h.get_slice(k)
                dt = sl.get_dtype()
                if dt not in _ST_DTYPES:
                    raise ConversionError(f"tensor {k!r}: unsupported safetensors dtype {dt}")
                self._meta[k] = (tuple(sl.get_shape()), _ST_DTYPES[dt])
        missing = sorted(set(self.files) - set(self._meta))
        if missing:
            raise ConversionError(f"tensor {missing[0]!r} is in the index but not in its shard")
        self.scheme = N.detect_scheme(list(self.files))

    def _handle(self, fn: str):
        from safetensors import safe_open

        if fn not in self._handles:
            self._handles[fn] = safe_open(os.path.join(self.path, fn), "pt")
        return self._handles[fn]

    def names(self) -> list[str]:
        return list(self.files)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._meta[name]

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConversionError(f"tensor {name!r} missing from {self.path}")
        return self._handle(self.files[name]).get_tensor(name)

    def shard_files(self) -> list[str]:
        return sorted(set(self.files.values()))


def detect_format(cfg: dict) -> str:
    """The tiny_model format name of a config: native, native-fp8, nvidia-mixed, nvfp4, bf16."""
    qc = cfg.get("quantization_config")
    if not qc:
        return "bf16"
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if "NVFP4" in algo:
            return "nvfp4"
        raise ConversionError(
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
        raise ConversionError(f"config: expert_dtype {ed!r}, expected 'fp4' or 'fp8'")
    raise ConversionError(
        f"quantization_config: quant_method {method!r} is not a known DSv4 layout"
    )


def read_linear(ck: Checkpoint, name: str) -> torch.Tensor:
    """Dequantize linear `name` (in ck's scheme, without leaf) of any known storage -> fp32 [N, K].

    Storage is detected from the tensors present: `.weight_scale_2` -> NVFP4; e4m3 `.weight` +
    `.scale`/`.weight_scale_inv` -> FP8 block; uint8 `.weight` + e8m0 `.scale` -> MXFP4;
    a floating `.weight` alone -> plain.
    """
    w = ck.get(f"{name}.weight")
    if ck.has(f"{name}.weight_scale_2"):
        return F.dequantize_nvfp4(
            w,
            ck.get(f"{name}.weight_scale"),
            ck.get(f"{name}.weight_scale_2").float(),
            dtype=torch.float32,
        )
    scale_name = next(
        (f"{name}.{s}" for s in ("scale", "weight_scale_inv") if ck.has(f"{name}.{s}")), None
    )
    if w.dtype == torch.float8_e4m3fn and scale_name:
        return dequantize_fp8_block(w, ck.get(scale_name))
    if w.dtype == torch.uint8 and scale_name:
        return dequantize_mxfp4(w, ck.get(scale_name))
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32) and scale_name is None:
        return w.float()
    raise ConversionError(
        f"tensor {name}.weight: dtype {w.dtype} with scale {scale_name!r} is no known storage"
    )


# ---------------------------------------------------------------------------------------------
# The converter


def _validate(ck: Checkpoint, cfg: dict, fmt: str) -> list[str]:
    """Check ck's tensors against the layout cfg/fmt implies; return the extra `mtp.*` names."""
    from cutedsl.tools.tiny_model import check_config, expected_tensors

    try:
        check_config(cfg)
    except (KeyError, ValueError) as e:
        raise ConversionError(f"{ck.path}/config.json: {e}") from None
    exp = expected_tensors(cfg, fmt, ck.scheme)
    extra = [n for n in ck.names() if n not in exp]
    mtp = [n for n in extra if n.startswith(("mtp.", "model.mtp."))]
    unknown = sorted(set(extra) - set(mtp))
    if unknown:
        raise ConversionError(
            f"unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all) for a {fmt} "
            f"{ck.scheme}-named DSv4 checkpoint with this config.json"
        )
    for n, (shape, dt) in exp.items():
        if not ck.has(n):
            raise ConversionError(f"missing tensor {n!r} (expected {list(shape)} {dt})")
        got_shape, got_dt = ck.meta(n)
        if tuple(got_shape) != tuple(shape) or got_dt != dt:
            raise ConversionError(
                f"tensor {n!r}: {list(got_shape)} {got_dt}, expected {list(shape)} {dt}"
            )
    return mtp


def convert(
    src: str,
    dst: str,
    names: str | None = None,
    input_amax: float = 32.0,
    force: bool = False,
    progress: bool = False,
) -> dict:
    """Convert checkpoint `src` into a full-NVFP4 ModelOpt checkpoint at `dst`; returns its config.

    names: naming scheme of the output ("native"/"hf"; None keeps the source's).
    Raises ConversionError (DST untouched) for unknown layouts, missing/unknown tensors or
    inconsistent shapes/dtypes, FileExistsError if dst exists and not force.
    """
    from tqdm import tqdm

    from cutedsl.tools.tiny_model import (
        make_config_like,
        storage_of,
        tensor_specs,
        write_checkpoint,
    )

    dst_abs = os.path.abspath(dst)
    if os.path.exists(dst_abs) and not force:
        raise FileExistsError(f"{dst_abs} exists; pass --force to replace it")
    ck = Checkpoint(src)
    fmt = detect_format(ck.config)
    if fmt == "nvfp4":
        raise ConversionError(f"{ck.path} is already a full NVFP4 ModelOpt checkpoint")
    mtp = _validate(ck, ck.config, fmt)
    out_scheme = names or ck.scheme
    out_cfg = make_config_like(ck.config, "nvfp4")
    specs = tensor_specs(ck.config)

    def sname(native: str) -> str:
        return N.to_scheme(native, ck.scheme)

    def primary(s) -> str:  # the tensor whose shard decides where the spec's output goes
        return sname(f"{s.name}.weight" if s.kind in ("linear", "bf16_linear") else s.name)

    # Pass 1: shared global amax per fused group, from the dequantized source.
    group_amax: dict[str, float] = {}
    fused = [
        s
        for s in specs
        if s.kind == "linear" and s.fuse is not None and storage_of(s, fmt) != "nvfp4"
    ]
    with torch.no_grad():
        for s in tqdm(fused, desc="quantize: amax", unit="tensor", disable=not progress):
            a = float(read_linear(ck, sname(s.name)).abs().amax())
            group_amax[s.fuse] = max(group_amax.get(s.fuse, 0.0), a)

    shard_of = {fn: i for i, fn in enumerate(ck.shard_files())}
    by_shard: dict[int, list] = {}
    for s in specs:
        by_shard.setdefault(shard_of[ck.files[primary(s)]], []).append(s)
    for n in mtp:
        by_shard.setdefault(shard_of[ck.files[n]], []).append(n)
    bar = tqdm(
        total=len(specs) + len(mtp), desc="quantize: nvfp4", unit="tensor", disable=not progress
    )

    def items() -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        with torch.no_grad():
            for shard in sorted(by_shard):
                for s in by_shard[shard]:
                    bar.update(1)
                    if isinstance(s, str):  # mtp.* copied verbatim under its source name
                        yield shard, {s: ck.get(s)}
                        continue
                    if s.kind != "linear":
                        leaf = f"{s.name}.weight" if s.kind == "bf16_linear" else s.name
                        yield shard, {leaf: ck.get(sname(leaf))}
                        continue
                    if storage_of(s, fmt) == "nvfp4":  # already NVFP4: copy bit for bit
                        yield (
                            shard,
                            {
                                f"{s.name}.{leaf}": ck.get(sname(f"{s.name}.{leaf}"))
                                for leaf in (
                                    "weight",
                                    "weight_scale",
                                    "weight_scale_2",
                                    "input_scale",
                                )
                            },
                        )
                        continue
                    w = read_linear(ck, sname(s.name))
                    ga = group_amax.get(s.fuse) if s.fuse is not None else None
                    yield shard, encode_nvfp4(s.name, w, group_amax=ga, input_amax=input_amax)
        bar.close()

    if mtp:
        print(
            f"warning: {len(mtp)} mtp.* tensors are copied unconverted (vLLM 0.21.0 skips them)",
            file=sys.stderr,
        )
    write_checkpoint(
        dst_abs,
        out_cfg,
        items(),
        scheme=out_scheme,
        max_shard_bytes=0,
        force=force,
        copy_from=ck.path,
    )
    return out_cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cutedsl.tools.quantize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument(
        "--names",
        default=None,
        choices=("native", "hf"),
        help="naming scheme of DST (default: the source's)",
    )
    ap.add_argument(
        "--input-amax",
        type=float,
        default=32.0,
        help="activation amax for the static input_scale (not calibrated)",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing DST")
    a = ap.parse_args(argv)
    try:
        cfg = convert(a.src, a.dst, a.names, a.input_amax, a.force, progress=True)
    except (ConversionError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote full-NVFP4 checkpoint ({cfg['num_hidden_layers']} layers) to {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
