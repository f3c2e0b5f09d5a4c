"""H200 experiment for issue 5 (decode): how much of a decode GEMM's time is a fixed cost (launch,
pipeline fill, epilogue, tail) and how much streams weights? For N in the Flash dense widths and
K from 256 to 8192, M = 16, times the sm90 GEMM with one unsplit tactic per N (so every point is
the same kernel; the served tactic, which changes with K, is timed too but not fitted) and the
same-bytes elementwise copy (the bench's `copy_time_us`: read + write = the weight + scale bytes),
both as the bench times them (CUDA graph over rotated buffers, > 3x L2). A least-squares line
t = a + bytes / b per (N, kernel) gives the fixed cost a (us) and the streaming rate b (GB/s): a
GEMM whose b is near the copy's but whose a is larger loses its decode time to latency, not to
bandwidth.

    python3 bench/experiments/decode_anatomy.py [OUT.json]
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import (
    _copies,
    _graph_time_us,
    copy_time_us,
    random_prepared_weight,
    weight_bytes,
)

NS = {1536: (64, 16, 1), 4096: (64, 16, 1), 32768: (128, 16, 1)}  # N: the fitted tactic
KS = (256, 512, 1024, 2048, 4096, 8192)
M = 16


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares t = a + x / b over (bytes, us) points: a in us, b in GB/s."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx  # us per byte
    a = my - slope * mx
    return {
        "fixed_us": round(a, 2),
        "stream_GBps": round(1 / slope / 1e3, 0) if slope > 0 else None,
    }


def main() -> int:
    rows = []
    for n, fixed in NS.items():
        pts: dict[str, list[tuple[float, float]]] = {"gemm": [], "copy": []}
        for k in KS:
            wb = weight_bytes(1, n, k)
            wps = [random_prepared_weight(1, n, k) for _ in range(_copies(wb))]
            a = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
            tac = S.launch_tactic(M, n, k, 1, False)
            gemm = [functools.partial(S.sm90_nvfp4_gemm_prepared, a, wp, out=y, tactic=fixed)
                    for wp in wps]  # fmt: skip
            served = [functools.partial(S.sm90_nvfp4_gemm_prepared, a, wp, out=y) for wp in wps]
            r = {"N": n, "K": k, "M": M, "tactic": list(fixed), "bytes": wb,
                 "gemm_us": round(_graph_time_us(gemm, 100), 2),
                 "served_tactic": list(tac), "served_us": round(_graph_time_us(served, 100), 2),
                 "copy_us": round(copy_time_us(wb), 2)}  # fmt: skip
            pts["gemm"].append((wb, r["gemm_us"]))
            pts["copy"].append((wb, r["copy_us"]))
            print(json.dumps(r), flush=True)
            rows.append(r)
            del wps
            torch.cuda.empty_cache()
        for kind, p in pts.items():
            r = {"N": n, "fit": kind, **fit(p)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
