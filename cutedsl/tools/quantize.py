"""Convert a DeepSeek V4 checkpoint into a full-NVFP4 ModelOpt checkpoint; DSv4 checkpoint codecs.

    dsv4-quantize SRC DST [--names native|hf] [--input-amax A] [--device cpu|cuda[:N]] [--force]
    (or python -m cutedsl.tools.quantize ...)

SRC: a DSv4 checkpoint in one of the layouts `cutedsl.tools.tiny_model` knows (and DeepSeek,
NVIDIA and Red Hat ship): native (FP8 block + e8m0 scales, MXFP4 experts), native-fp8 (FP8 block
+ f32 scales everywhere, `expert_dtype: fp8`), nvidia-mixed (ModelOpt NVFP4 experts in the main
layers, MXFP4 MTP experts, FP8 rest), ct-nvfp4-fp8 (compressed-tensors NVFP4 experts, FP8 block
attention, BF16 rest) or bf16; native or HF tensor names; with or without its `mtp.*` block. DST: the same model with every quantizable projection (fused_wqa_wkv pair,
wq_b, wo_a, wo_b, indexer.wq_b, shared expert, routed experts) in ModelOpt NVFP4
(`.weight` uint8 [N, K/2], `.weight_scale` e4m3 [N, K/16], `.weight_scale_2` f32 [],
`.input_scale` f32 []), fused pairs (wq_a+wkv, w1+w3) sharing one global scale, everything else
copied bit for bit, and a config.json whose quantization_config is ModelOpt NVFP4 (scale_fmt kept).
Already-NVFP4 experts are not re-quantized: ModelOpt ones (nvidia-mixed) are copied, and
compressed-tensors ones become ModelOpt's by renaming (`weight_packed` -> `weight`) and taking the
reciprocal of the global scales, unless a w1/w3 pair has two global scales (then the pair is
re-quantized with one shared scale, as vLLM's fused w13 needs). The `mtp.*` block is converted
like the main layers (its e_proj / h_proj too).

The whole SRC is checked before anything is written: config.json against the DeepSeek V4 schema
(model_type, keys, types, vLLM's constraints), every shard's header (a truncated or corrupt shard
is named), and the tensors against the layout the config implies (unknown, missing and
mis-shaped tensors are named). DST must not be SRC, lie inside it or contain it. Conversion runs
shard by shard (one output shard per input shard, one tensor in memory at a time besides the
shard being written), into a temporary folder next to DST that is renamed at the end, so DST is
never half-written, also on SIGTERM or Ctrl-C. --force replaces a DST that holds only what a
cutedsl tool wrote (its .cutedsl-checkpoint.json marker), never other files. `mtp.*` tensors the
config does not describe are copied as is. `input_scale` of re-quantized projections is not
calibrated: amax --input-amax (default 32, > 0) / (6*448). --device cuda[:N] dequantizes and
re-quantizes on that GPU instead of the CPU; the output must be the CPU's bit for bit
(tests/test_quantize.py, a GPU test).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator

import torch

from cutedsl import names as N
from cutedsl.tools import cli
from cutedsl.tools.checkpoint import (
    FP8_BLOCK,
    MX_BLOCK,
    Checkpoint,
    CheckpointError,
    check_output,
    dequantize_fp8_block,
    dequantize_mxfp4,
    encode_nvfp4,
    has_mtp_block,
    quantize_fp8_block,
    quantize_mxfp4,
    read_linear,
    validate_layout,
    write_checkpoint,
)
from cutedsl.tools.cli import UsageError
from cutedsl.tools.schema import (
    ConfigError,
    detect_format,
    make_config_like,
    storage_of,
    tensor_specs,
)

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
    "main",
    "FP8_BLOCK",
    "MX_BLOCK",
]

# A source checkpoint the converter refuses (names the offending file or tensor).
ConversionError = CheckpointError


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(items, desc: str, on: bool, total: int | None = None):
    """tqdm over items (or a bar of `total` when items is None); nothing when not `on`."""
    if not on:
        return _NoBar() if items is None else items
    from tqdm import tqdm

    if items is None:
        return tqdm(total=total, desc=desc, unit="tensor")
    return tqdm(items, desc=desc, unit="tensor")


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """A compressed-tensors global scale (a divisor, shape () or (1,)) -> ModelOpt's, shape ()."""
    return (1.0 / t.double().reshape(())).float()


