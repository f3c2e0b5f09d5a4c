"""The one compile cache of every CuTeDSL kernel in `cutedsl`: in memory, on disk, and a pool of
compile processes that fills the disk while the model loads.

`compiled(build, *args, **kwargs)` returns `build(*args, **kwargs)` (a `cute.compile` result, or
the same kernel loaded from disk), once per process and key. The in-memory key is

    (build's module and qualified name, args, sorted kwargs, target arch)

so it holds exactly the arguments the kernel is built from: a build function is a pure function of
its arguments (its defaults are constants of its source), and every codegen argument a caller can
change is one of them. Runtime values (extents, strides, pointers, routing, the stream) are never
build arguments: kernels take them as symbolic or dynamic operands, so one compile serves every M.
The target arch is `$CUTE_DSL_ARCH` when set (compiling without a GPU), else the current CUDA
device's `sm_XYa`, else "none".

Disk cache (`$CUTEDSL_CACHE_DIR`, default `~/.cache/cutedsl`; `CUTEDSL_CACHE=0` turns it off).
nvidia-cutlass-dsl 4.4.2 never persists a `cute.compile` result itself (`cute.compile` passes
`no_cache=True`, so `$CUTE_DSL_CACHE_DIR` is not used), but a TVM-FFI compiled function exports
its host code with the cubin embedded as one object file (`export_to_c`), and
`cute.runtime.load_module(path, enable_tvm_ffi=True)` loads it back as a `tvm_ffi.Function` with
the same call signature in milliseconds, without the Python tracing or the MLIR pipeline.
- The disk key adds to the in-memory one everything else that changes the binary: a hash of the
  kernel sources (`source_hash`: every `cutedsl/**/*.py` but tools/, bench/ and vllm/, which no
  kernel imports), the nvidia-cutlass-dsl and apache-tvm-ffi versions, the Python implementation
  and version, and the codegen-relevant `CUTE_DSL_*` variables. Its sha256 names the entry.
- An entry is two files in `<dir>/<arch>/`: the object file `<digest>-<sha16>.o` (named by its own
  content) and the record `<digest>.json` (format, the full key, the object's name, size and
  sha256). Each is written to a temporary name and renamed into place, the object first, so a
  killed process leaves at most an unused temporary file, never a half-written entry.
- A load checks the record's format and key and the object's size and sha256 before loading it:
  a corrupt, truncated or mismatched entry is never loaded; it is recompiled and replaced, with a
  warning naming the file. (A bit flip inside the object loads without an error in 4.4.2: the
  checksum is what catches it.)
- A per-entry lock file (`flock`) makes one process compile a key while the others wait for it
  and load it (tensor-parallel workers, the compile pool).
- Only TVM-FFI functions can be exported (`export_to_c` of 4.4.2's other functions cannot
  generate C arguments for plain integer operands); others stay in memory only.

`prefetch(jobs)` starts compile processes (`python -m cutedsl.jit`, no GPU: `CUTE_DSL_ARCH` set,
`CUDA_VISIBLE_DEVICES` empty) for every job that is neither in memory nor on disk; they compile in
parallel (one cute.compile per process at a time: the DSL's compile holds the GIL) and store into
the disk cache, while the caller goes on (loading weights). `compiled` on a key a worker owns
waits for the worker's entry, then loads it; a failed worker only means an in-process compile.
`$CUTEDSL_COMPILE_WORKERS` bounds the pool (default: half the CPUs, at most 8; 0: no pool).

Rules:
- Thread-safe: the first caller of a key compiles (or loads) under a lock, concurrent callers of
  that key wait for it; a hit takes no lock (runners warm up from several threads).
- Never during CUDA-graph capture: a miss while the current stream captures raises
  `CompileDuringCaptureError` (compile in `warmup()` before capture; a compile inside a captured
  region would stall every replay's first call, and a first launch loads the cubin).
- `compile_count()` counts the compiles of this process and `load_count()` the kernels it loaded
  from disk, so tests assert none after warm-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CACHE: dict[Hashable, object] = {}
_LOCK = threading.Lock()
_COMPILES = [0]
_LOADS = [0]

CACHE_DIR_ENV = "CUTEDSL_CACHE_DIR"
CACHE_ENV = "CUTEDSL_CACHE"  # "0": no disk cache
WORKERS_ENV = "CUTEDSL_COMPILE_WORKERS"
FORMAT = 1  # the on-disk layout of an entry; a record of another format is recompiled
EXPORT_NAME = "cutedsl_kernel"  # the symbol prefix of an exported function
LOCK_TIMEOUT_S = 900.0  # longer than any single compile
# CUTE_DSL_* variables that only log, dump or locate files: not part of the disk key.
_NON_CODEGEN_ENV = frozenset(
    "CUTE_DSL_" + s
    for s in (
        "ARCH",  # in the key as the target arch
        "LOG_TO_CONSOLE",
        "LOG_TO_FILE",
        "LOG_LEVEL",
        "DUMP_DIR",
        "CACHE_DIR",
        "FILTER_STACKTRACE",
        "PRINT_AFTER_PREPROCESSOR",
        "PRINT_IR",
        "JIT_TIME_PROFILING",
        "JIT_CACHE_MAX_ELEMS",
        "NO_CACHE",
        "DISABLE_FILE_CACHING",
    )
)
_PKG = Path(__file__).resolve().parent
_NOT_KERNEL_SOURCES = ("tools", "bench", "vllm")


class CompileDuringCaptureError(RuntimeError):
    """A kernel was first needed while a CUDA graph was being captured."""


# --------------------------------------------------------------------------- keys


@functools.cache
def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version ("none" without it)."""
    return _version("nvidia-cutlass-dsl")


