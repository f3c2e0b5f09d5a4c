#!/usr/bin/env python3
"""One markdown table from bench/upstream_baseline.py result JSONs (vLLM vs the golden reference).

    python bench/e2e_table.py bench/results/h200/e2e_*.json
        [--golden auto|golden|golden_swa_yarn|golden_w4a4] [--min-cos 0.99] [--json OUT]

Rows: checkpoint format (and the cutedsl backend, when the run named one) x mode x prompt, each
against one reference (column "reference"): --golden auto (the default) takes the W4A4 golden
where the run has one (an sm100 backend: NVFP4 activations, `golden.load_model(act_quant=
"nvfp4")`) and the golden otherwise; any other choice takes that reference for every run.
Columns: prefill cosine (min, mean) and greedy agreement, first generated token, decode steps (min
cosine, agreement). A last column says whether every position meets --min-cos. A run that named a
backend ($CUTEDSL_BACKEND) fails unless every cutedsl runner of the model ran on it. Exit 1 if a
mode failed to run or a row misses the bound. --json OUT also writes the rows, each run's
provenance (command, date, device, versions, checkpoint, runners) and the verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _label(d: dict, path: str) -> str:
    fmt = d.get("format") or d.get("checkpoint", {}).get("path", path)
    return f"{fmt} / {d['backend']}" if d.get("backend") else fmt


def _wrong_runners(backend: str | None, runners: dict | None) -> str | None:
    """Why a mode's cutedsl runners do not show that `backend` ran, or None."""
    if not backend:
        return None
    if not runners:
        return f"no cutedsl runner recorded for backend {backend}"
    other = sorted(n for n in runners if n.rsplit(":", 1)[-1] != backend)
    return f"runners not on {backend}: {', '.join(other)}" if other else None


def rows(path: str, golden: str) -> list[dict]:
    d = json.load(open(path))
    fmt = _label(d, path)
    out = []
    for mode, r in d.get("modes", {}).items():
        wrong = _wrong_runners(d.get("backend"), r.get("cutedsl_runners")) if r.get("ok") else None
        if not r.get("ok") or wrong:
            error = wrong or r.get("error", "did not finish")
            out.append({"format": fmt, "mode": mode, "error": error})
            continue
        for v in r.get("vs_golden", []):
            ref = golden
            if golden == "auto":
                ref = "golden_w4a4" if "golden_w4a4" in v else "golden"
            if ref not in v:
                out.append({"format": fmt, "mode": mode, "error": f"no {ref} in {path}"})
                break
            g = v[ref]
            out.append(
                {
                    "format": fmt,
                    "mode": mode,
                    "reference": ref,
                    "prompt": v["prompt_len"],
                    "prefill_cos_min": g["prefill"]["cos_min"],
                    "prefill_cos_mean": g["prefill"]["cos_mean"],
                    "prefill_agree": g["prefill"]["greedy_agree"],
                    "first_cos": g["first_token"]["cos"],
                    "decode_steps": g["decode"]["steps"],
                    "decode_cos_min": g["decode"]["cos_min"],
                    "decode_agree": g["decode"]["agree_frac"],
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument(
        "--golden", default="auto", choices=("auto", "golden", "golden_swa_yarn", "golden_w4a4")
    )
    ap.add_argument("--min-cos", type=float, default=0.99)
    ap.add_argument("--json", help="also write rows, provenance and verdict to this file")
    a = ap.parse_args(argv)
    all_rows = [r for f in a.files for r in rows(f, a.golden)]
    print(
        f"| checkpoint | mode | reference | prompt | prefill cos min / mean | prefill agree "
        f"| first-token cos | decode steps | decode cos min | decode agree | all cos >= {a.min_cos} |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for r in all_rows:
        if "error" in r:
            ok = False
            print(f"| {r['format']} | {r['mode']} | - | - | failed: {r['error'][:80]} |||||||")
            continue
        good = min(r["prefill_cos_min"], r["first_cos"], r["decode_cos_min"]) >= a.min_cos
        r["meets_min_cos"] = good
        ok &= good
        print(
            f"| {r['format']} | {r['mode']} | {r['reference']} | {r['prompt']} | "
            f"{r['prefill_cos_min']:.4f} / "
            f"{r['prefill_cos_mean']:.4f} | {r['prefill_agree']:.3f} | {r['first_cos']:.4f} | "
            f"{r['decode_steps']} | {r['decode_cos_min']:.4f} | {r['decode_agree']:.3f} | "
            f"{'yes' if good else 'NO'} |"
        )
    ok = ok and bool(all_rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"golden": a.golden, "min_cos": a.min_cos, "all_ok": ok, "rows": all_rows,
                       "runs": [_provenance(p) for p in a.files]}, f, indent=1)  # fmt: skip
    return 0 if ok else 1


def _provenance(path: str) -> dict:
    d = json.load(open(path))
    keep = ("command", "date", "device", "capability", "torch", "transformers", "format",
            "backend", "checkpoint")  # fmt: skip
    modes = {m: {k: r.get(k) for k in ("ok", "vllm", "llm_init_s", "generate_s", "cutedsl_runners")}
             for m, r in d.get("modes", {}).items()}  # fmt: skip
    return {"file": os.path.basename(path), **{k: d.get(k) for k in keep}, "modes": modes}


if __name__ == "__main__":
    sys.exit(main())
