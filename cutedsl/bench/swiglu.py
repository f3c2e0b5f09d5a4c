"""Clamped SwiGLU between the MLP GEMMs: the CuTeDSL kernel (`cutedsl.sm90_runners.swiglu_clamp`)
against the fp32 torch statement it replaced (`swiglu_clamp_bf16`, seven kernels), per DSv4 shape.

    python -m cutedsl.bench.swiglu [--json F] [--md F]

Rows are routed rows (tokens x top-6) or shared-expert tokens; I = 2048 (Flash) and 3072 (Pro).
Timing: a CUDA graph of 50 back-to-back calls, median of 5 replays (CUDA events), after warm-up.
GB/s counts h read once and out written once (6 bytes per output element).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

SHAPES = [(rows, i) for i in (2048, 3072) for rows in (1, 16, 64, 384, 1536, 8192, 49152)]
LIMIT = 10.0


def run(shapes: list[tuple[int, int]] = SHAPES) -> list[dict]:
    from cutedsl import sm90_runners as R
    from cutedsl.bench.gemm_sm90 import _graph_time_us

    out = []
    for rows, i in shapes:
        h = (torch.randn(rows, 2 * i, device="cuda") * 4).to(torch.bfloat16)
        s = torch.empty(rows, i, dtype=torch.bfloat16, device="cuda")
        tmp = torch.empty(2, min(rows, R.CHUNK), i, dtype=torch.float32, device="cuda")
        t_torch = _graph_time_us([lambda h=h, s=s, t=tmp: R.swiglu_clamp_bf16(h, LIMIT, s, t)], 50)
        t_ours = _graph_time_us([lambda h=h, s=s: R.swiglu_clamp(h, LIMIT, s)], 50)
        want = R.swiglu_clamp_bf16(h, LIMIT)
        R.swiglu_clamp(h, LIMIT, s)
        out.append({
            "rows": rows, "I": i, "torch_us": round(t_torch, 2), "kernel_us": round(t_ours, 2),
            "speedup": round(t_torch / t_ours, 2),
            "kernel_gbps": round(6 * rows * i / t_ours / 1e3, 1),
            "max_abs_diff_vs_torch": float((s.float() - want.float()).abs().max()),
        })  # fmt: skip
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    a, _ = ap.parse_known_args(argv)  # `python -m cutedsl.bench` passes every benchmark's args
    if not torch.cuda.is_available():
        print("cutedsl.bench.swiglu: needs a CUDA GPU", file=sys.stderr)
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
