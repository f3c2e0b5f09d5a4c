"""cutedsl.tools.prewarm_mhc on the CPU: which token counts it compiles, its config errors, and
that serve.sh runs it. (The compiles themselves need a GPU: scripts/gpu/serve_soak.sh runs them.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cutedsl.tools import prewarm_mhc as pw
from cutedsl.tools.cli import UsageError

REPO = Path(__file__).resolve().parents[1]


def vllm_formula(n_sms: int, hc_hidden: int):
    """vLLM 0.21.0's compute_num_split(64, hc_hidden, grid), restated without a GPU."""

    def split(grid: int) -> int:
        s = n_sms // grid
        s = min(s, (hc_hidden // 64) // 4)
        return max(s, 1)

    return split


@pytest.mark.parametrize("n_sms,hidden", [(132, 4096), (148, 7168), (132, 2048), (16, 512)])
def test_every_split_count_gets_one_token_count(n_sms: int, hidden: int) -> None:
    split = vllm_formula(n_sms, 4 * hidden)
    counts = pw.token_counts(split)
    assert counts == sorted(set(counts))
    assert set(pw.SMALL_BATCH) <= set(counts)
    # every split count any token count up to 64K tokens can produce is covered
    reachable = {split(-(-t // pw.BLOCK_M)) for t in range(17, 65536, 7)}
    covered = {split(-(-t // pw.BLOCK_M)) for t in counts if t > 16}
    assert reachable == covered
    assert len([t for t in counts if t > 16]) == len(covered)  # one count per split count
    assert split(-(-max(counts) // pw.BLOCK_M)) == 1


def test_token_counts_refuses_a_split_that_never_ends() -> None:
    with pytest.raises(RuntimeError, match="never reached 1"):
        pw.token_counts(lambda grid: 2, limit=4096)


def test_split_work_covers_each_count_once() -> None:
    counts = [1, 8, 64, 128, 192, 256, 4288]
    for workers in (1, 3, 7, 20):
        parts = pw.split_work(counts, workers)
        assert len(parts) == min(workers, len(counts))
        assert sorted(t for p in parts for t in p) == counts
        assert parts[0][0] == max(counts)


def test_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        pw.mhc_config(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="config.json not found"):
        pw.mhc_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="is not JSON"):
        pw.mhc_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UsageError, match="not a DeepSeek V4 config"):
        pw.mhc_config(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "hidden_size": "big"})
    )
    with pytest.raises(UsageError, match="hidden_size must be an integer >= 1, got 'big'"):
        pw.mhc_config(tmp_path)


def test_absent_keys_take_the_hf_config_defaults(tmp_path: Path) -> None:
    """vLLM reads DSv4's config through transformers' DeepseekV4Config, whose defaults fill the
    keys a config.json leaves out; the prewarm must compile for the same values."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "hidden_size": 64, "hc_eps": 1e-5})
    )
    got = pw.mhc_config(tmp_path)
    assert got == {"hidden_size": 64, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-5,
                   "rms_norm_eps": 1e-6}  # fmt: skip
    from transformers import DeepseekV4Config  # the pinned transformers 5.17.0 has it

    hf = DeepseekV4Config(hidden_size=64, hc_eps=1e-5)
    assert got == {k: getattr(hf, k) for k in pw.CONFIG_KEYS}


def test_bad_worker_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        pw.main([str(tmp_path), "--workers", "0"])


def test_reads_the_tiny_model_config(tmp_path: Path) -> None:
    from cutedsl.tools.tiny_model import make_config

    cfg = make_config("tiny", "nvfp4")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = pw.mhc_config(tmp_path)
    assert got == {k: cfg[k] for k in pw.CONFIG_KEYS}


def test_serve_script_prewarms_before_vllm_serve() -> None:
    text = (REPO / "scripts" / "serve.sh").read_text()
    assert text.index("cutedsl.tools.prewarm_mhc") < text.index("vllm.entrypoints.cli.main serve")
    assert "PREWARM_MHC:-1" in text


# --------------------------------------------------------------------------- the fast path


TVM_FFI_FILES = ["device_kernel.cu", "executable.so", "host_kernel.cu", "params.pkl"]


def _tilelang_entry(root: Path, key: str) -> dict[str, list[str]]:
    (root / key).mkdir(parents=True)
    for f in TVM_FFI_FILES:
        (root / key / f).write_bytes(b"x")
    return {key: TVM_FFI_FILES}


def test_cache_keys_read_from_tilelangs_backend_caches() -> None:
    """The installed TileLang: a kernel in the tvm_ffi backend's cache (the one vLLM's mHC
    kernels use) is reported with that backend's entry files; a bare KernelCache() is a separate,
    empty instance and would report nothing."""
    from tilelang.cache import _dispatch_map

    cache = _dispatch_map["tvm_ffi"]
    key = "cutedsl-test-" + os.urandom(4).hex()
    cache._memory_cache[key] = object()
    try:
        root, entries = pw._tilelang_cache_keys()
    finally:
        del cache._memory_cache[key]
    assert entries[key] == TVM_FFI_FILES
    assert Path(cache._get_cache_path(key)) == Path(root) / key


def _tiny_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 64}))
    return model


def test_stamp_round_trip_and_every_way_it_goes_stale(tmp_path: Path) -> None:
    cache, root = tmp_path / "tl", tmp_path / "tl" / "0.1.9-x86_64" / "kernels"
    cfg = {"hidden_size": 64, "hc_mult": 4}
    fp = pw.fingerprint(cfg, ("NVIDIA H200", 132))
    assert pw.cached_everything(cache, fp) == (False, "no stamp of a previous prewarm")
    e = {k: v for k in ("k1", "k2", "k3") for k, v in _tilelang_entry(root, k).items()}
    assert pw.write_stamp(cache, fp, [(str(root), {"k1": e["k1"], "k2": e["k2"]}),
                                      (str(root), {"k2": e["k2"], "k3": e["k3"]})])  # fmt: skip
    ok, what = pw.cached_everything(cache, fp)
    assert ok and what.startswith("3 kernels")
    # another GPU (SM count), another config: another stamp
    assert not pw.cached_everything(cache, pw.fingerprint(cfg, ("NVIDIA H200", 16)))[0]
    assert not pw.cached_everything(
        cache, pw.fingerprint({**cfg, "hc_mult": 2}, ("NVIDIA H200", 132))
    )[0]
    # an entry that lost a file (TileLang would recompile it)
    (root / "k2" / "executable.so").unlink()
    ok, why = pw.cached_everything(cache, fp)
    assert not ok and "1 of 3 kernels no longer" in why
    pw.stamp_path(cache, fp).write_text("{")
    assert "unreadable" in pw.cached_everything(cache, fp)[1]


def test_no_stamp_when_a_worker_could_not_report(tmp_path: Path) -> None:
    fp = pw.fingerprint({"hidden_size": 64}, ("g", 1))
    assert pw.write_stamp(tmp_path, fp, [("r", {"k": ["f"]}), None]) is None
    assert pw.write_stamp(tmp_path, fp, []) is None
    assert pw.write_stamp(tmp_path, fp, [("r", {}), ("r", {})]) is None  # no kernel reported
    assert pw.write_stamp(tmp_path, fp, [("r", {"k": ["f"]}), ("s", {"j": ["f"]})]) is None
    assert not pw.stamp_path(tmp_path, fp).exists()


def _deepgemm_entry(cache: Path, name: str) -> dict[str, list[str]]:
    (cache / "cache" / name).mkdir(parents=True)
    for f in ("kernel.cu", "kernel.cubin"):
        (cache / "cache" / name / f).write_bytes(b"x")
    return {name: ["kernel.cu", "kernel.cubin"]}


def test_stamp_covers_deepgemms_mhc_kernels(tmp_path: Path) -> None:
    """The mHC GEMM's DeepGEMM entries are in the stamp: one that lost its cubin, or a DeepGEMM
    at another path or with another cache folder, means the full prewarm."""
    cache, root, dg = tmp_path / "tl", tmp_path / "tl" / "k", tmp_path / "dg"
    loc = {"package": "/site/vllm/third_party/deep_gemm", "cache": str(dg)}
    fp = pw.fingerprint({"hidden_size": 64}, ("NVIDIA H100", 132), loc)
    tl = (str(root), _tilelang_entry(root, "k1"))
    a, b = (_deepgemm_entry(dg, f"kernel.sm90_tf32_hc_prenorm_gemm.{h}") for h in ("aa", "bb"))
    assert pw.write_stamp(cache, fp, [tl, tl], [(str(dg), a), (str(dg), b)])
    ok, what = pw.cached_everything(cache, fp)
    assert ok and what == f"1 kernels in {root} and 2 DeepGEMM kernels in {dg / 'cache'}"
    for other in ({**loc, "package": "/other/deep_gemm"}, {**loc, "cache": str(tmp_path)}):
        fp2 = pw.fingerprint({"hidden_size": 64}, ("NVIDIA H100", 132), other)
        assert pw.cached_everything(cache, fp2) == (False, "no stamp of a previous prewarm")
    (dg / "cache" / "kernel.sm90_tf32_hc_prenorm_gemm.bb" / "kernel.cubin").unlink()
    ok, why = pw.cached_everything(cache, fp)
    assert not ok and why == f"1 of 2 DeepGEMM kernels no longer in {dg / 'cache'}"
    # workers that kept DeepGEMM's kernels elsewhere, or disagree: no stamp
    stale = pw.stamp_path(cache, fp)
    stale.unlink()
    assert pw.write_stamp(cache, fp, [tl], [(str(tmp_path), a)]) is None
    assert pw.write_stamp(cache, fp, [tl, tl], [(str(dg), a), (str(tmp_path), b)]) is None
    assert not stale.exists()
    # workers that never used DeepGEMM: the TileLang entries alone
    assert pw.write_stamp(cache, fp, [tl], [("", {})])
    assert pw.cached_everything(cache, fp) == (True, f"1 kernels in {root}")


def test_deepgemm_entries_are_the_complete_mhc_gemm_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    assert pw._deepgemm_entries() == ("", {})
    want = _deepgemm_entry(tmp_path, "kernel.sm90_tf32_hc_prenorm_gemm.aa")
    _deepgemm_entry(tmp_path, "kernel.sm90_fp8_gemm_1d2d.cc")  # not the mHC GEMM
    half = tmp_path / "cache" / "kernel.sm90_tf32_hc_prenorm_gemm.bb"
    half.mkdir()
    (half / "kernel.cu").write_bytes(b"x")  # still compiling: no cubin
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    assert pw._deepgemm_entries() == (str(tmp_path), want)


def test_deepgemm_location_follows_vllms_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's order: an installed deep_gemm, else its vendored copy; DG_JIT_CACHE_DIR, else
    VLLM_CACHE_ROOT/deep_gemm, else XDG_CACHE_HOME (or ~/.cache)/vllm/deep_gemm."""
    import importlib.util

    import vllm

    for k in ("DG_JIT_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    got = pw.deepgemm_location()
    vendored = Path(vllm.__file__).parent / "third_party" / "deep_gemm"
    if importlib.util.find_spec("deep_gemm") is None:
        assert got["package"] == (str(vendored) if vendored.is_dir() else None)
    assert got["cache"] == str(tmp_path / "home" / ".cache" / "vllm" / "deep_gemm")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pw.deepgemm_location()["cache"] == str(tmp_path / "xdg" / "vllm" / "deep_gemm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "v"))
    assert pw.deepgemm_location()["cache"] == str(tmp_path / "v" / "deep_gemm")
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "dg"))
    assert pw.deepgemm_location()["cache"] == str(tmp_path / "dg")
    # an installed deep_gemm comes first
    (tmp_path / "site" / "deep_gemm").mkdir(parents=True)
    (tmp_path / "site" / "deep_gemm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert pw.deepgemm_location()["package"] == str(tmp_path / "site" / "deep_gemm")


def test_fast_path_spawns_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Everything in the TileLang cache: no worker process, no vLLM call, exit 0."""
    import types

    import torch

    model = _tiny_model(tmp_path)
    cache = tmp_path / "tl"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)

    def forbidden(*a, **k):
        raise AssertionError("the fast path must not start workers or call vLLM")

    monkeypatch.setattr(pw.mp, "get_context", forbidden)
    monkeypatch.setattr(pw, "_vllm_num_split", forbidden)
    fp = pw.fingerprint(pw.mhc_config(model), ("NVIDIA H200", 132), pw.deepgemm_location())
    root = cache / "ns" / "kernels"
    pw.write_stamp(cache, fp, [(str(root), _tilelang_entry(root, "k1"))])
    out_json = tmp_path / "out.json"
    assert pw.main([str(model), "--json", str(out_json)]) == 0
    assert "nothing to do, 1 kernels" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["cached"] is True
    # once an entry is gone, the full prewarm runs (here: reaches the forbidden worker start)
    (root / "k1" / "params.pkl").unlink()
    assert pw.main([str(model)]) != 0


def _serve_stub(tmp_path: Path):
    """scripts/serve.sh with a stand-in interpreter (a GPU 'visible', the prewarms and vLLM only
    logged with the OMP_NUM_THREADS they see, everything else the real Python). Returns
    serve(*args, **env) -> the logged calls."""
    import stat
    import subprocess
    import sys
    import time

    log = tmp_path / "calls.log"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        f'  *torch.cuda.is_available*|*cutedsl.tools.prewarm*|*vllm.entrypoints*) echo "$* OMP=${{OMP_NUM_THREADS-unset}}" >> {log}; exit 0 ;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def serve(*args: str, **env: str) -> list[str]:
        log.unlink(missing_ok=True)
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        r = subprocess.run(["bash", str(REPO / "scripts" / "serve.sh"), str(model), *args],
                           env=dict(base, PYTHON=str(stub),
                                    CUTEDSL_CACHE_DIR=str(tmp_path / "cache"), **env),
                           capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        time.sleep(0.5)  # the background prewarm is logged after the exec'd server, or before
        return log.read_text().splitlines()

    return model, serve


def test_serve_script_starts_the_kernel_prewarm_beside_vllm(tmp_path: Path) -> None:
    """Our kernel prewarm starts in the background with the server's max_num_batched_tokens (its
    last value across the flags, as vLLM reads them), and not for tensor parallel or with
    PREWARM_KERNELS=0."""
    model, run = _serve_stub(tmp_path)

    def serve(*args: str, **env: str) -> list[str]:
        return [ln.rsplit(" OMP=", 1)[0] for ln in run(*args, **env) if "prewarm_kernels" in ln]

    flags = {"VLLM_EXTRA_ARGS": "--max-num-batched-tokens 4096 --seed 1"}
    assert serve(**flags) == [
        f"-m cutedsl.tools.prewarm_kernels {model} --max-num-batched-tokens 4096"
    ]
    assert serve("--max-num-batched-tokens=2048", **flags)[0].endswith(
        "--max-num-batched-tokens 2048"
    )
    assert serve()[0].endswith("--max-num-batched-tokens 8192")
    assert serve(TENSOR_PARALLEL_SIZE="2") == []
    assert serve(PREWARM_KERNELS="0") == []
    assert (tmp_path / "cache" / "prewarm-kernels.log").is_file()  # where serve.sh says it logs


def test_serve_script_gives_the_server_one_cpu_thread_unless_told(tmp_path: Path) -> None:
    """vLLM serves with OMP_NUM_THREADS=1 by default (set unconditionally, before the one exec that
    SERVE_UPSTREAM=1 also takes); an explicit value is kept; the kernel prewarm (its own compile
    processes) is not limited."""
    _, serve = _serve_stub(tmp_path)

    def omp(**env: str) -> tuple[str, ...]:
        calls = serve(**env)
        vllm = [ln for ln in calls if "vllm.entrypoints" in ln]
        pre = [ln for ln in calls if "prewarm_kernels" in ln]
        assert len(vllm) == 1, calls
        return (vllm[0].rsplit("OMP=", 1)[1],) + tuple(p.rsplit("OMP=", 1)[1] for p in pre)

    assert omp() == ("1", "unset")
    assert omp(OMP_NUM_THREADS="8") == ("8", "8")
