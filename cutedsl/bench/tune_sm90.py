"""Build the tuned tactic table of one GPU, `cutedsl/tuned/sm90/<device name, spaces as _>.json`
(what `cutedsl.sm90.tactics.choose_tactic` reads on that GPU), from the JSON of
`python -m cutedsl.bench.gemm_sm90 --sweep grid` runs on it (a table tool: no GPU needed).

For every (N, K, groups) and measured M, the fastest tactic timed in one run: the grid sweep's
tactics (`sweep_us`), the streaming decode kernel's configurations (`stream_sweep_us`, from
`--impls stream`; such an entry reads {"kernel": "stream", "tactic": [rows, tokens, warps,
depth(, ctas(, res))]}) and the tactic the run's default launch took (`tactic`, `us`); later files win for the
same (shape, M), and `--base` starts from an existing table. MoE shapes are skipped (routed rows
per expert are unknown on the host; their tactic stays a rule). Every sweep must come from one
device: the table's meta records its name and SM count (the sweeps' "device" and "sms";
--num-sms where a sweep does not record it), and the loader ignores the table on a GPU of that
name with another SM count. The meta also keeps the provenance
(commands, dates, devices of the sweeps) and each entry the time of the chosen tactic and of the
runner-up, so a reader can see how close a call was. One line per (shape, M) entry: readable diffs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cutedsl.bench.common import make_parser
from cutedsl.sm90.tactics import GpuSpec, Tactic, parse_tactic, tactic_entry

EXAMPLES = [
    "python -m cutedsl.bench.tune_sm90 sweep.json   # -> cutedsl/tuned/sm90/NVIDIA_H200.json "
    "on an H200's sweep",
    "python -m cutedsl.bench.tune_sm90 sweep.json sweep_m2048.json -o /tmp/table.json",
    'python -m cutedsl.bench.tune_sm90 old_sweep.json --num-sms 132   # a sweep without "sms"',
    "python -m cutedsl.bench.tune_sm90 --base cutedsl/tuned/sm90/NVIDIA_H200.json stream.json"
    "   # + a --impls ours,stream run",
]


def row_candidates(r: dict) -> dict[str, float]:
    """The configurations one bench row timed, by name ("64x16x8", "s32x8w16d2"): its grid
    sweep, its streaming-kernel sweep, and the default launch's tactic at its time."""
    times = dict(r.get("sweep_us") or {})
    times.update(r.get("stream_sweep_us") or {})
    t = r.get("tactic")
    if t and r.get("us") is not None:  # a streaming tactic is recorded by its name
        times.setdefault(t if isinstance(t, str) else str(Tactic(*t)), r["us"])
    return times


def sweep_device(sweeps: list[dict], num_sms: int | None = None) -> GpuSpec:
    """The GPU every sweep ran on (its name, and its SM count from the sweeps' "sms", else
    `num_sms`). ValueError when the sweeps disagree, a device is missing, or the SM count is
    unknown or contradicts `num_sms`."""
    names = {sw.get("device") for sw in sweeps}
    if len(names) != 1 or None in names:
        raise ValueError(
            f"the sweeps must come from one named device, got {sorted(map(str, names))}"
        )
    recorded = {sw["sms"] for sw in sweeps if sw.get("sms") is not None}
    if len(recorded) > 1:
        raise ValueError(f"the sweeps ran on GPUs of different SM counts: {sorted(recorded)}")
    if num_sms is not None and recorded and num_sms not in recorded:
        raise ValueError(f"--num-sms {num_sms}, but the sweeps record {recorded.pop()} SMs")
    if num_sms is None:
        if len(recorded) != 1 or any(sw.get("sms") is None for sw in sweeps):
            raise ValueError('a sweep does not record its SM count ("sms"): pass --num-sms')
        num_sms = recorded.pop()
    if num_sms <= 0:
        raise ValueError(f"--num-sms {num_sms}: expected > 0")
    return GpuSpec(names.pop(), num_sms)


