"""`cutedsl.jit`, the one compile cache: the key holds every codegen argument of every kernel the
runtime compiles (and the arch and DSL version), a key compiles once even under concurrent first
calls, and nothing compiles during CUDA-graph capture. CPU only: builders are stand-ins or the
real ones with their compile function replaced by a recorder."""

from __future__ import annotations

import importlib.util
import inspect
import threading
import time
from pathlib import Path

import pytest

from cutedsl import jit
from cutedsl.sm90 import gemm as sm90_gemm
from cutedsl.sm90 import routing, swiglu
from cutedsl.sm100.kernels import gemm as sm100_kernels
from cutedsl.sm100.kernels import quant as sm100_quant

COMPILE_MODE = {"no_jit_engine", "options"}
_spec = importlib.util.spec_from_file_location(
    "serve_bench", Path(__file__).parents[1] / "bench" / "serve_bench.py"
)
serve_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_bench)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets an empty disk cache of its own (never the user's)."""
    root = tmp_path / "cutedsl-cache"
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(root))
    monkeypatch.delenv(jit.CACHE_ENV, raising=False)
    return root


def _builders() -> list[tuple[object, tuple]]:
    """(builder, one valid argument tuple) for every builder the runtime passes to jit.compiled."""
    return [
        (sm90_gemm._build, (128, 16, 1, True, True, 10.0)),
        (sm90_gemm._build_stream, (16, 8, 8, 4, False, 132, 2)),
        (routing._build, ("route",)),
        (swiglu._build, (10.0,)),
        (sm100_kernels.compile_gemm, (False, 10.0, 128)),
        (sm100_quant.compile_quant, ()),
    ]


def _other_value(v: object) -> object:
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v * 2
    if isinstance(v, float):
        return v + 1.0
    if v is None:
        return 1.0
    if isinstance(v, str):
        return v + "x"
    raise AssertionError(f"no other value for {v!r}")


@pytest.mark.parametrize("i", range(len(_builders())))
def test_key_covers_every_codegen_argument(i: int) -> None:
    build, args = _builders()[i]
    params = list(inspect.signature(build).parameters)
    # what callers leave at its default is only how `make check-kernels` compiles (no loading)
    assert set(params[len(args) :]) <= COMPILE_MODE, f"{build.__qualname__}: pass {params}"
    base = jit.cache_key(build, *args)
    for j in range(len(args)):
        changed = list(args)
        changed[j] = _other_value(args[j])
        assert jit.cache_key(build, *changed) != base, f"{build.__qualname__}: {params[j]}"


def test_keys_of_different_kernels_differ() -> None:
    keys = [jit.cache_key(b, *a) for b, a in _builders()]
    assert len(set(keys)) == len(keys)


def test_key_has_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    k90 = jit.cache_key(swiglu._build, 10.0)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    k100 = jit.cache_key(swiglu._build, 10.0)
    assert k90 != k100 and k90[-1] == "sm_90a"


def test_sm90_builder_passes_every_argument_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the key holds is what the kernel is built from (not a subset of it)."""
    from cutedsl.sm90.kernels import gemm as kernels

    seen = []
    monkeypatch.setattr(kernels, "compile_kernel", lambda *a, **kw: seen.append((a, kw)))
    sm90_gemm._build(64, 32, 2, True)
    sm90_gemm._build(64, 32, 2, True, no_jit_engine=True)
    sm90_gemm._build(64, 32, 1, True, swiglu=True, swiglu_limit=10.0)
    plain = {"swiglu": False, "swiglu_limit": None}
    assert seen == [((64, 32, 2, True), {"no_jit_engine": False, **plain}),
                    ((64, 32, 2, True), {"no_jit_engine": True, **plain}),
                    ((64, 32, 1, True), {"no_jit_engine": False, "swiglu": True,
                                         "swiglu_limit": 10.0})]  # fmt: skip


def test_compiles_once_per_key_under_concurrent_first_calls(monkeypatch, caplog) -> None:
    """One compile per key however many threads ask first, each logged once by name (the line a
    server log shows for a first-use stall, which the serving benchmark counts); a hit logs
    nothing."""
    monkeypatch.setattr(jit, "_CACHE", {})
    caplog.set_level("INFO", logger="cutedsl.jit")
    calls = []

    def build(tag: str) -> object:
        calls.append(tag)
        time.sleep(0.05)  # the other threads arrive while this one compiles
        return object()

    before = jit.compile_count()
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(jit.compiled(build, "a"))) for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["a"] and len({id(g) for g in got}) == 1 and len(got) == 6
    assert jit.compiled(build, "b") is not got[0] and calls == ["a", "b"]
    assert jit.compile_count() == before + 2
    jit.compiled(build, "a")
    lines = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert len(lines) == 2 and "build('a',)" in lines[0] and "build('b',)" in lines[1], lines
    assert [e["kind"] for e in serve_bench.compile_lines(lines)] == ["cutedsl", "cutedsl"]


def test_refuses_to_compile_during_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "_CACHE", {})
    monkeypatch.setattr(jit, "target_arch", lambda: "sm_90a")
    monkeypatch.setattr(swiglu, "_build", lambda limit: f"kernel({limit})")
    warm = jit.compiled(swiglu._build, 10.0)  # before capture
    monkeypatch.setattr(jit, "_cuda_available", lambda: True)
    monkeypatch.setattr(jit.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert jit.compiled(swiglu._build, 10.0) == warm  # a hit is served during capture
    count = jit.compile_count()
    with pytest.raises(jit.CompileDuringCaptureError, match="call the runner's warmup"):
        jit.compiled(swiglu._build, 5.0)
    assert jit.compile_count() == count
