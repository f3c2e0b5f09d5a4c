"""Checkpoint faults found from the files alone, before the engine allocates GPU memory.

`check_checkpoint(folder, n_routed_experts, quantization_config)` reads config values and the
safetensors headers (8-byte length + JSON, no tensor data) of the shards vLLM 0.21.0 would load,
and raises `CheckpointFault` (a ValueError, one line naming the file and the tensor) for:
- an index file (model.safetensors.index.json) naming a shard that does not exist, or a tensor
  its shard does not hold (vLLM loads only the shards present and says nothing);
- a truncated shard: a header longer than the file, or a tensor whose data ends past the end of
  the file (first such tensor named), or a header whose offsets disagree with shape x dtype;
- a quantized linear without its scales, or with a scale of the wrong dtype or shape:
    NVFP4 (`.weight` U8 [N, K/2]): `.weight_scale` F8_E4M3 [N, K/16], `.weight_scale_2` and
      `.input_scale` F32 with one element (ModelOpt's layout; cutedsl/formats.py);
    compressed-tensors NVFP4 (`.weight_packed` U8 [N, K/2]): `.weight_scale` F8_E4M3 [N, K/16],
      `.weight_global_scale` and `.input_global_scale` F32 with one element;
    MXFP4 (`.weight` U8 or I8 [N, K/2] + `.scale`): `.scale` F8_E8M0 [N, K/32] (DeepSeek's
      experts, I8);
    FP8 block (`.weight` F8_E4M3 [N, K]): a `.scale` / `.weight_scale_inv` / `.weight_scale`,
      [ceil(N/128), ceil(K/128)] when 2-D;
  a U8 / I8 `.weight` with no scale at all is NVFP4 when the config says so (quant_method modelopt,
  or moe_quant_algo NVFP4 for routed experts), MXFP4 otherwise; scales without their weight
  are named too;
- a config whose n_routed_experts disagrees with the tensors: an expert index >= n_routed_experts,
  an expert of range(n_routed_experts) with no tensor in a MoE layer, or a router
  (`gate.weight`, `gate.bias` / `e_score_correction_bias`) whose first dimension differs;
- MTP speculative decoding asked of a checkpoint that lacks an MTP block's tensors.
Native (`layers.L.ffn.experts.E.w1`) and HF (`model.layers.L.mlp.experts.E.gate_proj`) names,
and MTP blocks (`mtp.N.`), are read alike. Standard library only.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct

INDEX = "model.safetensors.index.json"
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
_EXPERT = re.compile(r"^(.+)\.(ffn|mlp)\.experts\.(\d+)\.")
_NVFP4_SCALES = ("weight_scale", "weight_scale_2", "input_scale")
_CT_NVFP4_SCALES = ("weight_scale", "weight_global_scale", "input_global_scale")
_FP8_SCALES = ("scale", "weight_scale_inv", "weight_scale")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class CheckpointFault(ValueError):
    """A checkpoint the server refuses to load; the message is one line naming the file and
    the tensor."""


class _Tensor:
    __slots__ = ("file", "dtype", "shape")

    def __init__(self, file: str, dtype: str, shape: list[int]) -> None:
        self.file, self.dtype, self.shape = file, dtype, shape

    def __str__(self) -> str:
        return f"{self.dtype} {self.shape}"


def _header(path: str, expected: list[str]) -> dict:
    """The tensor entries of a safetensors file, after checking it is whole."""
    size = os.path.getsize(path)
    some = f" (it should hold {expected[0]!r}{' and more' if len(expected) > 1 else ''})"
    some = some if expected else ""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFault(f"{path}: truncated: {size} bytes, no safetensors header{some}")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointFault(f"{path}: not a safetensors file (header length {n}){some}")
        if 8 + n > size:
            raise CheckpointFault(
                f"{path}: truncated inside its header ({size} bytes, header of {n}){some}"
            )
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointFault(f"{path}: corrupt safetensors header ({e}){some}") from None
    if not isinstance(meta, dict):
        raise CheckpointFault(f"{path}: corrupt safetensors header (not a JSON object){some}")
    meta.pop("__metadata__", None)
    data = size - 8 - n
    cut = []
    for name, t in meta.items():
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            dtype, shape = str(t["dtype"]), [int(x) for x in t["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFault(f"{path}: corrupt header entry for tensor {name!r}") from None
        item = _ITEMSIZE.get(dtype)
        if item is not None and end - begin != math.prod(shape) * item:
            raise CheckpointFault(
                f"{path}: corrupt header: tensor {name!r} ({dtype} {shape}) spans "
                f"{end - begin} bytes, expected {math.prod(shape) * item}"
            )
        if end > data:
            cut.append((begin, name, dtype, shape, end))
    if cut:
        begin, name, dtype, shape, end = min(cut)
        raise CheckpointFault(
            f"{path}: truncated: tensor {name!r} ({dtype} {shape}) ends at byte {8 + n + end} "
            f"but the file has {size} bytes ({len(cut)} tensor(s) cut; re-download the shard)"
        )
    return meta


def read_tensors(folder: str) -> dict[str, _Tensor]:
    """Name -> (file, dtype, shape) of every tensor vLLM 0.21.0 would read from `folder`: the
    shards of the index file when there is one (vLLM's filter_duplicate_safetensors_files),
    else every *.safetensors."""
    idx = os.path.join(folder, INDEX)
    expected: dict[str, list[str]] = {}
    if os.path.isfile(idx):
        try:
            with open(idx) as f:
                wm = json.load(f)["weight_map"]
            items = [(str(k), str(v)) for k, v in wm.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFault(f"{idx}: no readable weight_map ({type(e).__name__})") from None
        for name, shard in items:
            expected.setdefault(shard, []).append(name)
        for shard, names in sorted(expected.items()):
            if not os.path.isfile(os.path.join(folder, shard)):
                more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                raise CheckpointFault(
                    f"{idx}: names shard {shard!r}, which does not exist in {folder} "
                    f"(for tensor {names[0]!r}{more})"
                )
        files = sorted(expected)
    else:
        files = sorted(
            os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))
        )
    tensors: dict[str, _Tensor] = {}
    for fn in files:
        path = os.path.join(folder, fn)
        names = expected.get(fn, [])
        meta = _header(path, names)
        for name in names:
            if name not in meta:
                raise CheckpointFault(f"{idx}: maps tensor {name!r} to {path}, which lacks it")
        keep = set(names) if expected else meta.keys()  # the index decides each name's shard
        for name in keep:
            t = meta[name]
            tensors[name] = _Tensor(path, t["dtype"], [int(x) for x in t["shape"]])
    return tensors


def _fault(t: _Tensor, name: str, what: str) -> CheckpointFault:
    return CheckpointFault(f"{t.file}: tensor {name!r} ({t}): {what}")


def _check_scale(ts: dict[str, _Tensor], name: str, dtypes: tuple[str, ...],
                 shape: list[int] | None, why: str) -> None:  # fmt: skip
    t = ts[name]
    if t.dtype not in dtypes:
        raise _fault(t, name, f"expected dtype {' or '.join(dtypes)} ({why})")
    if shape is not None and t.shape != shape:
        raise _fault(t, name, f"expected shape {shape} ({why})")
    if shape is None and math.prod(t.shape) != 1:
        raise _fault(t, name, f"expected one element ({why})")


def check_scales(ts: dict[str, _Tensor], quant: dict | None) -> None:
    """The scales of every quantized `.weight` (module docstring)."""
    quant = quant or {}
    all_nvfp4 = quant.get("quant_method") == "modelopt" and "NVFP4" in str(quant.get("quant_algo"))
    experts_nvfp4 = str(quant.get("moe_quant_algo", "")).upper() == "NVFP4"
    for name in sorted(ts):
        prefix, _, leaf = name.rpartition(".")
        # `.scale` is also an mHC parameter's name in HF naming (`attn_hc.scale`, F32): only
        # an E8M0 `.scale` is a block scale.
        is_scale = leaf in (*_NVFP4_SCALES, *_CT_NVFP4_SCALES, "weight_scale_inv") or (
            leaf == "scale" and ts[name].dtype == "F8_E8M0"
        )
        if is_scale and f"{prefix}.weight" not in ts and f"{prefix}.weight_packed" not in ts:
            raise _fault(ts[name], name, f"a scale without its weight {prefix + '.weight'!r}")
        if leaf == "weight_packed":
            w = ts[name]
            if w.dtype != "U8" or len(w.shape) != 2:
                raise _fault(w, name, "expected dtype U8 and 2 dims (compressed-tensors NVFP4)")
            n, kp = w.shape
            for s in _CT_NVFP4_SCALES:
                if f"{prefix}.{s}" not in ts:
                    raise _fault(w, name, f"its NVFP4 scale {prefix}.{s} is missing")
            _check_scale(ts, f"{prefix}.weight_scale", ("F8_E4M3",), [n, kp // 8],
                         f"NVFP4 block scales of {name} [N, K/16], K = {2 * kp}")  # fmt: skip
            for s in _CT_NVFP4_SCALES[1:]:
                _check_scale(ts, f"{prefix}.{s}", ("F32",), None, "NVFP4 global scale")
            continue
        if leaf != "weight":
            continue
        w = ts[name]
        if w.dtype in ("U8", "I8") and len(w.shape) == 2:  # packed e2m1 (DeepSeek's MXFP4: I8)
            n, kp = w.shape
            nvfp4 = any(f"{prefix}.{s}" in ts for s in _NVFP4_SCALES)
            if f"{prefix}.scale" not in ts and not nvfp4:
                nvfp4 = all_nvfp4 or (experts_nvfp4 and _EXPERT.match(name) is not None)
            if nvfp4:
                for s in _NVFP4_SCALES:
                    if f"{prefix}.{s}" not in ts:
                        raise _fault(w, name, f"its NVFP4 scale {prefix}.{s} is missing")
                _check_scale(ts, f"{prefix}.weight_scale", ("F8_E4M3",), [n, kp // 8],
                             f"NVFP4 block scales of {name} [N, K/16], K = {2 * kp}")  # fmt: skip
                _check_scale(ts, f"{prefix}.weight_scale_2", ("F32",), None, "NVFP4 global scale")
                _check_scale(ts, f"{prefix}.input_scale", ("F32",), None, "NVFP4 input scale")
            else:
                if f"{prefix}.scale" not in ts:
                    raise _fault(w, name, f"its MXFP4 scale {prefix}.scale is missing")
                _check_scale(ts, f"{prefix}.scale", ("F8_E8M0", "U8"), [n, kp // 16],
                             f"MXFP4 block scales of {name} [N, K/32], K = {2 * kp}")  # fmt: skip
        elif w.dtype == "F8_E4M3" and len(w.shape) == 2:
            scale = next((f"{prefix}.{s}" for s in _FP8_SCALES if f"{prefix}.{s}" in ts), None)
            if scale is None:
                raise _fault(w, name, f"its FP8 scale {prefix}.scale is missing")
            if len(ts[scale].shape) == 2:
                n, k = w.shape
                _check_scale(ts, scale, ("F8_E8M0", "F32", "BF16"),
                             [-(-n // 128), -(-k // 128)], f"FP8 128x128 block scales of {name}")  # fmt: skip


def check_experts(ts: dict[str, _Tensor], n_experts: int, config_path: str) -> None:
    """Expert indices, per MoE layer, against range(n_experts); router shapes."""
    where = f"{config_path}: n_routed_experts = {n_experts}, but"
    layers: dict[str, dict[int, str]] = {}
    for name in sorted(ts):
        m = _EXPERT.match(name)
        if m:
            e = int(m.group(3))
            if e >= n_experts:
                raise CheckpointFault(f"{where} {ts[name].file} holds tensor {name!r} (expert {e})")
            layers.setdefault(m.group(1), {}).setdefault(e, name)
    for layer, seen in sorted(layers.items()):
        missing = sorted(set(range(n_experts)) - set(seen))
        if missing:
            example = next(iter(seen.values())).replace(
                f".experts.{next(iter(seen))}.", f".experts.{missing[0]}."
            )
            raise CheckpointFault(
                f"{where} {layer} has tensors of {len(seen)} experts only: no tensor of expert "
                f"{missing[0]} (e.g. {example!r}; {len(missing)} experts missing)"
            )
    for name in sorted(ts):
        if re.search(
            r"\.(ffn|mlp)\.(gate\.weight|gate\.bias|gate\.e_score_correction_bias)$", name
        ):
            t = ts[name]
            if t.shape and t.shape[0] != n_experts:
                raise CheckpointFault(
                    f"{where} {t.file} holds router tensor {name!r} of shape {t.shape} "
                    f"({t.shape[0]} experts)"
                )


def _hf_quant_config(path: str) -> dict | None:
    """ModelOpt's manifest as the two keys `check_scales` reads (None when absent)."""
    try:
        with open(path) as f:
            q = json.load(f).get("quantization") or {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointFault(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    algo = str(q.get("quant_algo", ""))
    layers = q.get("quantized_layers") or {}
    experts = any("NVFP4" in str(v) for v in layers.values()) if isinstance(layers, dict) else False
    return {"quant_method": "modelopt", "quant_algo": algo,
            "moe_quant_algo": "NVFP4" if experts else None}  # fmt: skip


def check_mtp(ts: dict[str, _Tensor], folder: str, first_layer: int, n_blocks: int) -> None:
    """Speculative decoding with the MTP head builds `n_blocks` MTP blocks from the checkpoint:
    block j from `mtp.{j}.*` (DeepSeek's names) or `model.layers.{first_layer + j}.*`. A block
    with no tensor at all would run on uninitialized memory (vLLM 0.21.0 does not track missing
    weights of quantized models): RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 declares one MTP layer and
    ships none of its tensors."""
    for j in range(n_blocks):
        prefixes = (f"mtp.{j}.", f"model.layers.{first_layer + j}.")
        if not any(name.startswith(prefixes) for name in ts):
            raise CheckpointFault(
                f"{folder}: --speculative-config method mtp needs MTP block {j}, and this "
                f"checkpoint has no tensor 'mtp.{j}.*' (its config.json declares "
                f"num_nextn_predict_layers = {n_blocks}); serve it without speculative decoding, "
                "or use a checkpoint that ships its MTP block"
            )


def check_checkpoint(
    folder: str,
    n_routed_experts: int | None,
    quant: dict | None,
    mtp: tuple[int, int] | None = None,
) -> int:
    """Every check of the module docstring on the checkpoint in `folder`; with `mtp`
    (num_hidden_layers, num_nextn_predict_layers: MTP speculative decoding was asked for), also
    `check_mtp`. Returns the number of tensors checked. Raises CheckpointFault (one line, naming
    the file and the tensor)."""
    if not quant:  # vLLM 0.21.0 reads ModelOpt's hf_quant_config.json when config.json has none
        quant = _hf_quant_config(os.path.join(folder, "hf_quant_config.json"))
    ts = read_tensors(folder)
    if not ts:
        raise CheckpointFault(f"{folder}: no safetensors tensors (no *.safetensors file)")
    check_scales(ts, quant)
    if n_routed_experts is not None:
        check_experts(ts, int(n_routed_experts), os.path.join(folder, "config.json"))
    if mtp is not None:
        check_mtp(ts, folder, *mtp)
    return len(ts)