def table_from_sweeps(sweeps: list[dict], spec: GpuSpec, base: dict | None = None) -> dict:
    """{"meta": {...}, "dense": {"N,K,G": {"M": {"tactic": [tn, tm, sk], "us": t, "next": ...}}}}
    for the GPU `spec` (`sweep_device`), over the entries and sources of `base` (a table of the
    same GPU) when given."""
    if base is not None:
        bm = base["meta"]
        if (bm.get("device"), bm.get("num_sms")) != (spec.name, spec.num_sms):
            raise ValueError(
                f"--base is a table of {bm.get('device')} ({bm.get('num_sms')} SMs), the runs "
                f"are of {spec.name} ({spec.num_sms} SMs)"
            )
    dense: dict[str, dict[str, dict]] = {
        k: dict(v) for k, v in (base["dense"] if base else {}).items()
    }
    sources = list(base["meta"].get("sources", [])) if base else []
    for sw in sweeps:
        sources.append({k: sw.get(k) for k in ("command", "date", "device", "cutlass_dsl")})
        for r in sw["rows"]:
            times = row_candidates(r)
            if r["kind"] == "moe" or len(times) < 2:
                continue
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            (best, us), (nxt, nus) = ranked[0], ranked[1]
            key = f"{r['N']},{r['K']},{r['G'] or 1}"
            dense.setdefault(key, {})[str(r["M"])] = {
                **tactic_entry(parse_tactic(best)),
                "us": us,
                "next": nxt,
                "next_us": nus,
                "shape": r["shape"],
            }
    for key in dense:  # M ascending, for readers
        dense[key] = dict(sorted(dense[key].items(), key=lambda kv: int(kv[0])))
    meta = {
        "what": "fastest measured tactic per dense / grouped shape and M: (tile_n, tile_m, split_k) "
        "of the tiled kernel from `python -m cutedsl.bench.gemm_sm90 --sweep grid`, or (rows, "
        "tokens, warps, depth(, ctas(, res))) of the streaming decode kernel (kernel 'stream') from its "
        "`--impls stream` sweep; cutedsl.sm90.tactics.choose_tactic uses the entry of the "
        "smallest measured M >= m, and its rule beyond the largest",
        "built_by": "python -m cutedsl.bench.tune_sm90",
        "device": spec.name,
        "num_sms": spec.num_sms,
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
    p = make_parser("cutedsl.bench.tune_sm90", __doc__, EXAMPLES)
    p.add_argument(
        "sweeps",
        nargs="+",
        help="JSON files of gemm_sm90 runs (--sweep grid and / or --impls stream)",
    )
    p.add_argument(
        "--base",
        default=None,
        help="a tuned table of the same GPU to start from (the runs' entries replace its own)",
    )
    p.add_argument(
        "-o",
        "--out",
        default=None,
        help="table JSON to write (default: cutedsl/tuned/sm90/<the sweeps' device>.json)",
    )
    p.add_argument(
        "--num-sms",
        type=int,
        default=None,
        help="the GPU's SM count, where a sweep does not record it",
    )
    args = p.parse_args(argv)
    sweeps = []
    for path in args.sweeps:
        try:
            with open(path) as f:
                sweeps.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            print(f"tune_sm90: cannot read {path}: {e}", file=sys.stderr)
            return 2
    base = None
    if args.base:
        try:
            with open(args.base) as f:
                base = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"tune_sm90: cannot read --base {args.base}: {e}", file=sys.stderr)
            return 2
    try:
        spec = sweep_device(sweeps, args.num_sms)
        table = table_from_sweeps(sweeps, spec, base)
    except ValueError as e:
        print(f"tune_sm90: {e}", file=sys.stderr)
        return 2
    if not table["dense"]:
        print(
            f"tune_sm90: no dense / grouped rows with a grid sweep in {args.sweeps}",
            file=sys.stderr,
        )
        return 1
    out = Path(args.out) if args.out else spec.table_file
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(format_table(table))
    os.replace(tmp, out)  # never a half-written table
    n = sum(len(v) for v in table["dense"].values())
    print(f"{out}: {spec.name} ({spec.num_sms} SMs), {len(table['dense'])} shapes, {n} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
