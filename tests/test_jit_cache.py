"""`cutedsl.jit`'s disk cache on the CPU: the key, the atomic write, validation before any load,
recompile-on-corrupt, and the compile pool.

Two kinds of tests: stand-ins (an object whose `export_to_c` writes known bytes and a loader that
records what it is given: the on-disk logic without the DSL), and the real route with a real
kernel (the SM90 clamped SwiGLU compiled for sm_90a without a GPU, exported with
`export_to_c`, loaded back with `cute.runtime.load_module`; loading works without a GPU, running
does not: tests/test_jit_cache_gpu.py runs the loaded kernels)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cutedsl import jit
from cutedsl.sm90 import swiglu

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cutedsl-cache"
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(root))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv(jit.CACHE_ENV, raising=False)
    monkeypatch.setattr(jit, "_CACHE", {})
    monkeypatch.setattr(jit, "_PENDING", {})
    return root


class FakeKernel:
    """Stands in for a TVM-FFI compiled function: `export_to_c` writes `payload`."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def export_to_c(self, object_file_path: str, function_name: str) -> None:
        assert function_name == jit.EXPORT_NAME
        Path(object_file_path).write_bytes(self.payload)


class Recorder:
    """A loader: returns ("loaded", bytes of the file) and records every file it was given."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, path: Path) -> object:
        data = path.read_bytes()
        self.seen.append(data)
        return ("loaded", data)


def _entry(root: Path, tag: str = "a") -> jit.Entry:
    return jit.Entry(root, jit.disk_key(swiglu._build, (10.0,), {"tag": tag}))


@pytest.fixture
def fake_persistable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "_persistable", lambda fn: isinstance(fn, FakeKernel))


def _compiler(payloads: list[bytes]):
    calls = []

    def compile_fn() -> FakeKernel:
        calls.append(1)
        return FakeKernel(payloads[len(calls) - 1])

    return compile_fn, calls


# --------------------------------------------------------------------------- the key


def test_disk_key_changes_with_everything_that_changes_the_binary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def digest() -> str:
        return jit.key_digest(jit.disk_key(swiglu._build, (10.0,), {}))

    base = digest()
    assert jit.key_digest(jit.disk_key(swiglu._build, (5.0,), {})) != base
    assert jit.key_digest(jit.disk_key(swiglu._build, (10,), {})) != base  # int is not float
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert digest() != base
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")  # codegen: in the key
    assert digest() != base
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")  # logging only: not in the key
    assert digest() == base
    for fn, value in (
        ("source_hash", "0" * 64),
        ("dsl_version", "4.4.3"),
    ):
        with monkeypatch.context() as m:
            m.setattr(jit, fn, lambda value=value: value)
            assert digest() != base, fn
    with monkeypatch.context() as m:
        m.setattr(jit, "_version", lambda dist: "9.9" if dist == "apache-tvm-ffi" else "4.4.2")
        assert digest() != base
    with monkeypatch.context() as m:
        m.setattr(jit.sys, "version_info", (3, 12, 0))
        assert digest() != base
    assert digest() == base


def test_source_hash_covers_kernel_sources_only(tmp_path: Path, monkeypatch) -> None:
    """Editing a kernel file changes the hash; editing a tool, bench or vLLM adapter does not."""
    pkg = tmp_path / "pkg"
    for rel in ("sm90/kernels/gemm.py", "jit.py", "tools/x.py", "bench/y.py", "vllm/z.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(jit, "_PKG", pkg)

    def h() -> str:
        jit.source_hash.cache_clear()
        return jit.source_hash()

    try:
        base = h()
        (pkg / "tools/x.py").write_text("changed")
        (pkg / "vllm/z.py").write_text("changed")
        assert h() == base
        (pkg / "sm90/kernels/gemm.py").write_text("# changed\n")
        assert h() != base
    finally:
        monkeypatch.undo()
        jit.source_hash.cache_clear()


def test_build_arguments_must_be_plain_values() -> None:
    with pytest.raises(TypeError, match="only None, bool, int, float, str and tuples"):
        jit.disk_key(swiglu._build, ([1],), {})


# --------------------------------------------------------------------------- store and load


def test_store_then_load_gives_the_stored_bytes(_private_cache: Path, fake_persistable) -> None:
    entry = _entry(_private_cache)
    payload = os.urandom(4096)
    compile_fn, calls = _compiler([payload])
    fn, loaded = jit.load_or_compile(entry, compile_fn, Recorder())
    assert not loaded and isinstance(fn, FakeKernel) and calls == [1]
    rec = json.loads(entry.record.read_text())
    assert rec["key"] == entry.key and rec["format"] == jit.FORMAT and rec["size"] == len(payload)
    loader = Recorder()
    fn2, loaded2 = jit.load_or_compile(entry, compile_fn, loader)
    assert loaded2 and fn2 == ("loaded", payload) and calls == [1]
    left = {p.name for p in entry.folder.iterdir() if not p.name.endswith(".lock")}
    assert left == {entry.record.name, rec["object"]}  # no temporary file left


def _corrupt_object(entry: jit.Entry, how: str) -> None:
    rec = json.loads(entry.record.read_text())
    obj = entry.folder / rec["object"]
    data = bytearray(obj.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "missing":
        obj.unlink()
        return
    obj.write_bytes(bytes(data))


def _corrupt_record(entry: jit.Entry, how: str) -> None:
    rec = json.loads(entry.record.read_text())
    if how == "garbage":
        entry.record.write_bytes(b"\x00not json")
        return
    if how == "other-key":
        rec["key"] = dict(rec["key"], args=[[1]])
    elif how == "other-format":
        rec["format"] = jit.FORMAT + 1
    elif how == "escape":
        rec["object"] = "../" + rec["object"]
    entry.record.write_text(json.dumps(rec))


CORRUPTIONS = [("object", h) for h in ("flip", "truncate", "missing")] + [
    ("record", h) for h in ("garbage", "other-key", "other-format", "escape")
]


@pytest.mark.parametrize("part,how", CORRUPTIONS, ids=[f"{p}-{h}" for p, h in CORRUPTIONS])
def test_corrupt_or_mismatched_entry_is_recompiled_not_loaded(
    part: str, how: str, _private_cache: Path, fake_persistable, caplog
) -> None:
    entry = _entry(_private_cache)
    good, fresh = os.urandom(2048), os.urandom(2048)
    compile_fn, calls = _compiler([good, fresh])
    jit.load_or_compile(entry, compile_fn, Recorder())
    (_corrupt_object if part == "object" else _corrupt_record)(entry, how)
    loader = Recorder()
    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        fn, loaded = jit.load_or_compile(entry, compile_fn, loader)
    assert not loaded and calls == [1, 1] and fn.payload == fresh
    assert loader.seen == []  # the corrupt entry never reached the loader
    assert "recompiling it (not loaded)" in caplog.text and str(entry.folder) in caplog.text
    # replaced by a valid entry of the new compile
    assert jit.load_or_compile(entry, compile_fn, Recorder()) == (("loaded", fresh), True)


def test_load_failure_after_a_good_checksum_recompiles(
    _private_cache: Path, fake_persistable, caplog
) -> None:
    entry = _entry(_private_cache)
    compile_fn, calls = _compiler([b"x" * 64, b"y" * 64])
    jit.load_or_compile(entry, compile_fn, Recorder())

    def refuse(path: Path) -> object:
        raise RuntimeError("BinaryExecutionEngine: Failed to add object file")

    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        fn, loaded = jit.load_or_compile(entry, compile_fn, refuse)
    assert not loaded and fn.payload == b"y" * 64 and "load failed" in caplog.text


def test_failed_export_leaves_no_entry(_private_cache: Path, fake_persistable, caplog) -> None:
    class Breaks(FakeKernel):
        def export_to_c(self, object_file_path: str, function_name: str) -> None:
            Path(object_file_path).write_bytes(b"half")
            raise OSError("disk full")

    entry = _entry(_private_cache)
    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        assert not entry.store(Breaks(b""))
    assert "could not store" in caplog.text
    assert not entry.exists()
    assert [p.name for p in entry.folder.iterdir() if not p.name.endswith(".lock")] == []


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from cutedsl import jit
from cutedsl.sm90 import swiglu

class Slow:
    def export_to_c(self, object_file_path, function_name):
        with open(object_file_path, "wb") as f:
            f.write(b"half an object")
            f.flush()
            print("writing", flush=True)
            time.sleep(60)

phase = sys.argv[1]
entry = jit.Entry(Path(sys.argv[2]), jit.disk_key(swiglu._build, (10.0,), {"tag": "a"}))
if phase == "record":  # killed after the object is in place, before its record is
    real = jit._write_atomic
    def write(path, data):
        if path.suffix == ".json":
            print("writing", flush=True)
            time.sleep(60)
        real(path, data)
    jit._write_atomic = write
    class Done:
        def export_to_c(self, object_file_path, function_name):
            Path(object_file_path).write_bytes(b"complete object")
    entry.store(Done())
else:
    entry.store(Slow())
"""


