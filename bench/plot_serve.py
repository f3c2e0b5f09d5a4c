#!/usr/bin/env python3
"""One table (and a plot) from bench/serve_bench.py result files.

    python bench/plot_serve.py OURS.json BASE.json [...] --md OUT.md [--png OUT.png]
        [--json OUT.json] [--baseline LABEL]

Markdown: one row per (shape, concurrency) (the effective shape, after fitting), and per label the
output tokens/s, median TTFT ms and median TPOT ms, then one ratio column per non-baseline label:
its output tokens/s over the baseline's. The first file's label is "ours"; the baseline is
--baseline LABEL, else the first other label. A cell is "—" when that label has no such run, or
the run's status ("skipped", "failed", "timeout") when it did not finish ok. Below the table:
each file's label, date, device, vLLM version, command, and the runs that were not ok.

JSON (--json): command, baseline, labels, sources (the files' headers), and rows: one per
(shape, concurrency) with per label {status, output_throughput, median_ttft_ms, median_tpot_ms,
median_itl_ms, num_prompts} (null where that label has no run) and ratio {label: output tokens/s
over the baseline's} (null unless both ran ok).

PNG (needs matplotlib, imported only for --png; exit 2 with a message when it is missing): one
column per shape; top row output tokens/s vs concurrency, bottom row median TPOT ms vs
concurrency, log2 x-axis, one line per label. Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

_COLS = (("output_throughput", "out tok/s", "{:.1f}"), ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
         ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"))  # fmt: skip


def load(paths: list[str]) -> tuple[list[dict], list[str], dict]:
    """-> (headers, labels in first-seen order, {(label, shape, concurrency): record})."""
    headers, labels, runs = [], [], {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        headers.append({**doc.get("header", {}), "file": p})
        for r in doc.get("runs", []):
            if r["label"] not in labels:
                labels.append(r["label"])
            runs[(r["label"], r["shape"], int(r["concurrency"]))] = r
        lab = doc.get("header", {}).get("label")
        if lab and lab not in labels:
            labels.append(lab)
    return headers, labels, runs


def _shape_key(shape: str) -> tuple[int, int]:
    a, b = shape.split("x")
    return int(a), int(b)


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "?")
    v = r.get(key)
    return "—" if v is None else fmt.format(v)


def rows(labels: list[str], runs: dict, baseline: str) -> list[dict]:
    """The table as data: one row per (shape, concurrency)."""
    keys = sorted({(s, c) for _, s, c in runs}, key=lambda k: (_shape_key(k[0]), k[1]))
    fields = ("status", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
              "num_prompts")  # fmt: skip
    out = []
    for shape, conc in keys:
        row = {"shape": shape, "concurrency": conc, "ratio": {}}
        for lab in labels:
            r = runs.get((lab, shape, conc))
            row[lab] = None if r is None else {f: r.get(f) for f in fields}
        b = runs.get((baseline, shape, conc))
        for lab in labels:
            if lab == baseline:
                continue
            r = runs.get((lab, shape, conc))
            ok = r and b and r.get("status") == b.get("status") == "ok"
            ok = ok and r.get("output_throughput") and b.get("output_throughput")
            row["ratio"][lab] = (
                round(r["output_throughput"] / b["output_throughput"], 4) if ok else None
            )
        out.append(row)
    return out


def markdown(headers: list[dict], labels: list[str], runs: dict, baseline: str) -> str:
    """The table plus provenance, as markdown text."""
    others = [lab for lab in labels if lab != baseline]
    keys = sorted({(s, c) for _, s, c in runs}, key=lambda k: (_shape_key(k[0]), k[1]))
    cols = ["shape", "conc"] + [f"{lab} {name}" for lab in labels for _, name, _ in _COLS]
    cols += [f"{lab}/{baseline} out tok/s" for lab in others]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for shape, conc in keys:
        row = [shape, str(conc)]
        for lab in labels:
            r = runs.get((lab, shape, conc))
            row += [_cell(r, k, f) for k, _, f in _COLS]
        b = runs.get((baseline, shape, conc))
        for lab in others:
            r = runs.get((lab, shape, conc))
            ok = r and b and r.get("status") == b.get("status") == "ok"
            ok = ok and r.get("output_throughput") and b.get("output_throughput")
            row.append(f"{r['output_throughput'] / b['output_throughput']:.2f}" if ok else "—")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Ratio: output tokens/s over {baseline}'s. TTFT/TPOT: medians over the "
              "run's requests (vllm bench serve, random dataset, --ignore-eos).", ""]  # fmt: skip
    req = sorted({(r.get("requested_shape"), r["shape"]) for r in runs.values()})
    fitted = [f"{a} -> {b}" for a, b in req if a and a != b]
    if fitted:
        lines += ["Shapes scaled to fit max_model_len: " + ", ".join(fitted) + ".", ""]
    lines.append("Sources:")
    for h in headers:
        lines.append(
            f"- `{h['file']}`: label {h.get('label')}, date {h.get('date')}, device "
            f"{h.get('device')}, vLLM {h.get('vllm_version')}, max_model_len "
            f"{h.get('max_model_len')}; command: `{h.get('command')}`"
        )
    bad = [r for r in runs.values() if r.get("status") != "ok"]
    if bad:
        lines += ["", "Runs not ok:"]
        for r in bad:
            err = (r.get("error") or "").strip().splitlines()
            lines.append(f"- {r['label']} {r['shape']} c={r['concurrency']}: {r.get('status')}"
                         + (f" ({err[-1][:200]})" if err else ""))  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(labels: list[str], runs: dict, png: str) -> None:
    """Write the PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({s for _, s, _ in runs}, key=_shape_key)
    fig, axes = plt.subplots(2, len(shapes), figsize=(5.5 * len(shapes), 8), squeeze=False)
    for j, shape in enumerate(shapes):
        for row, (key, ylab) in enumerate(
            (("output_throughput", "output tokens/s"), ("median_tpot_ms", "median TPOT (ms)"))
        ):
            ax = axes[row][j]
            ymax = 0.0
            for lab in labels:
                pts = sorted((c, r[key]) for (la, s, c), r in runs.items()
                             if la == lab and s == shape and r.get("status") == "ok"
                             and r.get(key) is not None)  # fmt: skip
                if pts:
                    ymax = max(ymax, *(p[1] for p in pts))
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
            ax.set_xscale("log", base=2)
            concs = sorted({c for (la, s, c) in runs if s == shape})
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.set_ylim(0, ymax * 1.1 or 1.0)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylab)
            ax.set_title(f"{shape} (in x out): {ylab}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="serve_bench.py result JSONs (first = ours)")
    ap.add_argument("--md", default=None, help="markdown table to write")
    ap.add_argument("--png", default=None, help="plot to write (needs matplotlib)")
    ap.add_argument("--json", default=None, help="the table as JSON")
    ap.add_argument("--baseline", default=None, help="label the ratios divide by")
    a = ap.parse_args(argv)
    if not a.md and not a.png and not a.json:
        print("plot_serve: give --md, --png and/or --json", file=sys.stderr)
        return 2
    if a.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "plot_serve: --png needs matplotlib, which is not installed in "
                f"{sys.executable}; use --md alone or install matplotlib",
                file=sys.stderr,
            )
            return 2
    try:
        headers, labels, runs = load(a.files)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_serve: cannot read results: {e!r}", file=sys.stderr)
        return 2
    if a.baseline is not None and a.baseline not in labels:
        print(f"plot_serve: --baseline {a.baseline!r} not among labels {labels}", file=sys.stderr)
        return 2
    baseline = a.baseline or (labels[1] if len(labels) > 1 else labels[0] if labels else "")
    command = shlex.join(["python", "bench/plot_serve.py", *(argv or sys.argv[1:])])
    if a.json:
        doc = {"command": command, "baseline": baseline, "labels": labels, "sources": headers,
               "rows": rows(labels, runs, baseline)}  # fmt: skip
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.md:
        text = markdown(headers, labels, runs, baseline)
        text += f"\nTable: `{command}`\n"
        Path(a.md).write_text(text)
        print(text)
    if a.png:
        plot(labels, runs, a.png)
        print(f"plot_serve: wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
