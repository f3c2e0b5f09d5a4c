"""Checkpoint faults at load, on tiny checkpoints (cutedsl.tools.tiny_model) corrupted on disk:
a truncated shard, a missing scale, a scale of the wrong dtype or shape, a config whose expert count
disagrees with the tensors, an index naming a missing shard. Each must be one line naming the file
and the tensor (`cutedsl.vllm.preflight`), and every published layout must pass untouched.

The last test builds the overlaid `DeepseekV4ForCausalLM` on the real pinned vLLM 0.21.0 on CPU
(a subprocess with tests/test_vllm_integration.py's harness shims) and checks that each fault
raises at construction before any tensor is created (a TorchDispatchMode counts every op, the
factory calls that allocate parameters and buffers included), while the clean checkpoint builds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cutedsl.vllm.preflight import CheckpointFault, check_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 1024, "n_routed_experts": 8, "num_experts_per_tok": 4}
LAYERS = 3  # 0 = SWA + hash MoE, 1 = C4 + indexer + hash MoE, 2 = C128 + scored MoE
CLEAN = {  # name -> (format, names, config overrides)
    "nvfp4": ("nvfp4", "native", {}),
    "nvfp4-hf": ("nvfp4", "hf", {}),
    "nvfp4-mtp": ("nvfp4", "native", {"num_nextn_predict_layers": 1}),
    "nvidia-mixed": ("nvidia-mixed", "native", {}),
    "native": ("native", "native", {}),
    "native-fp8": ("native-fp8", "native", {}),
    "bf16": ("bf16", "native", {}),
    "ct-nvfp4-fp8": ("ct-nvfp4-fp8", "native", {}),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """One tiny checkpoint per layout, in 2+ shards (fresh random weights per seed)."""
    from cutedsl.tools import tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    seed = int.from_bytes(os.urandom(2), "little")
    for name, (fmt, names, extra) in CLEAN.items():
        tiny_model.generate(str(root / name), fmt, names, seed=seed, overrides={**TINY, **extra},
                            layers=LAYERS, tokenizer=False, max_shard_bytes=8 << 20)  # fmt: skip
    return root


def _copy(pristine: Path, name: str, dst: Path) -> Path:
    shutil.copytree(pristine / name, dst)
    return dst


def _index(ck: Path) -> dict:
    return json.loads((ck / "model.safetensors.index.json").read_text())


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return n, meta


_spec = importlib.util.spec_from_file_location(
    "checkpoint_faults", REPO / "bench" / "checkpoint_faults.py"
)
cf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cf)
_rewrite = cf.rewrite


def _check(ck: Path) -> int:
    cfg = json.loads((ck / "config.json").read_text())
    return check_checkpoint(str(ck), cfg.get("n_routed_experts"), cfg.get("quantization_config"))


def _fault(ck: Path) -> str:
    with pytest.raises(CheckpointFault) as e:
        _check(ck)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("name", list(CLEAN))
def test_published_layouts_pass(pristine: Path, name: str) -> None:
    n = _check(pristine / name)
    assert n == len(_index(pristine / name)["weight_map"])


def test_truncated_shard_names_file_and_first_cut_tensor(pristine: Path, tmp_path: Path) -> None:
    ck = _copy(pristine, "nvfp4", tmp_path / "ck")
    shard = ck / sorted(set(_index(ck)["weight_map"].values()))[-1]
    n, meta = _header(shard)
    size = shard.stat().st_size - 1000  # a download that stopped 1000 bytes short
    with open(shard, "r+b") as f:
        f.truncate(size)
    cut = [
        (t["data_offsets"][0], k) for k, t in meta.items() if 8 + n + t["data_offsets"][1] > size
    ]
    first = min(cut)[1]
    msg = _fault(ck)
    assert msg.startswith(f"{shard}: truncated: tensor {first!r}"), msg
    assert f"the file has {size} bytes" in msg and f"{len(cut)} tensor(s) cut" in msg


def test_shard_truncated_inside_its_header(pristine: Path, tmp_path: Path) -> None:
    ck = _copy(pristine, "nvfp4", tmp_path / "ck")
    idx = _index(ck)
    shard_name = sorted(set(idx["weight_map"].values()))[0]
    with open(ck / shard_name, "r+b") as f:
        f.truncate(100)
    first = next(k for k, v in idx["weight_map"].items() if v == shard_name)
    msg = _fault(ck)
    assert msg.startswith(f"{ck / shard_name}: truncated inside its header"), msg
    assert repr(first) in msg


@pytest.mark.parametrize(
    "ckpt,tensor",
    [
        ("nvfp4", "layers.1.attn.wq_b.weight_scale"),
        ("nvfp4", "layers.2.ffn.experts.5.w2.input_scale"),
        ("nvfp4", "layers.0.ffn.shared_experts.w1.weight_scale_2"),
        ("nvfp4-hf", "model.layers.1.self_attn.q_b_proj.weight_scale"),
        ("nvidia-mixed", "layers.2.ffn.experts.7.w3.weight_scale_2"),
        ("native", "layers.0.ffn.experts.3.w1.scale"),
        ("native", "layers.1.attn.wq_b.scale"),
    ],
)
def test_missing_scale_is_named(pristine: Path, tmp_path: Path, ckpt: str, tensor: str) -> None:
    ck = _copy(pristine, ckpt, tmp_path / "ck")
    weight = tensor.rpartition(".")[0] + ".weight"
    shard = _rewrite(ck, tensor, lambda ts: ts.pop(tensor))
    msg = _fault(ck)
    assert msg.startswith(f"{shard}: tensor {weight!r}") or msg.startswith(
        f"{ck / _index(ck)['weight_map'][weight]}: tensor {weight!r}"
    ), msg
    assert f"{tensor} is missing" in msg, msg


@pytest.mark.parametrize(
    "tensor,how,want",
    [
        (
            "layers.2.ffn.experts.5.w2.weight_global_scale",
            "drop",
            "its NVFP4 scale layers.2.ffn.experts.5.w2.weight_global_scale is missing",
        ),
        (
            "layers.0.ffn.experts.1.w3.input_global_scale",
            "drop",
            "its NVFP4 scale layers.0.ffn.experts.1.w3.input_global_scale is missing",
        ),
        ("layers.1.ffn.experts.2.w1.weight_scale", "f32", "expected dtype F8_E4M3"),
        ("layers.1.ffn.experts.2.w1.weight_scale", "short", "expected shape [256, 64]"),
        ("layers.0.ffn.experts.0.w2.weight_global_scale", "vector", "expected one element"),
        (
            "layers.1.attn.wq_b.weight_scale",
            "drop",
            "its FP8 scale layers.1.attn.wq_b.scale is missing",
        ),
        ("layers.1.attn.wq_b.weight_scale", "short", "expected shape [64, 2]"),
    ],  # fmt: skip
)
def test_compressed_tensors_faults_are_named(
    pristine: Path, tmp_path: Path, tensor: str, how: str, want: str
) -> None:
    """Red Hat's layout: NVFP4 experts as `.weight_packed` + `.weight_scale` +
    `.weight_global_scale` + `.input_global_scale`, FP8 block attention with BF16 scales."""
    import torch

    def change(ts):
        t = ts.pop(tensor)
        if how != "drop":
            ts[tensor] = {
                "f32": lambda: t.float(),
                "short": lambda: t[:, :-1].contiguous(),
                "vector": lambda: torch.cat([t.reshape(1), t.reshape(1)]),
            }[how]()

    ck = _copy(pristine, "ct-nvfp4-fp8", tmp_path / "ck")
    _rewrite(ck, tensor, change)
    msg = _fault(ck)
    assert want in msg and msg.count("\n") == 0, msg
    head = tensor.rpartition(".")[0]
    assert (
        f"tensor {tensor!r}" in msg
        or f"tensor {head + '.weight_packed'!r}" in msg
        or (f"tensor {head + '.weight'!r}" in msg)
    ), msg


def test_experts_of_a_mixed_checkpoint_stay_nvfp4(pristine: Path, tmp_path: Path) -> None:
    """An NVIDIA-mixed expert that lost every scale is reported as NVFP4 (moe_quant_algo), not
    as an MXFP4 expert without its `.scale`."""
    ck = _copy(pristine, "nvidia-mixed", tmp_path / "ck")
    p = "layers.1.ffn.experts.2.w1."
    _rewrite(ck, p + "weight", lambda ts: [ts.pop(p + s) for s in
                                           ("weight_scale", "weight_scale_2", "input_scale")])  # fmt: skip
    assert f"its NVFP4 scale {p}weight_scale is missing" in _fault(ck)


@pytest.mark.parametrize(
    "ckpt,tensor,how,want",
    [
        ("nvfp4", "layers.1.attn.wq_b.weight_scale", "f32", "expected dtype F8_E4M3"),
        ("nvfp4", "layers.2.ffn.experts.4.w1.weight_scale", "short", "expected shape [256, 64]"),
        ("nvfp4", "layers.1.attn.wo_b.weight_scale", "transposed", "expected shape"),
        ("nvfp4", "layers.0.attn.wq_a.weight_scale_2", "f16", "expected dtype F32"),
        ("nvfp4", "layers.0.ffn.experts.0.w2.input_scale", "vector", "expected one element"),
        (
            "nvfp4-hf",
            "model.layers.2.mlp.experts.1.down_proj.weight_scale",
            "f32",
            "expected dtype F8_E4M3",
        ),
        ("native", "layers.0.ffn.experts.3.w1.scale", "short", "expected shape [256, 32]"),
        ("native", "layers.1.attn.wq_b.scale", "short", "expected shape [64, 2]"),
    ],  # fmt: skip
)
def test_scale_of_wrong_dtype_or_shape_is_named(
    pristine: Path, tmp_path: Path, ckpt: str, tensor: str, how: str, want: str
) -> None:
    import torch

    def change(ts):
        t = ts[tensor]
        ts[tensor] = {
            "f32": lambda: t.float(),
            "f16": lambda: t.half(),
            "short": lambda: t[:, :-1].contiguous(),
            "transposed": lambda: t.t().contiguous(),
            "vector": lambda: torch.cat([t.reshape(1), t.reshape(1)]),
        }[how]()

    shard = _rewrite(ck := _copy(pristine, ckpt, tmp_path / "ck"), tensor, change)
    msg = _fault(ck)
    assert msg.startswith(f"{shard}: tensor {tensor!r}"), msg
    assert want in msg, msg


@pytest.mark.parametrize("ckpt", ["nvfp4", "nvfp4-hf", "native"])
@pytest.mark.parametrize("experts", [16, 4])
def test_config_expert_count_disagreeing_with_tensors(
    pristine: Path, tmp_path: Path, ckpt: str, experts: int
) -> None:
    ck = _copy(pristine, ckpt, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["n_routed_experts"] = experts
    (ck / "config.json").write_text(json.dumps(cfg))
    msg = _fault(ck)
    assert msg.startswith(f"{ck / 'config.json'}: n_routed_experts = {experts}, but"), msg
    if experts > 8:
        layer = "model.layers.0" if ckpt.endswith("hf") else "layers.0"
        assert f"{layer} has tensors of 8 experts only: no tensor of expert 8" in msg, msg
        assert re.search(r"\.experts\.8\.", msg), msg
    else:
        name = re.search(r"holds tensor '([^']+)' \(expert (\d+)\)", msg)
        assert name and int(name.group(2)) >= experts, msg
        assert str(ck / _index(ck)["weight_map"][name.group(1)]) in msg


def test_router_shape_disagreeing_with_config(pristine: Path, tmp_path: Path) -> None:
    ck = _copy(pristine, "nvfp4", tmp_path / "ck")
    shard = _rewrite(ck, "layers.2.ffn.gate.weight",
                     lambda ts: ts.update({"layers.2.ffn.gate.weight": ts["layers.2.ffn.gate.weight"][:6]}))  # fmt: skip
    msg = _fault(ck)
    assert msg == (
        f"{ck / 'config.json'}: n_routed_experts = 8, but {shard} holds router tensor "
        "'layers.2.ffn.gate.weight' of shape [6, 1024] (6 experts)"
    )


def test_index_naming_a_missing_shard(pristine: Path, tmp_path: Path) -> None:
    ck = _copy(pristine, "nvfp4", tmp_path / "ck")
    idx = _index(ck)
    gone = sorted(set(idx["weight_map"].values()))[-1]
    (ck / gone).unlink()
    first = next(k for k, v in idx["weight_map"].items() if v == gone)
    msg = _fault(ck)
    assert msg.startswith(f"{ck / 'model.safetensors.index.json'}: names shard {gone!r}"), msg
    assert repr(first) in msg


def test_index_mapping_a_tensor_its_shard_lacks(pristine: Path, tmp_path: Path) -> None:
    ck = _copy(pristine, "nvfp4", tmp_path / "ck")
    from safetensors.torch import load_file, save_file

    t = "layers.1.attn.wq_b.weight_scale"
    shard = ck / _index(ck)["weight_map"][t]
    ts = load_file(shard)
    del ts[t]
    save_file(ts, shard, metadata={"format": "pt"})  # the index still names it
    assert _fault(ck) == (
        f"{ck / 'model.safetensors.index.json'}: maps tensor {t!r} to {shard}, which lacks it"
    )


def _drop_mtp_block(ck: Path) -> None:
    """Red Hat's artifact: num_nextn_predict_layers 1 in config.json, no mtp.* tensor."""
    from safetensors.torch import load_file, save_file

    idx = _index(ck)
    for shard in sorted(set(idx["weight_map"].values())):
        ts = load_file(ck / shard)
        save_file({k: v for k, v in ts.items() if not k.startswith("mtp.")}, ck / shard,
                  metadata={"format": "pt"})  # fmt: skip
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith("mtp.")}
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_mtp_speculation_without_the_mtp_block_is_named(pristine: Path, tmp_path: Path) -> None:
    """MTP speculative decoding of a checkpoint that declares an MTP layer but ships none of its
    tensors: named before load, through the engine's construction hook; without speculation,
    or with the block present, the same checks pass."""
    from types import SimpleNamespace

    from cutedsl.vllm.checks import checked_construction

    def vllm_config(ck: Path, method: str | None):
        cfg = json.loads((ck / "config.json").read_text())
        hf = SimpleNamespace(**{k: cfg.get(k) for k in ("n_routed_experts", "quantization_config",
                                                         "num_hidden_layers", "num_nextn_predict_layers")})  # fmt: skip
        sc = None if method is None else SimpleNamespace(method=method, model=str(ck))
        return SimpleNamespace(
            model_config=SimpleNamespace(model=str(ck), hf_config=hf),
            load_config=SimpleNamespace(load_format="auto"),
            speculative_config=sc,
        )

    full = pristine / "nvfp4-mtp"
    checked_construction(vllm_config(full, "mtp"))  # the block is there
    ck = _copy(pristine, "nvfp4-mtp", tmp_path / "ck")
    _drop_mtp_block(ck)
    checked_construction(vllm_config(ck, None))  # no speculation: nothing needs the block
    checked_construction(vllm_config(ck, "ngram"))
    with pytest.raises(CheckpointFault) as e:
        checked_construction(vllm_config(ck, "mtp"))
    msg = str(e.value)
    assert msg == (
        f"{ck}: --speculative-config method mtp needs MTP block 0, and this checkpoint has no "
        "tensor 'mtp.0.*' (its config.json declares num_nextn_predict_layers = 1); serve it "
        "without speculative decoding, or use a checkpoint that ships its MTP block"
    ), msg
    with pytest.raises(CheckpointFault, match="MTP block 0"):
        check_checkpoint(str(ck), 8, None, mtp=(LAYERS, 1))


