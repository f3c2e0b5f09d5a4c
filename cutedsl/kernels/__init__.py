"""CuTeDSL kernels. Importing this package does not import `cutlass`; each kernel module does."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

_COMPILED: dict[Hashable, object] = {}
_LOCK = threading.Lock()


def compile_once(key: Hashable, build: Callable[[], object]) -> object:
    """The kernel `build()` compiles, once per process and key (the key holds compile-time values
    only). Runners warm up from several threads: the first caller compiles under a lock, the
    others wait for it; a hit takes no lock."""
    fn = _COMPILED.get(key)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                fn = _COMPILED[key] = build()
    return fn
