"""H200 experiment for issue 5 (written 2026-12-03, to run next session, ~1 min of device time):
is the routed-expert GEMM at decode limited by its scheduling (a grid over every expert x 2 token
slots x n tiles, most CTAs exiting at once) rather than by the per-CTA mainloop?

For the same active experts and rows, it times
  moe:      cutedsl.sm90.sm90_nvfp4_moe_gemm over E = 256 experts (the served path; tactic 128x16)
  grouped:  cutedsl.sm90.sm90_nvfp4_grouped_gemm over only the A active experts, each padded to
            the same row count r (a grid of exactly A x n tiles, no empty CTA), tactic 128x16x1
and prints time and GB/s of the active weight bytes. If grouped is much faster than moe, the
scheduling is the gap (a persistent grid over the active (expert, tile) items would close it);
if they tie, the mainloop / weight layout is.

    python3 bench/experiments/moe_vs_grouped.py [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import _graph_time_us, random_prepared_weight


def main() -> int:
    out = []
    e, n, k, tac = 256, 4096, 4096, (128, 16, 1)
    wp_e = random_prepared_weight(e, n, k)
    for active, r in ((150, 2), (64, 1), (150, 4)):
        counts = torch.zeros(e, dtype=torch.int64)
        counts[torch.randperm(e)[:active]] = r
        offs = torch.zeros(e + 1, dtype=torch.int32)
        offs[1:] = counts.cumsum(0).to(torch.int32)
        offs = offs.cuda()
        t = int(counts.sum())
        a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        wp_g = random_prepared_weight(active, n, k)
        ag = torch.randn(active, r, k, device="cuda", dtype=torch.bfloat16)
        yg = torch.empty(active, r, n, device="cuda", dtype=torch.bfloat16)
        wbytes = active * n * k * 0.5625
        res = {"active": active, "rows_per_expert": r}

        def moe(a=a, offs=offs, y=y):
            S.sm90_nvfp4_moe_gemm(a, offs, wp_e, out=y, tactic=tac)

        def grouped(ag=ag, wp_g=wp_g, yg=yg):
            S.sm90_nvfp4_grouped_gemm(ag, wp_g, out=yg, tactic=tac)

        res["moe_us"] = _graph_time_us([moe], 20)
        res["grouped_us"] = _graph_time_us([grouped], 20)
        for key in ("moe_us", "grouped_us"):
            res[key.replace("_us", "_GBps")] = round(wbytes / res[key] / 1e3)
            res[key] = round(res[key], 1)
        print(json.dumps(res), flush=True)
        out.append(res)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