def test_error_while_reading_is_not_blamed_on_the_previous_tensor() -> None:
    """checked_load's note names the tensor being loaded; an error raised while the iterator
    reads the next one (e.g. a shard that cannot be opened) must not name the previous one."""
    pytest.importorskip("vllm")
    import torch

    from cutedsl.vllm.checks import checked_load

    class Loader:
        def load_weights(self, weights, mapper):
            for name, _ in weights:
                if name == "bad":
                    raise ValueError("shape mismatch")
            return set()

    def first_then_fail():
        yield "a.weight", torch.zeros(2)
        raise OSError("shard-2.safetensors: cannot read")

    with pytest.raises(OSError) as e:
        checked_load(torch.nn.Module(), Loader(), first_then_fail(), None)
    assert not getattr(e.value, "__notes__", None), e.value.__notes__
    with pytest.raises(ValueError) as e:
        checked_load(torch.nn.Module(), Loader(), iter([("bad", torch.zeros(3))]), None)
    assert e.value.__notes__ == ["while loading checkpoint tensor 'bad' (shape [3], dtype float32)"]


# ---------------------------------------------------------------------------------------------
# Through vLLM: raised at construction, before any tensor exists (subprocess harness)

FAULTS = ("clean", *cf.FAULTS)


def _make_fault(pristine: Path, root: Path, fault: str) -> Path:
    if fault == "clean":
        return _copy(pristine, "nvfp4", root / fault)
    return cf.make_fault(pristine / "nvfp4", root / fault, fault)


