"""A/B helpers for the kernel experiments (bench/experiments/): one way to load a copy of the sm90
kernel module and one way to time variants against each other."""

from __future__ import annotations

import functools
import importlib.util
import statistics
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from cutedsl.bench.gemm_sm90 import _graph_time_us


def load_compile_kernel(path: str) -> Callable:
    """`compile_kernel` (cached per configuration) of a copy of cutedsl/kernels/gemm_sm90.py at
    `path`, e.g. `git show REV:cutedsl/kernels/gemm_sm90.py > copy.py`. The copy imports today's
    `cutedsl.kernels.device_utils`, so it must build against it."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return functools.cache(mod.compile_kernel)


def alternating_rounds(
    calls: dict[Hashable, list[Callable[[], object]]],
    out: torch.Tensor,
    reps: int,
    rounds: int = 3,
) -> tuple[dict, dict, dict]:
    """Time variants that all write `out`, each a list of calls (rotated operands).

    Each variant's first call runs once on a NaN-filled `out`, whose copy is its output. Then
    `rounds` rounds time every variant in turn with the bench's CUDA-graph timer, so drift
    between runs is shared. Returns (outputs, median us, per-round us), each keyed like
    `calls`."""
    outs = {}
    for v, cs in calls.items():
        out.fill_(float("nan"))
        cs[0]()
        torch.cuda.synchronize()
        outs[v] = out.clone()
    times: dict = {v: [] for v in calls}
    for _ in range(rounds):
        for v, cs in calls.items():
            times[v].append(_graph_time_us(cs, reps))
    return outs, {v: statistics.median(ts) for v, ts in times.items()}, times
