"""What the kernel benchmarks and table tools of `cutedsl.bench` share: their argument parser (with
an "Examples:" epilog), the GPU check, and the CUDA-graph timer."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

# The benchmarks time the sm_90a kernels (wgmma, TMA multicast), so they need a Hopper GPU.
NEEDS = "a Hopper (sm_90) CUDA GPU"


def make_parser(module: str, doc: str, examples: list[str]) -> argparse.ArgumentParser:
    """The parser of `python -m module`: description = `doc`, epilog = the examples, one a line."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        epilog="Examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def gpu_problem() -> str | None:
    """Why the benchmarks cannot run here, in one line (None when they can)."""
    if not torch.cuda.is_available():
        return f"needs {NEEDS}; torch.cuda.is_available() is False here"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs {NEEDS}; found {torch.cuda.get_device_name()} (sm_{major}{minor})"
    return None


def graph_time_us(fns: list[Callable[[], object]], reps: int) -> float:
    """Median per-call time (us) of a CUDA graph that runs fns[i % len(fns)] for i < reps: three
    warm-up calls outside the graph (compiles happen there), then 5 replays timed with CUDA
    events, each divided by `reps`."""
    for f in fns[: min(3, len(fns))]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / reps)
    del g
    return statistics.median(ts)
