"""DeepSeek V4 checkpoints on disk: the weight codecs, a validating reader and a safe writer.

Reading (`Checkpoint`): config.json is checked against the DSv4 schema (`cutedsl.tools.schema`)
before any shard is opened; a missing, truncated or corrupt shard is named, and
`validate_layout` names the first unknown, missing or mis-shaped tensor.

Writing (`write_checkpoint`): into a temporary folder beside OUT that is renamed at the end, so a
failure or a SIGTERM/SIGINT (see `cutedsl.tools.cli`) never leaves a half-written OUT or a
temporary folder behind. Files and folders get the modes the user's umask gives. A marker file
(`MARKER`) lists what was written; `force` replaces an existing OUT only when it holds nothing
else, so unrelated files are never deleted. `check_output` makes these checks up front, and
refuses an output that is, or lies inside, an input (or an input inside the output).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

import torch

from cutedsl import formats as F
from cutedsl import names as N
from cutedsl.tools import cli
from cutedsl.tools.cli import UsageError
from cutedsl.tools.schema import ConfigError, check_config, expected_tensors, validate_config

__all__ = [
    "MARKER",
    "FP8_BLOCK",
    "MX_BLOCK",
    "CheckpointError",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "encode_nvfp4",
    "encode_linear",
    "nvfp4_to_ct",
    "Checkpoint",
    "read_linear",
    "read_input_scale",
    "has_mtp_block",
    "validate_layout",
    "foreign_entries",
    "check_output",
    "write_checkpoint",
]

MARKER = ".cutedsl-checkpoint.json"
FP8_BLOCK = 128
MX_BLOCK = 32


class CheckpointError(UsageError):
    """A checkpoint the tools refuse to read (names the file or tensor)."""


# ---------------------------------------------------------------------------------------------
# Codecs (torch only)


def _e8m0_from_exp(exp: torch.Tensor) -> torch.Tensor:
    return (exp + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _exp_from_e8m0(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8).to(torch.int32) - 127


def quantize_fp8_block(
    w: torch.Tensor, e8m0: bool = True, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale [ceil(N/128), ceil(K/128)]), DeepSeek's FP8 block layout.

    e8m0=True: power-of-two scales 2^ceil(log2(amax/448)) stored as float8_e8m0fnu (V4-Flash);
    False: scales amax/448 stored as `scale_dtype` (f32: V4-Flash-Base; bf16: llm-compressor's
    FP8_BLOCK), the codes computed from the stored value. Dequant: e4m3 * scale per block.
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
        stored = scale.to(scale_dtype)
        scale = stored.float()
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
    weight_scale_2, input_scale). group_amax: the amax shared by a fused pair (else w's own);
    input_amax: the activation amax of the static input_scale (> 0)."""
    if not (math.isfinite(input_amax) and input_amax > 0):
        raise ValueError(f"input_amax must be a positive finite number, got {input_amax}")
    amax = float(w.abs().amax()) if group_amax is None else float(group_amax)
    gs = F.global_scale_from_amax(torch.tensor(amax, dtype=torch.float32))
    packed, sf, gs = F.quantize_nvfp4(w.float(), gs.to(w.device))
    return {
        f"{name}.weight": packed,
        f"{name}.weight_scale": sf,
        f"{name}.weight_scale_2": gs.reshape(()).float().cpu(),
        f"{name}.input_scale": F.global_scale_from_amax(torch.tensor(float(input_amax)))
        .reshape(())
        .float(),
    }


def encode_linear(
    name: str,
    w: torch.Tensor,
    storage: str,
    group_amax: float | None = None,
    input_amax: float = 32.0,
) -> dict[str, torch.Tensor]:
    """Quantize a master weight w [N, K] into its checkpoint tensors for `storage`.

    group_amax: NVFP4 only, the amax shared by a fused group (None: this tensor's own amax).
    """
    if storage == "bf16":
        return {f"{name}.weight": w.to(torch.bfloat16)}
    if storage in ("fp8", "fp8_f32"):
        q, s = quantize_fp8_block(w, e8m0=storage == "fp8")
        return {f"{name}.weight": q, f"{name}.scale": s}
    if storage == "mxfp4":  # the packed bytes as I8, as DeepSeek ships them
        q, s = quantize_mxfp4(w)
        return {f"{name}.weight": q.view(torch.int8), f"{name}.scale": s}
    if storage == "nvfp4":
        return encode_nvfp4(name, w, group_amax=group_amax, input_amax=input_amax)
    if storage == "ct_nvfp4":
        return nvfp4_to_ct(
            name, encode_nvfp4(name, w, group_amax=group_amax, input_amax=input_amax)
        )
    if storage == "ct_fp8":
        q, s = quantize_fp8_block(w, e8m0=False, scale_dtype=torch.bfloat16)
        return {f"{name}.weight": q, f"{name}.weight_scale": s}
    raise ValueError(f"{name}: unknown storage {storage!r}")


