"""Merge `cutedsl.bench.gemm_sm90` JSON results of one device into one table, e.g. a full run cut
by its time budget and the re-run of the rows it missed.

    python -m cutedsl.bench.merge_gemm FIRST.json MORE.json ... --json OUT.json --md OUT.md

Rows are keyed by (shape, M). The first file's rows come first, in its order. A measured field
(times, tactic, errors) that is None in a row is taken from the first later file that has it,
and rows only later files have are appended. Derived columns (TF/s, GB/s, ratios, % copy) are
recomputed, with the first file's copy bandwidth. Each row lists in `merged_from` the files whose
fields it holds, and the header names every input, so mixed-run rows stay visible. Files from
different devices are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cutedsl.bench.gemm_sm90 import finalize_row, summarize, write_outputs

MEASURED = (
    "tactic active_experts us copy_us cublas_us cublas_impl marlin_us deepgemm_us "
    "deepgemm_quant_us deepgemm_rows ours_error cublas_error marlin_error deepgemm_error "
    "copy_error sweep_us best_tactic best_us"
).split()


def merge(docs: list[tuple[str, dict]]) -> tuple[dict, list[dict]]:
    """(name, bench JSON) pairs -> (meta, rows) of the merged table (see the module docstring)."""
    if not docs:
        raise ValueError("nothing to merge")
    devices = {d.get("device") for _, d in docs}
    if len(devices) != 1:
        names = ", ".join(f"{n} ({d.get('device')})" for n, d in docs)
        raise ValueError(f"results from different devices: {names}")
    first_name, first = docs[0]
    rows: dict[tuple[str, int], dict] = {}
    for name, doc in docs:
        for src in doc["rows"]:
            key = (src["shape"], src["M"])
            if key not in rows:
                row = dict(src)
                row["merged_from"] = [name]
                rows[key] = row
                continue
            row = rows[key]
            took = [k for k in MEASURED if row.get(k) is None and src.get(k) is not None]
            for k in took:
                row[k] = src[k]
            if took:
                row["merged_from"].append(f"{name}: {', '.join(took)}")
    copy_bw = first.get("copy_bw_GBps")
    merged = [finalize_row(r, copy_bw) for r in rows.values()]
    inputs = [f"{n} ({d.get('date')}: `{d.get('command')}`)" for n, d in docs]
    meta = {k: v for k, v in first.items() if k not in ("rows", "summary")}
    meta["command"] = "python -m cutedsl.bench.merge_gemm " + " ".join(n for n, _ in docs)
    meta["merged"] = inputs
    meta["header"] = list(first.get("header", [])) + [
        "merged: " + "; ".join(inputs) + f"; % copy BW with {first_name}'s {copy_bw} GB/s"
    ]
    meta["stopped_early"] = "; ".join(
        f"{n}: {d['stopped_early']}" for n, d in docs if d.get("stopped_early")
    )
    return meta, merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutedsl.bench.merge_gemm", description=__doc__)
    p.add_argument("inputs", nargs="+", help="gemm_sm90 --json files; the first one leads")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="")
    args = p.parse_args(argv)
    docs = []
    for path in args.inputs:
        try:
            docs.append((Path(path).name, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as e:
            print(f"merge_gemm: cannot read {path}: {e}", file=sys.stderr)
            return 2
    try:
        meta, rows = merge(docs)
    except ValueError as e:
        print(f"merge_gemm: {e}", file=sys.stderr)
        return 2
    write_outputs(args.json, args.md, meta, rows)
    print("summary:", json.dumps(summarize(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