@pytest.mark.parametrize("phase", ["object", "record"])
def test_a_killed_writer_leaves_no_entry(phase: str, _private_cache: Path, caplog) -> None:
    """SIGKILL while the object (or the record) is being written: no entry, no warning, a miss."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, phase, str(_private_cache)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    entry = _entry(_private_cache)
    assert not entry.exists()
    loader = Recorder()
    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        assert entry.load(loader) is None
    assert loader.seen == [] and caplog.text == ""


def test_entry_lock_serializes_processes(_private_cache: Path) -> None:
    entry = _entry(_private_cache)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from cutedsl import jit; "
         "from cutedsl.sm90 import swiglu; "
         "e = jit.Entry(Path(sys.argv[1]), jit.disk_key(swiglu._build, (10.0,), {'tag': 'a'}))\n"
         "with e.locked():\n print('held', flush=True); time.sleep(60)",
         str(_private_cache)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with entry.locked(timeout_s=0.3) as held:
            assert held is False
    finally:
        holder.kill()
        holder.wait()
    with entry.locked(timeout_s=5) as held:
        assert held is True


def test_no_disk_cache_when_turned_off(monkeypatch: pytest.MonkeyPatch, _private_cache) -> None:
    monkeypatch.setenv(jit.CACHE_ENV, "0")
    monkeypatch.setattr(jit, "_persistable", lambda fn: True)
    before = jit.compile_count()
    jit.compiled(lambda: FakeKernel(b"x"))
    assert jit.compile_count() == before + 1 and not _private_cache.exists()
    assert jit.prefetch([jit.Job(swiglu._build, (10.0,))]) == 0


def test_workers_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.WORKERS_ENV, "two")
    with pytest.raises(ValueError, match="CUTEDSL_COMPILE_WORKERS='two'"):
        jit.default_workers()
    monkeypatch.setenv(jit.WORKERS_ENV, "0")
    assert jit.default_workers() == 0


# --------------------------------------------------------------------------- a real kernel


def test_real_kernel_exports_loads_and_a_corrupt_one_is_recompiled(
    _private_cache: Path, caplog
) -> None:
    """The nvidia-cutlass-dsl route end to end (no GPU): compile, export_to_c, load_module; then
    one flipped byte in the object. The DSL loads the flipped object without complaint (shown
    below), so only the record's checksum keeps it from being used."""
    import cutlass.cute as cute

    entry = jit.Entry(_private_cache, jit.disk_key(swiglu._build, (10.0,), {}))
    calls = []

    def compile_fn() -> object:
        calls.append(1)
        return swiglu._build(10.0, no_jit_engine=True)

    fn, loaded = jit.load_or_compile(entry, compile_fn)
    assert not loaded and calls == [1] and jit._persistable(fn)
    fn2, loaded2 = jit.load_or_compile(entry, compile_fn)
    assert loaded2 and calls == [1] and type(fn2).__name__ == "Function"

    _corrupt_object(entry, "flip")
    flipped = entry.folder / json.loads(entry.record.read_text())["object"]
    cute.runtime.load_module(str(flipped), enable_tvm_ffi=True)[jit.EXPORT_NAME]  # no error
    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        fn3, loaded3 = jit.load_or_compile(entry, compile_fn)
    assert not loaded3 and calls == [1, 1] and "does not match" in caplog.text
    assert jit.load_or_compile(entry, compile_fn)[1] and calls == [1, 1]


