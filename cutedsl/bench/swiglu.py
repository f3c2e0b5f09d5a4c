"""Clamped SwiGLU between the MLP GEMMs: the CuTeDSL kernel (`cutedsl.sm90.swiglu.swiglu_clamp`)
against the fp32 torch statement it replaced (`swiglu_clamp_bf16`, seven kernels), per DSv4 shape.

Rows are routed rows (tokens x top-6) or shared-expert tokens; I = 2048 (Flash) and 3072 (Pro).
Timing: a CUDA graph of 50 back-to-back calls, median of 5 replays (CUDA events), after warm-up
(`cutedsl.bench.common.graph_time_us`). GB/s counts h read once and out written once (6 bytes per
output element).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from cutedsl.bench.common import gpu_problem, graph_time_us, make_parser

SHAPES = [(rows, i) for i in (2048, 3072) for rows in (1, 16, 64, 384, 1536, 8192, 49152)]
LIMIT = 10.0
EXAMPLES = [
    "python -m cutedsl.bench.swiglu",
    "python -m cutedsl.bench.swiglu --json r/swiglu.json --md r/swiglu.md",
    "python -m cutedsl.bench --only swiglu --json r/bench.json   # writes r/bench.json",
]


def run(shapes: list[tuple[int, int]] = SHAPES) -> list[dict]:
    from cutedsl.sm90 import swiglu as S
    from cutedsl.sm90.runners import CHUNK

    out = []
    for rows, i in shapes:
        h = (torch.randn(rows, 2 * i, device="cuda") * 4).to(torch.bfloat16)
        s = torch.empty(rows, i, dtype=torch.bfloat16, device="cuda")
        tmp = torch.empty(2, min(rows, CHUNK), i, dtype=torch.float32, device="cuda")
        t_torch = graph_time_us([lambda h=h, s=s, t=tmp: S.swiglu_clamp_bf16(h, LIMIT, s, t)], 50)
        t_ours = graph_time_us([lambda h=h, s=s: S.swiglu_clamp(h, LIMIT, s)], 50)
        want = S.swiglu_clamp_bf16(h, LIMIT)
        S.swiglu_clamp(h, LIMIT, s)
        out.append({
            "rows": rows, "I": i, "torch_us": round(t_torch, 2), "kernel_us": round(t_ours, 2),
            "speedup": round(t_torch / t_ours, 2),
            "kernel_gbps": round(6 * rows * i / t_ours / 1e3, 1),
            "max_abs_diff_vs_torch": float((s.float() - want.float()).abs().max()),
        })  # fmt: skip
        print(out[-1], flush=True)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options (argparse exits 2 on a bad one, before anything runs)."""
    p = make_parser("cutedsl.bench.swiglu", __doc__, EXAMPLES)
    p.add_argument("--json", default="", metavar="PATH", help="write the rows and meta as JSON")
    p.add_argument("--md", default="", metavar="PATH", help="write the readable table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    problem = gpu_problem()
    if problem:
        print(f"cutedsl.bench.swiglu: {problem}", file=sys.stderr)
        return 1
    rows = run()
    meta = {
        "command": "python -m cutedsl.bench.swiglu "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "limit": LIMIT,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    lines = [
        f"# Clamped SwiGLU: CuTeDSL kernel vs the torch statement ({meta['device']}, {meta['date']})",
        "",
        f"`{meta['command'].strip()}`; CUDA graph of 50 calls, median of 5 replays.",
        "",
        "| rows | I | torch statement us | kernel us | speedup | kernel GB/s | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['I']} | {r['torch_us']} | {r['kernel_us']} | {r['speedup']} | "
            f"{r['kernel_gbps']} | {r['max_abs_diff_vs_torch']:.3g} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
