#!/usr/bin/env python3
"""One markdown table from bench/upstream_baseline.py result JSONs (vLLM vs the golden reference).

    python bench/e2e_table.py bench/results/h200/e2e_*.json [--golden golden|golden_swa_yarn]
        [--min-cos 0.99]

Rows: checkpoint format x mode x prompt. Columns: prefill cosine (min, mean) and greedy agreement,
first generated token, decode steps (min cosine, agreement). A last column says whether every
position meets --min-cos. Exit 1 if a mode failed to run or a row misses the bound.
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(path: str, golden: str) -> list[dict]:
    d = json.load(open(path))
    fmt = d.get("format") or d.get("checkpoint", {}).get("path", path)
    out = []
    for mode, r in d.get("modes", {}).items():
        if not r.get("ok"):
            out.append({"format": fmt, "mode": mode, "error": r.get("error", "did not finish")})
            continue
        for v in r.get("vs_golden", []):
            g = v[golden]
            out.append(
                {
                    "format": fmt,
                    "mode": mode,
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
    ap.add_argument("--golden", default="golden", choices=("golden", "golden_swa_yarn"))
    ap.add_argument("--min-cos", type=float, default=0.99)
    a = ap.parse_args(argv)
    all_rows = [r for f in a.files for r in rows(f, a.golden)]
    print(
        f"| checkpoint | mode | prompt | prefill cos min / mean | prefill agree | first-token cos "
        f"| decode steps | decode cos min | decode agree | all cos >= {a.min_cos} |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for r in all_rows:
        if "error" in r:
            ok = False
            print(f"| {r['format']} | {r['mode']} | - | failed: {r['error'][:80]} |||||||")
            continue
        good = min(r["prefill_cos_min"], r["first_cos"], r["decode_cos_min"]) >= a.min_cos
        ok &= good
        print(
            f"| {r['format']} | {r['mode']} | {r['prompt']} | {r['prefill_cos_min']:.4f} / "
            f"{r['prefill_cos_mean']:.4f} | {r['prefill_agree']:.3f} | {r['first_cos']:.4f} | "
            f"{r['decode_steps']} | {r['decode_cos_min']:.4f} | {r['decode_agree']:.3f} | "
            f"{'yes' if good else 'NO'} |"
        )
    return 0 if ok and all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
