"""Merge `cutedsl.bench.gemm_sm90` JSON results of one device into one table, e.g. a full run cut
by its time budget and the re-run of the rows it missed (a table tool: no GPU needed).

Rows are keyed by (shape, M). The first file's rows come first, in its order. A measured field
(times, tactic, errors) that is None in a row is taken from the first later file that has it,
and rows only later files have are appended. Derived columns (TF/s, GB/s, ratios, % copy) are
recomputed, with the first file's copy bandwidth. Each row lists in `merged_from` the files whose
fields it holds, and the header names every input, so mixed-run rows stay visible. Files from
different devices (name, or SM count where recorded) are refused.

`--rerun FILE` (repeatable) is a re-run of some rows, e.g. after a change that affects only them:
for every implementation it timed or saw fail, its fields (time, error, tactic, ...) replace the
inputs' as a whole; its other rows are appended; the header and the row order still come from the
first input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cutedsl.bench.common import make_parser
from cutedsl.bench.gemm_sm90 import finalize_row, summarize, write_outputs

EXAMPLES = [
    "python -m cutedsl.bench.merge_gemm full.json missed.json --json merged.json --md merged.md",
    "python -m cutedsl.bench.merge_gemm full.json --rerun wo_a.json --json merged.json",
]

# The measured fields of a row, per implementation: (time, error, others). A re-run that has the
# time or the error of one replaces all of them, so a time never stands beside another run's
# error or tactic. Everything else in a row is derived (`finalize_row`) or names the row.
_IMPL_FIELDS = (
    ("us", "ours_error", "tactic", "sweep_us", "best_tactic", "best_us"),
    ("cublas_us", "cublas_error", "cublas_impl"),
    ("marlin_us", "marlin_error"),
    ("deepgemm_us", "deepgemm_error", "deepgemm_quant_us", "deepgemm_rows"),
    ("copy_us", "copy_error"),
)
MEASURED = ("active_experts", *(k for fields in _IMPL_FIELDS for k in fields))


def merge(
    docs: list[tuple[str, dict]], reruns: list[tuple[str, dict]] | None = None
) -> tuple[dict, list[dict]]:
    """(name, bench JSON) pairs -> (meta, rows) of the merged table (see the module docstring);
    `reruns`: (name, bench JSON) pairs whose measured fields replace the inputs'."""
    if not docs:
        raise ValueError("nothing to merge")
    reruns = reruns or []
    devices = {d.get("device") for _, d in docs + reruns}
    sms = {d["sms"] for _, d in docs + reruns if d.get("sms") is not None}
    if len(devices) != 1 or len(sms) > 1:
        names = ", ".join(f"{n} ({d.get('device')}, {d.get('sms')} SMs)" for n, d in docs + reruns)
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
    for name, doc in reruns:
        for src in doc["rows"]:
            key = (src["shape"], src["M"])
            if key not in rows:
                rows[key] = dict(src, merged_from=[f"{name} (re-run)"])
                continue
            row = rows[key]
            took = []
            for fields in _IMPL_FIELDS:
                if src.get(fields[0]) is not None or src.get(fields[1]) is not None:
                    row.update({k: src.get(k) for k in fields})
                    took += [k for k in fields if src.get(k) is not None]
            if src.get("active_experts") is not None:  # the routing's, same in every run
                row["active_experts"] = src["active_experts"]
            if took:
                row["merged_from"].append(f"{name} (re-run, replaces): {', '.join(took)}")
    copy_bw = first.get("copy_bw_GBps")
    merged = [finalize_row(r, copy_bw) for r in rows.values()]
    inputs = [f"{n} ({d.get('date')}: `{d.get('command')}`)" for n, d in docs]
    meta = {k: v for k, v in first.items() if k not in ("rows", "summary")}
    redone = [f"{n} ({d.get('date')}: `{d.get('command')}`)" for n, d in reruns]
    meta["command"] = "python -m cutedsl.bench.merge_gemm " + " ".join(
        [n for n, _ in docs] + [f"--rerun {n}" for n, _ in reruns]
    )
    meta["merged"] = inputs + [f"re-run: {r}" for r in redone]
    meta["header"] = list(first.get("header", [])) + [
        "merged: " + "; ".join(inputs) + f"; % copy BW with {first_name}'s {copy_bw} GB/s"
    ]
    if redone:
        meta["header"].append(
            "re-run (its measured fields replace the inputs' in its rows): " + "; ".join(redone)
        )
    meta["stopped_early"] = "; ".join(
        f"{n}: {d['stopped_early']}" for n, d in docs + reruns if d.get("stopped_early")
    )
    return meta, merged


def main(argv: list[str] | None = None) -> int:
    p = make_parser("cutedsl.bench.merge_gemm", __doc__, EXAMPLES)
    p.add_argument("inputs", nargs="+", help="gemm_sm90 --json files; the first one leads")
    p.add_argument("--json", default="", metavar="PATH", help="write the merged rows and meta")
    p.add_argument("--md", default="", metavar="PATH", help="write the merged readable table")
    p.add_argument(
        "--rerun", action="append", default=[], metavar="FILE",
        help="a re-run of some rows: its measured fields replace the inputs' (repeatable)",
    )  # fmt: skip
    args = p.parse_args(argv)
    docs, reruns = [], []
    for path, into in [(p_, docs) for p_ in args.inputs] + [(p_, reruns) for p_ in args.rerun]:
        try:
            into.append((Path(path).name, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as e:
            print(f"merge_gemm: cannot read {path}: {e}", file=sys.stderr)
            return 2
    try:
        meta, rows = merge(docs, reruns)
    except ValueError as e:
        print(f"merge_gemm: {e}", file=sys.stderr)
        return 2
    write_outputs(args.json, args.md, meta, rows)
    print("summary:", json.dumps(summarize(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
