"""The command-line tools on bad input: one line naming the argument, file or tensor, a non-zero
exit, no traceback (unless --debug), nothing written, and the inputs and unrelated files byte for
byte as they were. Also: --force replaces only a tool's own output, outputs follow the umask,
SIGTERM/SIGINT leave no temporary folder, --help documents every option, --version the pins."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cutedsl.tools import check_kernels, golden, prewarm_kernels, prewarm_mhc, quantize, tiny_model
from cutedsl.tools.checkpoint import MARKER

REPO = Path(__file__).resolve().parents[1]
MICRO = {"hidden_size": 512, "n_routed_experts": 8, "moe_intermediate_size": 128, "vocab_size": 256}
TOOLS: dict[str, Callable[[list[str] | None], int]] = {
    "tiny_model": tiny_model.main,
    "quantize": quantize.main,
    "golden": golden.main,
    "check_kernels": check_kernels.main,
    "prewarm_mhc": prewarm_mhc.main,
    "prewarm_kernels": prewarm_kernels.main,
}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A native micro checkpoint in several shards (read only: tests copy it to change it)."""
    p = tmp_path_factory.mktemp("cli") / "src"
    tiny_model.generate(str(p), "native", overrides=MICRO, max_shard_bytes=4 << 20, seed=1)
    assert len(list(p.glob("*.safetensors"))) > 2
    return p


def _tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file below root (folders as '<dir>')."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "<dir>"
        for f in filenames:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, root)] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return out


