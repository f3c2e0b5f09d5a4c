"""One-off H200 experiment (2026-12-03): how much HBM bandwidth do simple torch kernels reach,
against the `copy_bandwidth_gbps` anchor of cutedsl.bench.gemm_sm90 (1 GiB uint8 d2d copy_)?
Each: a CUDA graph of 10 calls, median of 5 replays (the GEMM bench's timer); GB/s = bytes read + written / time."""

from __future__ import annotations

import json
import sys

import torch

from cutedsl.bench.gemm_sm90 import _graph_time_us


def main() -> int:
    n = 2**30
    u8, u8o = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    bf = torch.randn(n // 2, device="cuda").to(torch.bfloat16)
    bfo = torch.empty_like(bf)
    f32 = torch.randn(n // 4, device="cuda")
    acc = torch.empty((), device="cuda")
    rows = {
        "copy_ uint8 1 GiB (the anchor)": (lambda: u8o.copy_(u8), 2 * n),
        "mul bf16 1 GiB -> 1 GiB": (lambda: torch.mul(bf, 2, out=bfo), 2 * n),
        "sum fp32 1 GiB (read only)": (lambda: torch.sum(f32, out=acc), n),
        "add bf16 2 x 0.5 GiB -> 0.5 GiB": (
            lambda: torch.add(bf[: n // 4], bf[n // 4 :], out=bfo[: n // 4]),
            1.5 * n,
        ),
    }
    out = {}
    for name, (fn, nbytes) in rows.items():
        us = _graph_time_us([fn], 10)
        out[name] = round(nbytes / us / 1e3, 1)
        print(f"{name}: {us:.1f} us, {out[name]} GB/s", flush=True)
    if len(sys.argv) > 1:
        json.dump(
            {"device": torch.cuda.get_device_name(), "GBps": out}, open(sys.argv[1], "w"), indent=1
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