@functools.cache
def _device_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}a"


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def target_arch() -> str:
    """`$CUTE_DSL_ARCH`, else the current CUDA device's arch, else "none". Called per launch (it is
    part of the key): an environment lookup and, on a GPU, `current_device()` (CUDA availability
    and each device's arch are read once per process)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    if _cuda_available():
        return _device_arch(torch.cuda.current_device())
    return "none"


def cache_key(build: Callable[..., object], *args: Hashable, **kwargs: Hashable) -> tuple:
    """The key `compiled(build, *args, **kwargs)` caches under in this process."""
    return (build.__module__, build.__qualname__, args, tuple(sorted(kwargs.items())),
            target_arch())  # fmt: skip


@functools.cache
def source_hash() -> str:
    """sha256 of every kernel-side source of the package (`cutedsl/**/*.py` but tools/, bench/
    and vllm/), path and content: any edit of a kernel, its builder or a helper it may import
    changes it."""
    h = hashlib.sha256()
    for path in sorted(_PKG.rglob("*.py")):
        rel = path.relative_to(_PKG)
        if rel.parts[0] in _NOT_KERNEL_SOURCES:
            continue
        data = path.read_bytes()
        h.update(rel.as_posix().encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _json_value(v: object) -> object:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": v.hex()}  # exact, and distinct from an int of the same value
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    raise TypeError(f"kernel build argument {v!r}: only None, bool, int, float, str and tuples")


def disk_key(build: Callable[..., object], args: tuple, kwargs: dict) -> dict:
    """Everything the compiled binary depends on (module docstring), as a JSON object."""
    return {
        "build": f"{build.__module__}:{build.__qualname__}",
        "args": [_json_value(a) for a in args],
        "kwargs": {k: _json_value(v) for k, v in sorted(kwargs.items())},
        "arch": target_arch(),
        "source": source_hash(),
        "nvidia-cutlass-dsl": dsl_version(),
        "apache-tvm-ffi": _version("apache-tvm-ffi"),
        "python": f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}",
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and k not in _NON_CODEGEN_ENV
        },  # fmt: skip
    }


def key_digest(key: dict) -> str:
    """The entry name of a disk key: sha256 of its canonical JSON (32 hex digits)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- disk entries


def cache_dir() -> Path | None:
    """The disk cache folder, or None when `CUTEDSL_CACHE=0`."""
    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "cutedsl")


def _persistable(fn: object) -> bool:
    try:
        from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase
    except ImportError:
        return False
    return isinstance(fn, TVMFFIJitCompiledFunctionBase)