def _fails(
    capsys: pytest.CaptureFixture, tool: str, argv: list[str], match: str, code: int = 2
) -> str:
    """Run a tool's main(argv): exit `code`, and stderr exactly one error line matching `match`."""
    try:
        rc = TOOLS[tool](argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code, (rc, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert re.search(r": error: ", lines[0]), lines[0]
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


@pytest.fixture
def work(tmp_path: Path, src: Path) -> Path:
    """tmp_path holding a copy of the source checkpoint (`ckpt`) and an unrelated file."""
    shutil.copytree(src, tmp_path / "ckpt")
    (tmp_path / "notes.txt").write_text("unrelated\n")
    return tmp_path


# ------------------------------------------------------------------------------ outputs vs inputs


def test_quantize_refuses_src_as_dst(capsys, work: Path) -> None:
    before = _tree(work)
    ck = str(work / "ckpt")
    _fails(capsys, "quantize", [ck, ck, "--force"], r"DST .*ckpt is the input .*ckpt")
    _fails(capsys, "quantize", [ck, ck + "/", "--force"], r"is the input")
    _fails(capsys, "quantize", [ck, str(work / "ckpt" / "nvfp4")], r"lies inside the input")
    _fails(capsys, "quantize", [ck, str(work), "--force"], r"input .*ckpt lies inside DST")
    (work / "link").symlink_to(work / "ckpt")
    _fails(capsys, "quantize", [str(work / "link"), ck, "--force"], r"is the input")
    (work / "link").unlink()
    assert _tree(work) == before


def test_tiny_model_force_keeps_unrelated_files(capsys, work: Path) -> None:
    out = work / "out"
    out.mkdir()
    (out / "weights-i-care-about.bin").write_bytes(b"\x00\x01")
    before = _tree(work)
    _fails(capsys, "tiny_model", [str(out)], r"OUT .*out exists; pass --force")
    _fails(
        capsys,
        "tiny_model",
        [str(out), "--force"],
        r"holds 'weights-i-care-about.bin', which no cutedsl tool wrote",
    )
    assert _tree(work) == before
    # A file added to a tool's own output is unrelated too: the whole folder is kept.
    (work / "ckpt" / "README").write_text("mine")
    before = _tree(work)
    _fails(capsys, "tiny_model", [str(work / "ckpt"), "--force"], r"holds 'README'")
    assert _tree(work) == before


def test_force_replaces_the_tools_own_output(capsys, work: Path) -> None:
    out = work / "out"
    args = [str(out), "--config", json.dumps(MICRO), "--layers", "1", "--no-tokenizer"]
    assert tiny_model.main([*args, "--seed", "1"]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["written_by"] == "cutedsl.tools.tiny_model"
    assert sorted(marker["files"]) == sorted(f for f in os.listdir(out) if f != MARKER)
    first = _tree(out)
    assert tiny_model.main([*args, "--seed", "2", "--force"]) == 0
    second = _tree(out)
    assert set(first) == set(second) and first != second  # replaced, same files
    assert not [f for f in os.listdir(work) if ".tmp-" in f or ".old-" in f]
    assert (work / "notes.txt").read_text() == "unrelated\n"
    capsys.readouterr()


# ------------------------------------------------------------------------------ --config


@pytest.mark.parametrize(
    "config,match",
    [
        ('{"hidden_size": "big"}', r"--config: hidden_size must be an integer, got 'big' \(str\)"),
        ('{"hiden_size": 512}', r"unknown DeepSeek V4 config key 'hiden_size' \(did you mean "),
        ('{"num_hidden_layers": 0}', r"--config: num_hidden_layers must be >= 1, got 0"),
        ('{"compress_ratios": "4"}', r"compress_ratios must be a list\[int\]"),
        ('{"norm_topk_prob": 1}', r"norm_topk_prob must be a bool"),
        ('{"rms_norm_eps": NaN}', r"rms_norm_eps must be a finite number"),
        ('{"model_type": "llama"}', r"model_type 'llama' is not DeepSeek V4"),
        ("[1, 2]", r"is neither a JSON object nor an existing file"),
        ('{"hidden_size": 512,}', r"--config: not valid JSON"),
        ('{"o_lora_rank": 100}', r"o_lora_rank=100, expected a multiple of 128"),
    ],
)
def test_tiny_model_config_checked_against_the_schema(capsys, tmp_path, config, match) -> None:
    _fails(capsys, "tiny_model", [str(tmp_path / "out"), "--config", config], match)
    assert os.listdir(tmp_path) == []


def test_tiny_model_config_file(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    _fails(
        capsys,
        "tiny_model",
        [str(tmp_path / "out"), "--config", str(missing)],
        r"--config: '.*nope.json' is neither a JSON object nor an existing file",
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 512')
    _fails(
        capsys, "tiny_model", [str(tmp_path / "out"), "--config", str(bad)], r"bad.json: not valid"
    )
    typo = tmp_path / "typo.json"
    typo.write_text('{"n_routed_expert": 8}')
    _fails(
        capsys,
        "tiny_model",
        [str(tmp_path / "out"), "--config", str(typo)],
        r"typo.json: unknown DeepSeek V4 config key 'n_routed_expert' \(did you mean "
        r"'n_routed_experts'\?\)",
    )
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "typo.json"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--layers", "0"], r"--layers: must be >= 1, got 0"),
        (["--layers", "x"], r"argument --layers: invalid int value: 'x'"),
        (["--max-shard-gb", "0"], r"--max-shard-gb: must be a positive number"),
        (["--router-gain", "-1"], r"--router-gain: must be a positive number"),
        (["--expert-shared", "1"], r"--expert-shared: must be in \[0, 1\)"),
        (["--device", "tpu"], r"--device: 'tpu'"),
        (["--format", "fp4"], r"argument --format: invalid choice: 'fp4'"),
    ],
)
def test_tiny_model_bad_arguments(capsys, tmp_path, argv, match) -> None:
    _fails(capsys, "tiny_model", [str(tmp_path / "out"), *argv], match)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ bad checkpoints


def _quantize_fails(capsys, work: Path, match: str, *extra: str) -> None:
    before = _tree(work)
    _fails(capsys, "quantize", [str(work / "ckpt"), str(work / "dst"), *extra], match)
    assert _tree(work) == before  # inputs and unrelated files unchanged, no DST, no temp folder


@pytest.mark.parametrize(
    "device,match",
    [
        ("tpu", r"--device tpu: expected cpu or cuda\[:N\]"),
        ("mps", r"--device mps: expected cpu or cuda\[:N\]"),
        ("cuda:x", r"--device cuda:x: expected cpu or cuda\[:N\]"),
    ],
)
def test_quantize_bad_device_is_refused(capsys, work: Path, device: str, match: str) -> None:
    _quantize_fails(capsys, work, match, "--device", device)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal where no GPU is visible"
)
def test_quantize_on_a_machine_without_gpu_is_refused(capsys, work: Path) -> None:
    _quantize_fails(capsys, work, r"--device cuda: no CUDA GPU visible", "--device", "cuda")


def test_truncated_shard_is_named(capsys, work: Path) -> None:
    shard = sorted((work / "ckpt").glob("*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size // 2)
    _quantize_fails(capsys, work, rf"{shard.name}: not a readable safetensors file")
    _fails(capsys, "golden", [str(work / "ckpt"), "--random", "4"], re.escape(shard.name))


def test_corrupt_shard_header_is_named(capsys, work: Path) -> None:
    shard = sorted((work / "ckpt").glob("*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"#garbage"
    shard.write_bytes(bytes(data))
    _quantize_fails(capsys, work, rf"{shard.name}: not a readable safetensors file")


def test_missing_shard_and_bad_index_are_named(capsys, work: Path) -> None:
    idx = work / "ckpt" / "model.safetensors.index.json"
    shard = sorted((work / "ckpt").glob("*.safetensors"))[0]
    moved = work / "moved.safetensors"
    shard.rename(moved)
    _quantize_fails(capsys, work, rf"{shard.name}: shard listed in the index is missing")
    moved.rename(shard)
    idx.write_text("{")
    _quantize_fails(capsys, work, r"model.safetensors.index.json: not valid JSON")


def test_llama_config_is_refused(capsys, work: Path) -> None:
    cfg_path = work / "ckpt" / "config.json"
    cfg_path.write_text(
        json.dumps(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096}
        )
    )
    _quantize_fails(capsys, work, r"config.json: model_type 'llama' is not DeepSeek V4")
    _fails(capsys, "golden", [str(work / "ckpt"), "--random", "4"], r"model_type 'llama'")


def test_relabelled_dsv4_config_is_refused(capsys, work: Path) -> None:
    cfg_path = work / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama"
    cfg_path.write_text(json.dumps(cfg))
    _quantize_fails(capsys, work, r"config.json: model_type 'llama' is not DeepSeek V4")


def test_config_value_types_of_a_source(capsys, work: Path) -> None:
    cfg_path = work / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["num_hash_layers"]
    cfg_path.write_text(json.dumps(cfg))
    _quantize_fails(capsys, work, r"config.json: missing DeepSeek V4 config key 'num_hash_layers'")
    cfg["num_hash_layers"], cfg["hidden_size"] = 2, "512"
    cfg_path.write_text(json.dumps(cfg))
    _quantize_fails(capsys, work, r"config.json: hidden_size must be an integer, got '512'")
    cfg_path.write_text("not json")
    _quantize_fails(capsys, work, r"config.json: not valid JSON")
    cfg_path.unlink()
    _quantize_fails(capsys, work, r"config.json: no config.json")


@pytest.mark.parametrize("amax", ["-1", "0", "nan", "inf"])
def test_quantize_input_amax(capsys, work: Path, amax: str) -> None:
    _quantize_fails(capsys, work, r"--input-amax: must be a positive number", "--input-amax", amax)


def test_quantize_missing_src(capsys, tmp_path: Path) -> None:
    _fails(capsys, "quantize", [str(tmp_path / "nope"), str(tmp_path / "d")], r"SRC .* not exist")
    assert os.listdir(tmp_path) == []


def test_debug_shows_the_traceback(capsys, work: Path) -> None:
    ck = str(work / "ckpt")
    assert quantize.main([ck, ck, "--force", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith(
        "refusing to write into an input"
    )


# ------------------------------------------------------------------------------ golden


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Argument errors must come before the model is built."""

    def built(*a, **k):
        raise AssertionError("the model was built before the arguments were checked")

    monkeypatch.setattr(golden, "load_model", built)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--random", "0"], r"--random: must be >= 1, got 0"),
        (["--random", "-3"], r"--random: must be >= 1, got -3"),
        (["--tokens", "5,300"], r"--tokens: id 300 is outside the vocabulary \[0, 256\)"),
        (["--tokens", "-1"], r"--tokens: id -1 is outside the vocabulary"),
        (["--tokens", "1,two,3"], r"--tokens: 'two' is not an integer token id"),
        (["--tokens", ","], r"--tokens: no token ids given"),
        (["--random", "4", "--out", "missing/logits.pt"], r"--out .*: folder .*missing does not"),
        (["--random", "4", "--device", "cuda:x"], r"--device: 'cuda:x'"),
        (["--random", "4", "--dtype", "fp8"], r"argument --dtype: invalid choice"),
    ],
)
def test_golden_bad_arguments(capsys, work: Path, no_model, argv, match) -> None:
    before = _tree(work)
    argv = [a.replace("missing/", str(work / "missing") + "/") for a in argv]
    _fails(capsys, "golden", [str(work / "ckpt"), *argv], match)
    assert _tree(work) == before


def test_golden_out_never_clobbers(capsys, work: Path, no_model) -> None:
    ck = work / "ckpt"
    before = _tree(work)
    _fails(capsys, "golden", [str(ck), "--random", "4", "--out", str(ck / "l.pt")], r"inside the")
    _fails(
        capsys, "golden", [str(ck), "--random", "4", "--out", str(work / "notes.txt")], r"exists"
    )
    _fails(capsys, "golden", [str(ck), "--random", "4", "--out", str(work)], r"is a folder")
    _fails(capsys, "golden", [str(work / "nope"), "--random", "4"], r"nope: no such checkpoint")
    assert _tree(work) == before


# ------------------------------------------------------------------------------ the other tools


def test_check_kernels_and_prewarm_bad_arguments(capsys, tmp_path: Path) -> None:
    _fails(
        capsys, "check_kernels", ["--json", str(tmp_path / "no" / "r.json")], r"--json .* not exist"
    )
    _fails(capsys, "check_kernels", ["--arch", "sm_80"], r"argument --arch: invalid choice")
    _fails(capsys, "prewarm_mhc", [str(tmp_path / "nope")], r"MODEL_DIR .*nope does not exist")
    _fails(capsys, "prewarm_mhc", [str(tmp_path), "--workers", "0"], r"--workers: must be >= 1")
    _fails(capsys, "prewarm_mhc", [str(tmp_path), "--timeout", "0"], r"--timeout: must be a pos")
    _fails(capsys, "prewarm_mhc", [str(tmp_path)], r"config.json not found")
    _fails(capsys, "prewarm_kernels", [str(tmp_path / "nope")], r"MODEL_DIR .*nope is not a folder")
    _fails(capsys, "prewarm_kernels", [str(tmp_path)], r"config.json not found")
    _fails(capsys, "prewarm_kernels", [str(tmp_path), "--max-num-batched-tokens", "0"],
           r"--max-num-batched-tokens 0: must be >= 1")  # fmt: skip
    assert os.listdir(tmp_path) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    _fails(capsys, "prewarm_kernels", [str(other)], r"other/config.json: not a DeepSeek V4 config")


def test_check_kernels_empty_selection(capsys) -> None:
    _fails(capsys, "check_kernels", ["--only", "no-such-kernel"], r"--only no-such-kernel: no ke")


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_has_help_and_version_prints_the_pins(capsys, monkeypatch, tool) -> None:
    seen: list[argparse.ArgumentParser] = []

    def grab(self, args=None, namespace=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(SystemExit):
        TOOLS[tool]([])
    (ap,) = seen
    for action in ap._actions:
        if action.help == argparse.SUPPRESS:
            continue
        assert action.help and action.help.strip(), (tool, action.option_strings or action.dest)
    names = {s for a in ap._actions for s in a.option_strings}
    assert {"--debug", "--version", "--help"} <= names
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        TOOLS[tool](["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    pins = (REPO / "requirements.txt").read_text()
    for name in ("torch", "vllm", "nvidia-cutlass-dsl", "transformers"):
        want = re.search(rf"^{name}==(\S+)", pins, re.M).group(1)
        assert f"{name}=={want}" in out, out
    assert out.startswith("cutedsl 0.1.0 (pinned: ")


# ------------------------------------------------------------------------------ modes, signals


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_outputs_follow_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        tiny_model.generate(str(tmp_path / "out"), "bf16", overrides=MICRO, layers=1)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    files = list(out.iterdir())
    assert len(files) >= 5
    for f in files:
        assert (f.stat().st_mode & 0o777) == 0o666 & ~mask, f


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_temporary_folder(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    (tmp_path / "notes.txt").write_text("unrelated\n")
    before = _tree(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cutedsl.tools.tiny_model", str(out), "--format", "nvfp4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    deadline = time.monotonic() + 120
    while not any(".tmp-" in f for f in os.listdir(tmp_path)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary folder appeared"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert (
        err.strip().splitlines()[-1].endswith(f"interrupted by {sig.name}; temporary files removed")
    ), err
    assert "Traceback" not in err
    assert _tree(tmp_path) == before  # no OUT, no temporary folder, the rest untouched


def test_prewarm_kernels_without_a_gpu_has_nothing_to_do(src: Path, tmp_path: Path, capsys) -> None:
    """No CUDA device (this machine): one line, exit 0, nothing compiled (serve.sh goes on)."""
    out = tmp_path / "p.json"
    assert prewarm_kernels.main([str(src), "--json", str(out)]) == 0
    assert "nothing to do: no CUDA GPU visible" in capsys.readouterr().out
    assert json.loads(out.read_text())["result"] == "nothing to do: no CUDA GPU visible"
