"""H200 A/B of two versions of the sm90 GEMM kernel module on the Flash shapes: the current
`cutedsl/kernels/gemm_sm90.py` against a baseline copy of it (any earlier commit), each with the
tactic the runner picks (`launch_tactic`), dense / grouped shapes over rotated weight copies and
the routed experts over the bench's routings (`_routings`), timed like the bench (CUDA graph).
Each case alternates the two kernels in rounds, median per kernel; outputs must be bit-identical
and fully written (outputs start as NaN).

    git show REV:cutedsl/kernels/gemm_sm90.py > bench/experiments/_baseline_gemm_sm90.py
    python3 bench/experiments/ab_kernel.py bench/experiments/_baseline_gemm_sm90.py [OUT.json]
"""

from __future__ import annotations

import functools
import importlib.util
import json
import statistics
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import (
    SHAPES,
    _copies,
    _graph_time_us,
    _routings,
    expert_offsets,
    random_prepared_weight,
    weight_bytes,
)
from cutedsl.kernels.gemm_sm90 import compile_kernel

DENSE_MS = (1, 16, 32, 128, 4096)
MOE_MS = (1, 4, 16, 32, 256, 4096)
ROUNDS = 3


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_gemm_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return functools.cache(mod.compile_kernel)


def compare(kernels: dict, ops: list[tuple], y: torch.Tensor, reps: int) -> dict:
    calls = {v: [functools.partial(fn, *o) for o in ops] for v, fn in kernels.items()}
    outs, times = {}, {v: [] for v in kernels}
    for v, cs in calls.items():
        y.fill_(float("nan"))
        cs[0]()
        torch.cuda.synchronize()
        outs[v] = y.clone()
    for _ in range(ROUNDS):
        for v, cs in calls.items():
            times[v].append(_graph_time_us(cs, reps))
    med = {v: statistics.median(ts) for v, ts in times.items()}
    return {
        "equal": bool(torch.equal(outs["baseline"], outs["current"])),
        "nan": any(bool(o.isnan().any()) for o in outs.values()),
        "us": {v: round(x, 2) for v, x in med.items()},
        "speedup": round(med["baseline"] / med["current"], 3),
        "rounds": {v: [round(x, 2) for x in ts] for v, ts in times.items()},
    }


def main() -> int:
    baseline = load_baseline(sys.argv[1])
    current = functools.cache(compile_kernel)
    rows = []
    for shape in SHAPES["flash"]:
        n, k, g = shape.n, shape.k, shape.groups
        moe = shape.kind == "moe"
        wps = [random_prepared_weight(g, n, k)]
        if not moe:
            wps += [
                random_prepared_weight(g, n, k) for _ in range(_copies(weight_bytes(g, n, k)) - 1)
            ]
        for m in MOE_MS if moe else DENSE_MS:
            t = shape.rows(m)
            la = g if shape.kind == "grouped" else 1
            a = torch.randn(la, t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(la, t, n, device="cuda", dtype=torch.bfloat16)
            if moe:
                counts = _routings(shape, m)
                ops = [S.kernel_operands(a, wps[0], y, expert_offsets(c).cuda()) for c in counts]
            else:
                ops = [S.kernel_operands(a, w, y) for w in wps]
            tac = S.launch_tactic(t, n, k, g, moe)
            r = {"shape": shape.name, "M": m, "tactic": list(tac)}
            r.update(compare({"baseline": baseline(*tac, moe), "current": current(*tac, moe)},
                             ops, y, 20 if m >= 1024 else 50))  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
        del wps
        torch.cuda.empty_cache()
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