def _harness(out: str, cases: list[str]) -> None:
    """In the subprocess: build DeepseekV4ForCausalLM from each checkpoint on vLLM's CPU
    platform, counting every torch op dispatched during construction."""
    os.environ.setdefault("CUTEDSL_BACKEND", "reference")
    spec = importlib.util.spec_from_file_location(
        "vllm_harness", REPO / "tests" / "test_vllm_integration.py"
    )
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    h._setup_cpu_vllm()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    report = {}
    for ck in cases:
        rep: dict = {}
        try:
            vc = h._vllm_config(ck)
            with set_current_vllm_config(vc):
                h._init_distributed(vc, os.path.dirname(ck))
                from vllm.model_executor.models.deepseek_v4 import DeepseekV4ForCausalLM

                Count.ops = 0
                with h._construction_shims("nvfp4"), set_default_torch_dtype(vc.model_config.dtype):
                    with torch.device("cpu"), Count():
                        try:
                            DeepseekV4ForCausalLM(vllm_config=vc, prefix="")
                            rep["raised"] = None
                        except Exception as e:
                            rep.update(raised=type(e).__name__, message=str(e))
                rep["ops_during_construction"] = Count.ops
        except Exception as e:
            import traceback

            rep = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        report[os.path.basename(ck)] = rep
    Path(out).write_text(json.dumps(report, indent=1))