def _load_object(path: Path) -> object:
    import cutlass.cute as cute

    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class Entry:
    """One disk cache entry: `<root>/<arch>/<digest>.json` + its object file."""

    root: Path
    key: dict
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        self.digest = key_digest(self.key)

    @property
    def folder(self) -> Path:
        return self.root / self.key["arch"]

    @property
    def record(self) -> Path:
        return self.folder / f"{self.digest}.json"

    def exists(self) -> bool:
        return self.record.is_file()

    def load(self, loader: Callable[[Path], object] | None = None) -> object | None:
        """The kernel of a valid entry (`loader(object file)`, default: `load_module` of it);
        None when absent; None with a warning naming the file when corrupt or of another key
        (never loaded)."""
        try:
            raw = self.record.read_bytes()
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return self._bad(self.record, f"unreadable record ({e})")
        if rec.get("format") != FORMAT or rec.get("key") != self.key:
            return self._bad(self.record, "record of another format or key")
        name = rec.get("object")
        if not isinstance(name, str) or "/" in name or not name.startswith(self.digest):
            return self._bad(self.record, f"bad object name {name!r}")
        obj = self.folder / name
        try:
            data = obj.read_bytes()
        except FileNotFoundError:
            return self._bad(obj, "object file missing")
        if len(data) != rec.get("size") or hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            return self._bad(obj, "object file does not match its record's size and sha256")
        try:
            return (loader or _load_object)(obj)
        except Exception as e:  # a valid checksum but a load failure: the same remedy
            return self._bad(obj, f"load failed ({type(e).__name__}: {e})")

    def _bad(self, path: Path, why: str) -> None:
        logger.warning("cutedsl.jit: %s: %s; recompiling it (not loaded)", path, why)
        return None

    def store(self, fn: object) -> bool:
        """Export a TVM-FFI compiled function into this entry (object, then record, each renamed
        into place). False, with a warning, when it cannot be stored."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{self.digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}.export.o"
        try:
            fn.export_to_c(str(tmp), function_name=EXPORT_NAME)
            data = tmp.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            name = f"{self.digest}-{sha[:16]}.o"
            _write_atomic(self.folder / name, data)
            rec = {"format": FORMAT, "key": self.key, "object": name, "size": len(data),
                   "sha256": sha, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
            _write_atomic(self.record, json.dumps(rec, indent=1, sort_keys=True).encode())
        except Exception as e:
            logger.warning(
                "cutedsl.jit: could not store %s (%s: %s)", self.record, type(e).__name__, e
            )
            return False
        finally:
            tmp.unlink(missing_ok=True)
        for old in self.folder.glob(f"{self.digest}-*.o"):  # objects of replaced records
            if old.name != name:
                old.unlink(missing_ok=True)
        return True

    @contextlib.contextmanager
    def locked(self, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
        """Hold this entry's file lock (True), or give up after `timeout_s` (False)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / f"{self.digest}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        yield False
                        return
                    time.sleep(0.05)
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def load_or_compile(
    entry: Entry, compile_fn: Callable[[], object], loader: Callable[[Path], object] | None = None
) -> tuple[object, bool]:
    """(kernel, loaded): the entry's kernel when valid, else `compile_fn()` stored into it; under
    the entry's lock, so concurrent processes compile a key once."""
    with entry.locked() as held:
        fn = entry.load(loader)
        if fn is not None:
            return fn, True
        fn = compile_fn()
        if not held:
            logger.warning("cutedsl.jit: %s stayed locked; compiled without storing", entry.record)
        elif _persistable(fn):
            entry.store(fn)
        return fn, False


# --------------------------------------------------------------------------- compile pool


@dataclass(frozen=True)
class Job:
    """One kernel to compile: `build(*args, **kwargs)` (what `compiled` takes)."""

    build: Callable[..., object]
    args: tuple = ()
    kwargs: tuple = ()  # sorted (name, value) pairs

    def run(self) -> object:
        return compiled(self.build, *self.args, **dict(self.kwargs))


@dataclass
class _Worker:
    proc: subprocess.Popen
    log: Path


_PENDING: dict[Hashable, _Worker] = {}


def default_workers() -> int:
    env = os.environ.get(WORKERS_ENV)
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"${WORKERS_ENV}={env!r}: expected an integer >= 0") from None
        if n < 0:
            raise ValueError(f"${WORKERS_ENV}={env!r}: expected an integer >= 0")
        return n
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def prefetch(jobs: Iterable[Job], workers: int | None = None) -> int:
    """Compile, in background processes, every job neither in memory nor on disk (module
    docstring); returns how many were started. Nothing without a disk cache or with 0 workers."""
    root = cache_dir()
    workers = default_workers() if workers is None else workers
    if root is None or workers == 0:
        return 0
    todo, seen = [], set()
    for job in jobs:
        kw = dict(job.kwargs)
        key = cache_key(job.build, *job.args, **kw)
        if key in seen or key in _CACHE or key in _PENDING:
            continue
        seen.add(key)
        entry = Entry(root, disk_key(job.build, job.args, kw))
        if not entry.exists():
            todo.append((key, entry, job))
    if not todo:
        return 0
    parts = [todo[i :: min(workers, len(todo))] for i in range(min(workers, len(todo)))]
    env = dict(os.environ, CUTE_DSL_ARCH=target_arch(), CUDA_VISIBLE_DEVICES="",
               **{CACHE_DIR_ENV: str(root)})  # fmt: skip
    logdir = Path(tempfile.mkdtemp(prefix="cutedsl-compile-"))
    for i, part in enumerate(parts):
        spec = [{"build": e.key["build"], "args": list(j.args), "kwargs": dict(j.kwargs)}
                for _, e, j in part]  # fmt: skip
        log = logdir / f"worker{i}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cutedsl.jit", json.dumps(spec)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        for key, _, _ in part:
            _PENDING[key] = _Worker(proc, log)
    logger.info("cutedsl.jit: compiling %d kernels in %d processes", len(todo), len(parts))
    return len(todo)