def test_prefetch_workers_fill_the_cache_and_compiled_loads(_private_cache: Path) -> None:
    """`prefetch` compiles in a separate process (no GPU); `compiled` then loads, not compiles,
    and a second prefetch of the same job starts nothing."""
    job = jit.Job(swiglu._build, (7.0,))
    assert jit.prefetch([job, job], workers=2) == 1
    compiles, loads = jit.compile_count(), jit.load_count()
    t0 = time.monotonic()
    fn = jit.compiled(swiglu._build, 7.0)
    assert jit.compile_count() == compiles and jit.load_count() == loads + 1
    assert type(fn).__name__ == "Function" and time.monotonic() - t0 < 300
    assert jit.prefetch([job]) == 0
    assert jit.compiled(swiglu._build, 7.0) is fn


def test_wait_all_waits_for_every_compile_process(_private_cache: Path) -> None:
    """`wait_all` returns once each worker has exited, with its log and exit status; the entry
    is then on disk and nothing is pending."""
    job = jit.Job(swiglu._build, (5.0,))
    assert jit.prefetch([job], workers=1) == 1
    (log, rc), *more = jit.wait_all()
    assert rc == 0 and not more and log.exists(), log.read_text()[-2000:]
    assert jit.prefetch([job]) == 0 and jit.wait_all() == []


def test_a_failed_worker_falls_back_to_compiling_here(
    _private_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A worker that dies leaves the key to the caller, which compiles (and says why)."""
    monkeypatch.setattr(jit, "_persistable", lambda fn: False)
    job = jit.Job(_unimportable_build, (3,))  # the worker cannot import this test module
    assert jit.prefetch([job], workers=1) == 1
    with caplog.at_level(logging.WARNING, logger="cutedsl.jit"):
        got = jit.compiled(_unimportable_build, 3)
    assert got == ("built", 3) and "compile worker exited" in caplog.text


def _unimportable_build(x: int) -> object:
    return ("built", x)


def test_docker_and_make_run_keep_the_cache_in_a_volume() -> None:
    docker = (REPO / "Dockerfile").read_text()
    make = (REPO / "Makefile").read_text()
    assert "CUTEDSL_CACHE_DIR=/root/.cache/cutedsl" in docker
    assert "-v dsv4-cutedsl-cache:/root/.cache/cutedsl" in make