def test_vllm_raises_at_construction_before_any_allocation(pristine: Path, tmp_path: Path) -> None:
    cases = [str(_make_fault(pristine, tmp_path, f)) for f in FAULTS]
    expected = {}
    for ck in cases[1:]:
        with pytest.raises(CheckpointFault) as e:
            _check(Path(ck))
        expected[os.path.basename(ck)] = str(e.value)
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, __file__, "--harness", str(out), *cases],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    clean = rep["clean"]
    assert "error" not in clean, clean
    assert clean["raised"] is None and clean["ops_during_construction"] > 100, clean
    for fault in FAULTS[1:]:
        r = rep[fault]
        assert "error" not in r, (fault, r)
        assert r["raised"] == "CheckpointFault", (fault, r)
        assert r["message"] == expected[fault], (fault, r["message"])
        assert r["ops_during_construction"] == 0, (fault, r)


if __name__ == "__main__" and sys.argv[1:2] == ["--harness"]:
    _harness(sys.argv[2], sys.argv[3:])


def test_fault_runner_judges_exit_message_and_leftovers(pristine: Path, tmp_path: Path) -> None:
    """bench/checkpoint_faults.py with stand-in servers: one that fails as vLLM does (the
    pre-check's line, exit 1) passes; one that names another tensor, one that exits 0, one that
    leaves a child running and one that hangs past --timeout each fail."""
    fake = tmp_path / "server.py"
    fake.write_text(
        "import json, subprocess, sys, time\n"
        "from cutedsl.vllm.preflight import check_checkpoint\n"
        "ck, mode = sys.argv[1], sys.argv[2]\n"
        "cfg = json.load(open(ck + '/config.json'))\n"
        "try:\n"
        "    check_checkpoint(ck, cfg['n_routed_experts'], cfg.get('quantization_config'))\n"
        "except Exception as e:\n"
        "    msg = str(e) if mode != 'wrong' else str(e).replace('layers', 'xlayers')\n"
        "    print('ERROR cutedsl.vllm.preflight.CheckpointFault: ' + msg, flush=True)\n"
        "if mode == 'leave':\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "if mode == 'hang':\n"
        "    time.sleep(60)\n"
        "sys.exit(0 if mode == 'exit0' else 1)\n"
    )
    src = pristine / "nvfp4"
    results = {}
    for mode in ("vllm", "wrong", "exit0", "leave", "hang"):
        out = tmp_path / f"{mode}.json"
        rc = cf.main(["--src", str(src), "--work", str(tmp_path / mode), "--out", str(out),
                      "--faults", "missing_scale,experts", "--timeout", "8", "--",
                      sys.executable, str(fake), "{ckpt}", mode])  # fmt: skip
        results[mode] = (rc, json.loads(out.read_text()))
    rc, doc = results["vllm"]
    assert rc == 0 and doc["ok"], doc
    r = doc["faults"]["missing_scale"]
    assert (
        r["exit_code"] == 1
        and r["left_running"] == []
        and "weight_scale is missing" in r["message"]
    )
    assert doc["faults"]["experts"]["message"].endswith("experts missing)")
    for mode in ("wrong", "exit0", "leave", "hang"):
        rc, doc = results[mode]
        assert rc == 1 and not any(r["ok"] for r in doc["faults"].values()), (mode, doc)
    assert all(r["left_running"] for r in results["leave"][1]["faults"].values())
    assert all(r["timed_out"] for r in results["hang"][1]["faults"].values())