def wait_all() -> list[tuple[Path, int]]:
    """Wait for every compile process `prefetch` started in this process: (log, exit status)
    of each."""
    workers = {id(w.proc): w for w in _PENDING.values()}
    _PENDING.clear()
    return [(w.log, w.proc.wait()) for w in workers.values()]


def _wait_for_worker(key: Hashable, entry: Entry) -> None:
    """Until the worker owning `key` has stored its entry or exited."""
    w = _PENDING.pop(key, None)
    if w is None:
        return
    while not entry.exists() and w.proc.poll() is None:
        time.sleep(0.02)
    if not entry.exists() and w.proc.returncode:
        tail = w.log.read_text(errors="replace").strip().splitlines()[-5:]
        logger.warning(
            "cutedsl.jit: compile worker exited with %s before %s (%s); compiling here",
            w.proc.returncode, entry.key["build"], " | ".join(tail),
        )  # fmt: skip


def _resolve(name: str) -> Callable[..., object]:
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _arg(v: object) -> object:
    if isinstance(v, list):
        return tuple(_arg(x) for x in v)
    return v


def _worker_main(spec_json: str) -> int:
    """A compile worker: compile each job (without a JIT engine when the builder takes
    `no_jit_engine`) and store it in the disk cache."""
    import inspect

    root = cache_dir()
    if root is None:
        return 2
    for job in json.loads(spec_json):
        build = _resolve(job["build"])
        args = tuple(_arg(a) for a in job["args"])
        kwargs = {k: _arg(v) for k, v in job["kwargs"].items()}
        entry = Entry(root, disk_key(build, args, kwargs))
        extra = {}
        if "no_jit_engine" in inspect.signature(build).parameters:
            extra["no_jit_engine"] = True
        t0 = time.monotonic()
        compile_fn = functools.partial(build, *args, **kwargs, **extra)
        _, loaded = load_or_compile(entry, compile_fn, lambda p: p)
        what = "present" if loaded else "compiled"
        print(f"{job['build']}{args}: {what} in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


# --------------------------------------------------------------------------- the cache


def compiled(build: Callable[..., object], *args: Hashable, **kwargs: Hashable) -> object:
    """`build(*args, **kwargs)`, once per process and `cache_key`: from memory, else from the
    disk cache, else compiled (and stored)."""
    key = cache_key(build, *args, **kwargs)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    if _cuda_available() and torch.cuda.is_current_stream_capturing():
        raise CompileDuringCaptureError(
            f"{build.__module__}.{build.__qualname__}{args}{kwargs or ''}: not compiled before "
            "CUDA-graph capture; call the runner's warmup(max_tokens) first"
        )

    def build_now() -> object:
        # one line per kernel compiled in this process: after start-up it names a first-use stall
        logger.info("cutedsl.jit: compiling %s.%s%s%s", build.__module__, build.__qualname__,
                    args, kwargs or "")  # fmt: skip
        return build(*args, **kwargs)

    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            root = cache_dir()
            if root is None:
                fn, loaded = build_now(), False
            else:
                entry = Entry(root, disk_key(build, args, kwargs))
                _wait_for_worker(key, entry)
                fn, loaded = load_or_compile(entry, build_now)
            _CACHE[key] = fn
            (_LOADS if loaded else _COMPILES)[0] += 1
    return fn


def ensure(jobs: Iterable[Job]) -> None:
    """`compiled` each job (loads or compiles now; for warm-up)."""
    for job in jobs:
        job.run()


def compile_count() -> int:
    """How many kernels this process compiled through `compiled`."""
    return _COMPILES[0]


def load_count() -> int:
    """How many kernels this process loaded from the disk cache through `compiled`."""
    return _LOADS[0]


def cached_keys() -> list[tuple]:
    """The keys of the kernels compiled or loaded so far."""
    return list(_CACHE)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
