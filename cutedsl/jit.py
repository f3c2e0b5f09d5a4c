"""The one compile cache of every CuTeDSL kernel in `cutedsl`.

`compiled(build, *args, **kwargs)` returns `build(*args, **kwargs)` (a `cute.compile` result),
computed once per process and key. The key is

    (build's module and qualified name, args, sorted kwargs, target arch, nvidia-cutlass-dsl version)

so it holds exactly the arguments the kernel is built from: a build function is a pure function of
its arguments (its defaults are constants of its source), and every codegen argument a caller can
change is one of them. Runtime values (extents, strides, pointers, routing, the stream) are never
build arguments: kernels take them as symbolic or dynamic operands, so one compile serves every M.

The target arch is `$CUTE_DSL_ARCH` when set (compiling without a GPU), else the current CUDA
device's `sm_XYa`, else "none".

Rules:
- Thread-safe: the first caller of a key compiles under a lock, concurrent callers of that key wait
  for it; a hit takes no lock (runners warm up from several threads).
- Never during CUDA-graph capture: a miss while the current stream captures raises
  `CompileDuringCaptureError` (compile in `warmup()` before capture; a compile inside a captured
  region would stall every replay's first call, and a first launch loads the cubin).
- `compile_count()` counts the compiles of this process, so tests assert none after warm-up.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Hashable

import torch

_CACHE: dict[Hashable, object] = {}
_LOCK = threading.Lock()
_COMPILES = [0]


class CompileDuringCaptureError(RuntimeError):
    """A kernel was first needed while a CUDA graph was being captured."""


@functools.cache
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version ("none" without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return "none"


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
    """The key `compiled(build, *args, **kwargs)` caches under."""
    return (
        build.__module__,
        build.__qualname__,
        args,
        tuple(sorted(kwargs.items())),
        target_arch(),
        dsl_version(),
    )


def compiled(build: Callable[..., object], *args: Hashable, **kwargs: Hashable) -> object:
    """`build(*args, **kwargs)`, once per process and `cache_key`."""
    key = cache_key(build, *args, **kwargs)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    if _cuda_available() and torch.cuda.is_current_stream_capturing():
        raise CompileDuringCaptureError(
            f"{build.__module__}.{build.__qualname__}{args}{kwargs or ''}: not compiled before "
            "CUDA-graph capture; call the runner's warmup(max_tokens) first"
        )
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = build(*args, **kwargs)
            _CACHE[key] = fn
            _COMPILES[0] += 1
    return fn


def compile_count() -> int:
    """How many kernels this process compiled through `compiled`."""
    return _COMPILES[0]


def cached_keys() -> list[tuple]:
    """The keys of the kernels compiled so far."""
    return list(_CACHE)