def nvfp4_to_ct(name: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors of linear `name` -> compressed-tensors `nvfp4-pack-quantized` ones:
    weight -> weight_packed, weight_scale kept, weight_global_scale = 1 / weight_scale_2,
    input_global_scale = 1 / input_scale (compressed-tensors stores the global scales as
    divisors: vLLM's CompressedTensorsW4A4Fp4 takes their reciprocals), each of shape (1,) as
    llm-compressor writes them."""

    def divisor(scale: torch.Tensor) -> torch.Tensor:
        return (1.0 / scale.double()).float().reshape(1)

    return {
        f"{name}.weight_packed": t[f"{name}.weight"],
        f"{name}.weight_scale": t[f"{name}.weight_scale"],
        f"{name}.weight_global_scale": divisor(t[f"{name}.weight_scale_2"]),
        f"{name}.input_global_scale": divisor(t[f"{name}.input_scale"]),
    }


# ---------------------------------------------------------------------------------------------
# Reading

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


def _load_json(path: str, what: str) -> object:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {what}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


class Checkpoint:
    """Read-only view of a safetensors checkpoint folder (single file or sharded with index).

    `.config` the config.json dict, `.files` tensor name -> shard file name, `.meta(name)` ->
    (shape, dtype) without reading data, `.get(name)` -> CPU tensor, `.scheme` "native"/"hf".
    validate: check config.json against the DSv4 schema and vLLM's constraints first.
    """

    def __init__(self, path: str, validate: bool = True):
        from safetensors import safe_open

        self.path = os.path.abspath(path)
        if not os.path.exists(self.path):
            raise CheckpointError(f"{path}: no such checkpoint folder")
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{path}: not a folder (a checkpoint is a folder)")
        cfg_path = os.path.join(self.path, "config.json")
        cfg = _load_json(cfg_path, "config.json (not a checkpoint folder)")
        if validate:
            try:
                validate_config(cfg, where=cfg_path, unknown_keys=True)
                check_config(cfg)  # type: ignore[arg-type]
            except ConfigError as e:
                msg = str(e)
                raise CheckpointError(msg if cfg_path in msg else f"{cfg_path}: {msg}") from None
        elif not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        self.config: dict = cfg  # type: ignore[assignment]
        idx = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(idx):
            obj = _load_json(idx, "index")
            wm = obj.get("weight_map") if isinstance(obj, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{idx}: no 'weight_map' object of tensor -> shard file")
            bad = [v for v in wm.values() if os.path.basename(v) != v or v in ("", ".", "..")]
            if bad:
                raise CheckpointError(f"{idx}: shard {bad[0]!r} is not a file in the folder")
            self.files: dict[str, str] = dict(wm)
        elif os.path.isfile(single):
            self.files = {k: "model.safetensors" for k in self._open(safe_open, single).keys()}
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors(.index.json)")
        if not self.files:
            raise CheckpointError(f"{self.path}: the checkpoint holds no tensors")
        self._handles: dict[str, object] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for fn in sorted(set(self.files.values())):
            full = os.path.join(self.path, fn)
            if not os.path.isfile(full):
                raise CheckpointError(f"{full}: shard listed in the index is missing")
            h = self._handle(fn)
            for k in h.keys():
                if self.files.get(k) != fn:
                    continue
                sl = h.get_slice(k)
                dt = sl.get_dtype()
                if dt not in _ST_DTYPES:
                    raise CheckpointError(f"{full}: tensor {k!r} has unsupported dtype {dt}")
                self._meta[k] = (tuple(sl.get_shape()), _ST_DTYPES[dt])
        missing = sorted(set(self.files) - set(self._meta))
        if missing:
            fn = self.files[missing[0]]
            raise CheckpointError(
                f"{os.path.join(self.path, fn)}: tensor {missing[0]!r} is in the index but not "
                "in this shard"
            )
        try:
            self.scheme = N.detect_scheme(list(self.files))
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    @staticmethod
    def _open(safe_open, full: str):
        try:
            return safe_open(full, "pt")
        except Exception as e:  # SafetensorError, OSError: name the shard
            raise CheckpointError(f"{full}: not a readable safetensors file ({e})") from None

    def _handle(self, fn: str):
        from safetensors import safe_open

        if fn not in self._handles:
            self._handles[fn] = self._open(safe_open, os.path.join(self.path, fn))
        return self._handles[fn]

    def names(self) -> list[str]:
        return list(self.files)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._meta[name]

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} missing from {self.path}")
        fn = self.files[name]
        try:
            return self._handle(fn).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            full = os.path.join(self.path, fn)
            raise CheckpointError(f"{full}: tensor {name!r} unreadable ({e})") from None

    def shard_files(self) -> list[str]:
        return sorted(set(self.files.values()))


def _fp8_scale_dtype(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float8_e8m0fnu, torch.float32) else t.float()


def read_linear(
    ck: Checkpoint, name: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """Dequantize linear `name` (in ck's scheme, without leaf) of any known storage -> fp32 [N, K].

    Storage is detected from the tensors present: `.weight_scale_2` -> NVFP4; `.weight_packed` +
    `.weight_global_scale` -> compressed-tensors NVFP4 (w = e2m1 * weight_scale /
    weight_global_scale); e4m3 `.weight` + `.scale` / `.weight_scale_inv` / `.weight_scale`
    (block shaped) -> FP8 block; uint8 or int8 `.weight` + e8m0 `.scale` -> MXFP4; a floating
    `.weight` alone -> plain. device: where the tensors are read to and dequantized (None: the
    CPU, where they are read).
    """

    def get(n: str) -> torch.Tensor:
        t = ck.get(n)
        return t if device is None else t.to(device)

    if ck.has(f"{name}.weight_packed"):
        if not ck.has(f"{name}.weight_global_scale"):
            raise CheckpointError(
                f"tensor {name}.weight_packed: no {name}.weight_global_scale beside it "
                f"({os.path.join(ck.path, ck.files[name + '.weight_packed'])})"
            )
        w_gs = (1.0 / _positive_scalar(ck, f"{name}.weight_global_scale")).float()
        return F.dequantize_nvfp4(
            get(f"{name}.weight_packed"),
            get(f"{name}.weight_scale"),
            w_gs if device is None else w_gs.to(device),
            dtype=torch.float32,
        )
    w = get(f"{name}.weight")
    if ck.has(f"{name}.weight_scale_2"):
        return F.dequantize_nvfp4(
            w,
            get(f"{name}.weight_scale"),
            get(f"{name}.weight_scale_2").float(),
            dtype=torch.float32,
        )
    scale_name = next(
        (
            f"{name}.{s}"
            for s in ("scale", "weight_scale_inv", "weight_scale")
            if ck.has(f"{name}.{s}")
        ),
        None,
    )
    if w.dtype == torch.float8_e4m3fn and scale_name:
        return dequantize_fp8_block(w, _fp8_scale_dtype(get(scale_name)))
    if w.dtype in _PACKED and scale_name:
        return dequantize_mxfp4(w.view(torch.uint8), get(scale_name))
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32) and scale_name is None:
        return w.float()
    raise CheckpointError(
        f"tensor {name}.weight: dtype {w.dtype} with scale {scale_name!r} is no known storage"
    )


def read_input_scale(ck: Checkpoint, name: str) -> torch.Tensor | None:
    """The static activation scale of linear `name` (in ck's scheme, without leaf), fp32 0-dim in
    ModelOpt's convention (multiply to dequantize): its `.input_scale`, or the reciprocal of
    compressed-tensors' `.input_global_scale` (a divisor); None where it has neither (FP8, MXFP4,
    plain weights). Raises CheckpointError unless the scale is one positive finite value."""
    for leaf, divisor in (("input_scale", False), ("input_global_scale", True)):
        if ck.has(f"{name}.{leaf}"):
            t = _positive_scalar(ck, f"{name}.{leaf}")
            return (1.0 / t if divisor else t).float()
    return None


def _positive_scalar(ck: Checkpoint, full: str) -> torch.Tensor:
    """Tensor `full` (shape () or (1,)) as a float64 0-dim on the CPU; CheckpointError naming it
    and its file unless it is one positive finite value."""
    t = ck.get(full).double().reshape(-1)
    if t.numel() != 1 or not bool(torch.isfinite(t[0]) and t[0] > 0):
        raise CheckpointError(
            f"tensor {full}: expected one positive finite value, got {t.tolist()[:4]} "
            f"({os.path.join(ck.path, ck.files[full])})"
        )
    return t[0]


def has_mtp_block(ck: Checkpoint) -> bool:
    """Whether the checkpoint holds any `mtp.*` tensor (published checkpoints may declare
    `num_nextn_predict_layers` and ship without the block)."""
    return any(n.startswith("mtp.") for n in ck.names())


_PACKED = {torch.uint8, torch.int8}


def _reads_the_same(got_shape: tuple, got_dt: torch.dtype, shape: tuple, dt: torch.dtype) -> bool:
    """A tensor as the layout gives it, or as a published checkpoint stores the same values:
    packed e2m1 bytes as I8 or U8 (DeepSeek ships its MXFP4 experts as I8), a one-element scale
    of shape () or (1,) (llm-compressor writes compressed-tensors' global scales as (1,);
    ModelOpt and squeezed copies as ())."""
    same_dt = got_dt == dt or {got_dt, dt} == _PACKED
    one = got_shape in ((), (1,)) and shape in ((), (1,))
    return same_dt and (got_shape == shape or one)


def validate_layout(ck: Checkpoint, fmt: str) -> list[str]:
    """Check ck's tensors against the layout its config implies in `fmt`: the main model, and
    the `mtp.*` blocks of `num_nextn_predict_layers` when the checkpoint has any `mtp.*` tensor.
    Returns the `mtp.*` names the config does not describe (kept as they are). Raises
    CheckpointError naming the first offending tensor."""
    exp = expected_tensors(ck.config, fmt, ck.scheme)
    if not has_mtp_block(ck):
        exp = {n: v for n, v in exp.items() if not n.startswith("mtp.")}
    extra = [n for n in ck.names() if n not in exp]
    mtp = [n for n in extra if n.startswith(("mtp.", "model.mtp."))]
    unknown = sorted(set(extra) - set(mtp))
    if unknown:
        raise CheckpointError(
            f"unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all) for a {fmt} "
            f"{ck.scheme}-named DSv4 checkpoint with this config.json ({ck.path})"
        )
    for n, (shape, dt) in exp.items():
        if not ck.has(n):
            raise CheckpointError(
                f"missing tensor {n!r} (expected {list(shape)} {dt}) in {ck.path}"
            )
        got_shape, got_dt = ck.meta(n)
        if not _reads_the_same(tuple(got_shape), got_dt, tuple(shape), dt):
            raise CheckpointError(
                f"tensor {n!r}: {list(got_shape)} {got_dt}, expected {list(shape)} {dt} "
                f"({os.path.join(ck.path, ck.files[n])})"
            )
    return mtp


# ---------------------------------------------------------------------------------------------
# Writing


def foreign_entries(folder: str) -> list[str]:
    """Entries of `folder` that no cutedsl tool wrote there (not listed in its MARKER)."""
    entries = sorted(os.listdir(folder))
    listed: set[str] = set()
    try:
        with open(os.path.join(folder, MARKER)) as f:
            m = json.load(f)
        if isinstance(m, dict) and isinstance(m.get("files"), list):
            listed = {x for x in m["files"] if isinstance(x, str)}
    except (OSError, ValueError):
        pass
    out = []
    for e in entries:
        full = os.path.join(folder, e)
        ours = e == MARKER or (e in listed and os.path.isfile(full) and not os.path.islink(full))
        if not ours:
            out.append(e)
    return out


def check_output(
    out: str, force: bool = False, inputs: Sequence[str] = (), what: str = "OUT"
) -> str:
    """Refuse, before any work, an output folder the writer would not or must not replace;
    returns its absolute path. `what` names the argument in the messages."""
    out_abs = os.path.abspath(out)
    for src in inputs:
        if cli.is_within(out_abs, src):
            where = "is the input" if cli.is_within(src, out_abs) else "lies inside the input"
            raise UsageError(f"{what} {out} {where} {src}: refusing to write into an input")
        if cli.is_within(src, out_abs):
            raise UsageError(
                f"the input {src} lies inside {what} {out}: replacing {what} would delete it"
            )
    if os.path.islink(out_abs):
        raise UsageError(f"{what} {out} is a symbolic link; refusing to replace it")
    if os.path.lexists(out_abs):
        if not os.path.isdir(out_abs):
            raise UsageError(f"{what} {out} exists and is not a folder")
        if not force:
            raise FileExistsError(
                f"{what} {out} exists; pass --force to replace a checkpoint a cutedsl tool wrote"
            )
        foreign = foreign_entries(out_abs)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise UsageError(
                f"{what} {out} holds {foreign[0]!r}{more}, which no cutedsl tool wrote there "
                f"(--force replaces only what {MARKER} lists); move it or choose another {what}"
            )
    anc = os.path.dirname(out_abs)
    while not os.path.exists(anc):
        anc = os.path.dirname(anc)
    if not os.path.isdir(anc):
        raise UsageError(f"{what} {out}: {anc} is not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {out}: folder {anc} is not writable")
    return out_abs


def _dump_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def write_checkpoint(
    out: str,
    cfg: dict,
    tensors: Iterable[tuple[int, dict[str, torch.Tensor]]],
    scheme: str = "native",
    max_shard_bytes: int = 2 << 30,
    force: bool = False,
    extra_files: dict[str, dict] | None = None,
    copy_from: str | None = None,
    writer: str = "cutedsl.tools",
) -> None:
    """Write config.json + sharded safetensors + index atomically (temp folder beside OUT, rename).

    tensors yields (layer, {native name: tensor}); a new shard starts at each layer boundary
    once the current one holds more than max_shard_bytes, or when it would exceed 2x that
    (max_shard_bytes=0: one shard per distinct layer key). Names starting with `mtp.` are kept
    verbatim. copy_from: a source checkpoint whose other files (tokenizer, generation_config,
    ...; not safetensors, index, config.json or the marker) are copied over. force: replace an
    existing OUT that holds only what a cutedsl tool wrote (`check_output`).
    """
    from safetensors.torch import save_file

    out = check_output(out, force, inputs=[copy_from] if copy_from else ())
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    old: str | None = None
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        last_layer = None
        files: list[str] = []
        weight_map: dict[str, int] = {}
        total = 0

        def flush() -> None:
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
            flush()
        n = len(files)
        final_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for fn, final in zip(files, final_names):
            os.rename(os.path.join(tmp, fn), os.path.join(tmp, final))
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: final_names[i] for k, i in sorted(weight_map.items())},
        }
        _dump_json(os.path.join(tmp, "model.safetensors.index.json"), index)
        _dump_json(os.path.join(tmp, "config.json"), cfg)
        gen = {
            "bos_token_id": cfg.get("bos_token_id", 0),
            "eos_token_id": cfg.get("eos_token_id", 1),
            "do_sample": False,
        }
        _dump_json(os.path.join(tmp, "generation_config.json"), gen)
        if copy_from is not None:
            skip = {"config.json", "model.safetensors.index.json", MARKER}
            for fn in sorted(os.listdir(copy_from)):
                full = os.path.join(copy_from, fn)
                if fn in skip or fn.endswith(".safetensors") or not os.path.isfile(full):
                    continue
                shutil.copy2(full, os.path.join(tmp, fn))
        for fn, obj in (extra_files or {}).items():
            _dump_json(os.path.join(tmp, fn), obj)
        written = sorted(os.listdir(tmp))
        from cutedsl import __version__

        _dump_json(
            os.path.join(tmp, MARKER),
            {"written_by": writer, "version": __version__, "files": written},
        )
        fmode = cli.output_mode(directory=False)
        for fn in [*written, MARKER]:
            os.chmod(os.path.join(tmp, fn), fmode)
        os.chmod(tmp, cli.output_mode(directory=True))
        if os.path.lexists(out):
            check_output(out, force=force)  # again: OUT may have changed meanwhile
            old = os.path.join(parent, os.path.basename(tmp).replace(".tmp-", ".old-", 1))
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        if old is not None and os.path.exists(old) and not os.path.lexists(out):
            os.rename(old, out)  # put the previous OUT back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
