"""H200 experiment for issue 5: the pipeline depth of the sm90 W4A16 GEMM. The kernel fills shared
memory with stages (up to 8); `prefill_epi.py` found 128x256 with 4 stages faster than with 6.
This times each unsplit tile at stages 2..8 (those that fit) on the Flash dense shapes at the M
where the tuned table uses that tile; outputs must be bit-identical across stage counts.

    python3 bench/experiments/stages.py [OUT.json]
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from bench.experiments.prefill_epi import compiled
from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import (
    _copies,
    _graph_time_us,
    _reps,
    dense_shapes,
    random_prepared_weight,
    weight_bytes,
)
from cutedsl.kernels import gemm_sm90 as G

SHAPES = dense_shapes("flash")  # name: (groups, N, K)
CASES = [  # (tile_n, tile_m), shapes, Ms
    ((128, 256), list(SHAPES), (1024, 4096)),
    ((64, 256), ["wo_b", "shared_w13", "fused_wqa_wkv"], (256, 4096)),
    ((128, 128), ["wq_b", "wo_a(G=8)", "shared_w13"], (128, 1024)),
    ((128, 64), ["wq_b", "wo_b", "shared_w2"], (64,)),
    ((128, 16), ["wq_b", "wo_b"], (16,)),
    ((64, 16), ["fused_wqa_wkv", "shared_w13"], (16,)),
]


def main() -> int:
    rows = []
    for (tn, tm), names, ms in CASES:
        default = G.Sm90Nvfp4W4A16GemmKernel._compute_stages(tn, tm)
        for name in names:
            g, n, k = SHAPES[name]
            wps = [random_prepared_weight(g, n, k) for _ in range(_copies(weight_bytes(g, n, k)))]
            for m in ms:
                a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * g * m * n * k
                ref = None
                for st in range(2, default + 1):
                    try:
                        fn = compiled(tn, tm, 1, st, None)
                    except ValueError:
                        continue
                    y = torch.full((g, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    fns = [functools.partial(fn, *S.kernel_operands(a, wp, y)) for wp in wps]
                    fns[0]()
                    torch.cuda.synchronize()
                    same = True if ref is None else bool(torch.equal(ref, y))
                    ref = y.clone() if ref is None else ref
                    us = _graph_time_us(fns, _reps(flops))
                    r = {"shape": name, "M": m, "tile": [tn, tm], "stages": st,
                         "default": st == default, "us": round(us, 2), "equal": same,
                         "nan": bool(y.isnan().any())}  # fmt: skip
                    print(json.dumps(r), flush=True)
                    rows.append(r)
            del wps
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
