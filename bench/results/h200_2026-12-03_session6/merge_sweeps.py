"""The sweep behind this session's tactic table (one-off, 2026-12-03).

The grid sweep of call 1 (`sweep_combined.json`) ran the split-K staged store for every split
tactic whose token slice allowed it. The experiment of call 4 (`staged_split_moe.json`) then showed
it loses with 4 or 8 splits, so the kernel keeps register stores there, as in session 5. This
script writes `sweep.json`: the session-6 sweep, with the times of tactics that session 6 ran
staged but the kernel now runs from registers (split_k >= 4) taken from session 5's sweep (same
code for those tactics), and dropped where session 5 did not time them. Every other time is
session 6's, from `wip/combined` with PDL off (the final code for those tactics).

    PYTHONPATH=. python3 bench/results/h200_2026-12-03_session6/merge_sweeps.py
    python3 -m cutedsl.bench.tune_sm90 bench/results/h200_2026-12-03_session4/sweep.json \
        bench/results/h200_2026-12-03_session5/sweep.json \
        bench/results/h200_2026-12-03_session6/sweep.json -o cutedsl/tuned/sm90_h200_dense.json
"""

from __future__ import annotations

import json
from pathlib import Path

from cutedsl.kernels.gemm_sm90 import Sm90Nvfp4W4A16GemmKernel as Kern

HERE = Path(__file__).parent


def ran_staged_in_session6(tn: int, tm: int, sk: int) -> bool:
    """Session 6's sweep took the staged store wherever the kernel allows it."""
    try:
        Kern(tile_n=tn, tile_m=tm, split_k=sk, staged_epilogue=True)
    except ValueError:
        return False
    return True


def main() -> None:
    s6 = json.loads((HERE / "sweep_combined.json").read_text())
    s5 = json.loads((HERE.parent / "h200_2026-12-03_session5" / "sweep.json").read_text())
    old = {(r["shape"], r["M"]): r.get("sweep_us") or {} for r in s5["rows"]}
    changed = 0
    for r in s6["rows"]:
        times = r.get("sweep_us") or {}
        for tac in list(times):
            tn, tm, sk = (int(x) for x in tac.split("x"))
            if sk >= 4 and ran_staged_in_session6(tn, tm, sk):
                prev = old.get((r["shape"], r["M"]), {}).get(tac)
                if prev is None:
                    del times[tac]
                else:
                    times[tac] = prev
                changed += 1
    s6["merged"] = (
        "session-6 sweep (sweep_combined.json); split_k >= 4 tactics that it ran with the staged "
        "store: session-5 times (register stores, as the kernel now runs them), see merge_sweeps.py"
    )
    (HERE / "sweep.json").write_text(json.dumps(s6, indent=1))
    print(f"{changed} tactic times replaced or dropped")


if __name__ == "__main__":
    main()
