"""H200 experiment for issue 5 (routed decode): the MoE kernel's compacted tile schedule (grid.y =
the m tiles of all experts, found in-kernel by a scan of the offsets) against the schedule it
replaces (grid.y x E CTAs, one row of CTAs per expert, empty experts exiting at once), and at
decode the 64-row weight tile against the 128-row one. Flash routed w13 / w2 (E = 256, top-6),
the bench's routings (`_routings`: rotated until the touched weights exceed 3x L2) and timing
(CUDA graph). Each case alternates the variants in rounds, median per variant; every output is
checked bit-identical to the baseline's and fully written (outputs start as NaN).

    git show a1ab6ce:cutedsl/kernels/gemm_sm90.py > bench/experiments/_baseline_gemm_sm90.py
    python3 bench/experiments/moe_schedule.py bench/experiments/_baseline_gemm_sm90.py [OUT.json]
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.ab import alternating_rounds, load_compile_kernel
from cutedsl.bench.gemm_sm90 import (
    SHAPES,
    _routings,
    expert_offsets,
    random_prepared_weight,
    weight_bytes,
)
from cutedsl.kernels.gemm_sm90 import compile_kernel

MS = (1, 4, 16, 32, 64, 256, 1024, 4096)
ROUNDS = 3


def main() -> int:
    baseline = load_compile_kernel(sys.argv[1])
    current = functools.cache(compile_kernel)
    rows = []
    for shape in (s for s in SHAPES["flash"] if s.kind == "moe"):
        n, k, e, topk = shape.n, shape.k, shape.groups, shape.topk
        wp = random_prepared_weight(e, n, k)
        for m in MS:
            t = m * topk
            counts = _routings(shape, m)
            offs = [expert_offsets(c).cuda() for c in counts]
            a = torch.randn(1, t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(1, t, n, device="cuda", dtype=torch.bfloat16)
            ops = [S.kernel_operands(a, wp, y, o) for o in offs]
            tn, tm, _ = S.launch_tactic(t, n, k, e, True)
            variants = {
                "baseline": baseline(tn, tm, 1, True),
                "compact": current(tn, tm, 1, True),
            }
            if m <= 32:
                variants[f"compact_n{192 - tn}"] = current(192 - tn, tm, 1, True)
            calls = {v: [functools.partial(fn, *o) for o in ops] for v, fn in variants.items()}
            outs, med, times = alternating_rounds(calls, y, 20 if m >= 1024 else 50, ROUNDS)
            active = sum(int((c > 0).sum()) for c in counts) / len(counts)
            wbytes = active * weight_bytes(1, n, k)
            r = {
                "shape": shape.name,
                "M": m,
                "rows": t,
                "tactic": [tn, tm, 1],
                "active_experts": round(active, 1),
                "equal": {v: bool(torch.equal(outs[v], outs["baseline"])) for v in variants},
                "nan": {v: bool(outs[v].isnan().any()) for v in variants},
                "us": {v: round(x, 2) for v, x in med.items()},
                "weight_GBps": {v: round(wbytes / x / 1e3) for v, x in med.items()},
                "speedup_vs_baseline": {v: round(med["baseline"] / x, 3) for v, x in med.items()},
                "rounds": {v: [round(x, 2) for x in ts] for v, ts in times.items()},
            }
            print(json.dumps(r), flush=True)
            rows.append(r)
        del wp
        torch.cuda.empty_cache()
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
