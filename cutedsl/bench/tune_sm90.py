"""`python -m cutedsl.bench.tune_sm90 SWEEP.json [...] -o cutedsl/tuned/sm90_h200_dense.json`

Build the measured dense / grouped tactic table of `cutedsl.sm90.choose_tactic` from the JSON of
`python -m cutedsl.bench.gemm_sm90 --sweep grid` runs: for every (N, K, groups) and measured M,
the fastest tactic timed. Later files win for the same (shape, M). The table keeps its provenance
(commands, dates, devices of the sweeps) and, per entry, the time of the chosen tactic and of the
runner-up, so a reader can see how close a call was. MoE shapes are skipped (routed rows per
expert are unknown on the host; their tactic stays a rule)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def table_from_sweeps(sweeps: list[dict]) -> dict:
    """{"meta": {...}, "dense": {"N,K,G": {"M": {"tactic": [tn, tm, sk], "us": t, "next": ...}}}}"""
    dense: dict[str, dict[str, dict]] = {}
    sources = []
    for sw in sweeps:
        sources.append({k: sw.get(k) for k in ("command", "date", "device", "cutlass_dsl")})
        for r in sw["rows"]:
            times = r.get("sweep_us") or {}
            if r["kind"] == "moe" or len(times) < 2:
                continue
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            (best, us), (nxt, nus) = ranked[0], ranked[1]
            key = f"{r['N']},{r['K']},{r['G'] or 1}"
            dense.setdefault(key, {})[str(r["M"])] = {
                "tactic": [int(x) for x in best.split("x")],
                "us": us,
                "next": nxt,
                "next_us": nus,
                "shape": r["shape"],
            }
    for key in dense:  # M ascending, for readers
        dense[key] = dict(sorted(dense[key].items(), key=lambda kv: int(kv[0])))
    meta = {
        "what": "fastest measured (tile_n, tile_m, split_k) per dense / grouped shape and M, from "
        "`python -m cutedsl.bench.gemm_sm90 --sweep grid`; cutedsl.sm90.choose_tactic uses the "
        "entry of the smallest measured M >= m, and its rule beyond the largest",
        "built_by": "python -m cutedsl.bench.tune_sm90",
        "sources": sources,
    }
    return {"meta": meta, "dense": dense}


def format_table(table: dict) -> str:
    """The table as JSON with one line per (shape, M) entry (readable diffs)."""
    lines = ['{"meta": ' + json.dumps(table["meta"], indent=1) + ",", ' "dense": {']
    shapes = list(table["dense"].items())
    for i, (key, per_m) in enumerate(shapes):
        lines.append(f"  {json.dumps(key)}: {{")
        items = list(per_m.items())
        for j, (m, e) in enumerate(items):
            lines.append(
                f"   {json.dumps(m)}: {json.dumps(e)}" + ("," if j < len(items) - 1 else "")
            )
        lines.append("  }" + ("," if i < len(shapes) - 1 else ""))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutedsl.bench.tune_sm90", description=__doc__)
    p.add_argument("sweeps", nargs="+", help="JSON files of --sweep grid runs")
    p.add_argument("-o", "--out", required=True, help="table JSON to write")
    args = p.parse_args(argv)
    sweeps = []
    for path in args.sweeps:
        with open(path) as f:
            sweeps.append(json.load(f))
    table = table_from_sweeps(sweeps)
    if not table["dense"]:
        print(f"no dense / grouped rows with a grid sweep in {args.sweeps}", file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(format_table(table))
    os.replace(tmp, args.out)  # never a half-written table
    n = sum(len(v) for v in table["dense"].values())
    print(f"{args.out}: {len(table['dense'])} shapes, {n} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