def convert(
    src: str,
    dst: str,
    names: str | None = None,
    input_amax: float = 32.0,
    force: bool = False,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> dict:
    """Convert checkpoint `src` into a full-NVFP4 ModelOpt checkpoint at `dst`; returns its config.

    names: naming scheme of the output ("native"/"hf"; None keeps the source's).
    device: where the re-quantized projections are dequantized and quantized (None: the CPU);
    the tensors written are the same on every device.
    Raises ConversionError (DST untouched) for unknown layouts, missing/unknown tensors or
    inconsistent shapes/dtypes, UsageError for a DST that is or lies inside SRC (or holds files
    no cutedsl tool wrote), FileExistsError if dst exists and not force.
    """
    if not (math.isfinite(input_amax) and input_amax > 0):
        raise ConversionError(f"input_amax must be a positive finite number, got {input_amax}")
    if names not in (None, "native", "hf"):
        raise ConversionError(f"names must be 'native' or 'hf', got {names!r}")
    dst_abs = check_output(dst, force, inputs=[src], what="DST")
    ck = Checkpoint(src)
    try:
        fmt = detect_format(ck.config)
    except ConfigError as e:
        raise ConversionError(f"{ck.path}/config.json: {e}") from None
    if fmt == "nvfp4":
        raise ConversionError(f"{ck.path} is already a full NVFP4 ModelOpt checkpoint")
    mtp = validate_layout(ck, fmt)
    out_scheme = names or ck.scheme
    out_cfg = make_config_like(ck.config, "nvfp4")
    specs = tensor_specs(ck.config, mtp=has_mtp_block(ck))

    def sname(native: str) -> str:
        return native if native.startswith("mtp.") else N.to_scheme(native, ck.scheme)

    def ct_scale(name: str) -> float:
        return float(ck.get(sname(f"{name}.weight_global_scale")).float().reshape(-1)[0])

    # compressed-tensors NVFP4 pairs with one global scale convert bit for bit; others re-quantize
    ct_groups: dict[str, list[str]] = {}
    for s in specs:
        if s.kind == "linear" and storage_of(s, fmt) == "ct_nvfp4":
            ct_groups.setdefault(s.fuse or s.name, []).append(s.name)
    lossless_ct = {
        n for group in ct_groups.values() if len({ct_scale(n) for n in group}) == 1 for n in group
    }

    def primary(s) -> str:  # the tensor whose shard decides where the spec's output goes
        if s.kind == "linear" and storage_of(s, fmt) == "ct_nvfp4":
            return sname(f"{s.name}.weight_packed")
        return sname(f"{s.name}.weight" if s.kind in ("linear", "bf16_linear") else s.name)

    # Pass 1: shared global amax per fused group, from the dequantized source.
    group_amax: dict[str, float] = {}
    fused = [
        s
        for s in specs
        if s.kind == "linear"
        and s.fuse is not None
        and storage_of(s, fmt) != "nvfp4"
        and s.name not in lossless_ct
    ]
    with torch.no_grad():
        for s in _progress(fused, "quantize: amax", progress):
            a = float(read_linear(ck, sname(s.name), device).abs().amax())
            group_amax[s.fuse] = max(group_amax.get(s.fuse, 0.0), a)

    shard_of = {fn: i for i, fn in enumerate(ck.shard_files())}
    by_shard: dict[int, list] = {}
    for s in specs:
        by_shard.setdefault(shard_of[ck.files[primary(s)]], []).append(s)
    for n in mtp:
        by_shard.setdefault(shard_of[ck.files[n]], []).append(n)
    bar = _progress(None, "quantize: nvfp4", progress, total=len(specs) + len(mtp))

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
                    if s.name in lossless_ct:  # compressed-tensors NVFP4 -> ModelOpt
                        n = s.name
                        yield (
                            shard,
                            {
                                f"{n}.weight": ck.get(sname(f"{n}.weight_packed")),
                                f"{n}.weight_scale": ck.get(sname(f"{n}.weight_scale")),
                                f"{n}.weight_scale_2": _reciprocal(
                                    ck.get(sname(f"{n}.weight_global_scale"))
                                ),
                                f"{n}.input_scale": _reciprocal(
                                    ck.get(sname(f"{n}.input_global_scale"))
                                ),
                            },
                        )
                        continue
                    w = read_linear(ck, sname(s.name), device)
                    ga = group_amax.get(s.fuse) if s.fuse is not None else None
                    t = encode_nvfp4(s.name, w, group_amax=ga, input_amax=input_amax)
                    yield shard, {k: v.cpu() for k, v in t.items()}
        bar.close()

    if mtp:
        print(
            f"warning: {len(mtp)} mtp.* tensors the config does not describe are copied "
            "unconverted",
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
        writer="cutedsl.tools.quantize",
    )
    return out_cfg


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.quantize", "dsv4-quantize", __doc__)
    ap.add_argument("src", metavar="SRC", help="source DeepSeek V4 checkpoint folder (read only)")
    ap.add_argument(
        "dst", metavar="DST", help="output folder (not SRC, not inside SRC, not containing it)"
    )
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
        help="activation amax of the static input_scale (> 0; not calibrated; default 32)",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace an existing DST that holds only what a cutedsl tool wrote",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where to dequantize and re-quantize: cpu (default) or cuda[:N] (the same output)",
    )
    a = ap.parse_args(argv)
    return cli.run(ap.prog, lambda: _main(a), a.debug)


def _device(spec: str) -> torch.device:
    """--device as a torch.device: the CPU, or a CUDA GPU this process can see."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec}: expected cpu or cuda[:N]") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {spec}: expected cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {spec}: no CUDA GPU visible (torch.cuda.is_available() is False)"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return device


def _main(a) -> int:
    if not (math.isfinite(a.input_amax) and a.input_amax > 0):
        raise UsageError(f"--input-amax: must be a positive number, got {a.input_amax}")
    if not os.path.isdir(a.src):
        what = "is not a folder" if os.path.exists(a.src) else "does not exist"
        raise UsageError(f"SRC {a.src} {what}")
    device = _device(a.device)
    check_output(a.dst, a.force, inputs=[a.src], what="DST")
    cfg = convert(a.src, a.dst, a.names, a.input_amax, a.force, progress=True, device=device)
    print(f"wrote full-NVFP4 checkpoint ({cfg['num_hidden_layers']} layers) to {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
