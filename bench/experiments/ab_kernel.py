"""H200 A/B of versions of the sm90 GEMM kernel module on the Flash shapes: the current
`cutedsl/kernels/gemm_sm90.py` against one or more copies of it (earlier commits or variants),
each with the tactic the runner picks (`launch_tactic`), dense / grouped shapes over rotated
weight copies and the routed experts over the bench's routings (`_routings`), timed like the
bench (CUDA graph). Each case alternates the kernels in rounds, median per kernel. Each
kernel's output on the first operand set is compared with the first baseline's bit for bit
(`equal`), and the run records whether any NaN was left (outputs start as NaN).

    git show REV:cutedsl/kernels/gemm_sm90.py > bench/experiments/_baseline_gemm_sm90.py
    python3 bench/experiments/ab_kernel.py bench/experiments/_baseline_gemm_sm90.py [MORE.py ...]
        [--out OUT.json] [--shapes wq_b,...] [--dense-ms 1,16,...] [--moe-ms 1,16,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.ab import alternating_rounds, load_compile_kernel
from cutedsl.bench.gemm_sm90 import (
    SHAPES,
    _copies,
    _routings,
    expert_offsets,
    random_prepared_weight,
    weight_bytes,
)
from cutedsl.kernels.gemm_sm90 import compile_kernel

DENSE_MS = (1, 16, 32, 128, 4096)
MOE_MS = (1, 4, 16, 32, 256, 4096)
ROUNDS = 3


def compare(kernels: dict, ops: list[tuple], y: torch.Tensor, reps: int) -> dict:
    calls = {v: [functools.partial(fn, *o) for o in ops] for v, fn in kernels.items()}
    outs, med, times = alternating_rounds(calls, y, reps, ROUNDS)
    first = next(iter(kernels))
    return {
        "equal": {v: bool(torch.equal(outs[first], o)) for v, o in outs.items()},
        "nan": any(bool(o.isnan().any()) for o in outs.values()),
        "us": {v: round(x, 2) for v, x in med.items()},
        "speedup": {v: round(med[first] / x, 3) for v, x in med.items()},
        "rounds": {v: [round(x, 2) for x in ts] for v, ts in times.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("baselines", nargs="+", help="kernel module copies; the first is the reference")
    p.add_argument("--out", default="")
    p.add_argument("--shapes", default="", help="comma list of Flash shape names (default: all)")
    p.add_argument("--dense-ms", default=",".join(map(str, DENSE_MS)))
    p.add_argument("--moe-ms", default=",".join(map(str, MOE_MS)))
    args = p.parse_args()
    kernels = {pathlib.Path(b).stem.strip("_"): load_compile_kernel(b) for b in args.baselines}
    kernels["current"] = functools.cache(compile_kernel)
    dense_ms = [int(x) for x in args.dense_ms.split(",") if x]
    moe_ms = [int(x) for x in args.moe_ms.split(",") if x]
    keep = set(filter(None, args.shapes.split(",")))
    rows = []
    for shape in (s for s in SHAPES["flash"] if not keep or s.name in keep):
        n, k, g = shape.n, shape.k, shape.groups
        moe = shape.kind == "moe"
        wps = [random_prepared_weight(g, n, k)]
        if not moe:
            wps += [
                random_prepared_weight(g, n, k) for _ in range(_copies(weight_bytes(g, n, k)) - 1)
            ]
        for m in moe_ms if moe else dense_ms:
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
            fns = {v: compile_fn(*tac, moe) for v, compile_fn in kernels.items()}
            r.update(compare(fns, ops, y, 20 if m >= 1024 else 50))
            print(json.dumps(r), flush=True)
            rows.append(r)
        del wps
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
