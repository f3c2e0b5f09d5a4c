"""One-off H200 experiment (2026-12-03): does the sm90 routed-expert GEMM's pipeline depth
(stages, hence smem per CTA and CTAs per SM) change decode speed? Times the MoE GEMM for
DSv4-Flash routed w13/w2 (E = 256, top-6) at several stage counts by overriding the compiled
variant in cutedsl.sm90's cache. Prints one line per (shape, M, tile, stages)."""

from __future__ import annotations

import json
import sys

import cutlass.cute as cute
import torch

from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import (
    _graph_time_us,
    expert_counts,
    expert_offsets,
    random_prepared_weight,
    routing,
)
from cutedsl.kernels import gemm_sm90 as G


def main() -> int:
    out = []
    for name, n, k in (("w13", 4096, 4096), ("w2", 4096, 2048)):
        e = 256
        wp = random_prepared_weight(e, n, k)
        for m in (16, 64):
            offs = expert_offsets(expert_counts(routing(m, e, 6), e)).cuda()
            t = m * 6
            a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            active = int((offs[1:] > offs[:-1]).sum())
            for tn in (128, 64):
                for st in (2, 3, 4, 6, 8):
                    kern = G.Sm90Nvfp4W4A16GemmKernel(tile_n=tn, tile_m=16, moe=True, stages=st)
                    S._CACHE[(tn, 16, 1, True)] = cute.compile(
                        kern, *G.fake_operands(True), options="--enable-tvm-ffi"
                    )

                    def fn(a=a, offs=offs, wp=wp, y=y, tn=tn):
                        S.sm90_nvfp4_moe_gemm(a, offs, wp, out=y, tactic=(tn, 16, 1))

                    us = _graph_time_us([fn], 20)
                    gbs = active * n * k * 0.5625 / us / 1e3
                    r = {"w": name, "M": m, "tile_n": tn, "stages": st, "us": round(us, 1),
                         "GBps": round(gbs), "active": active}  # fmt: skip
                    print(json.dumps(r), flush=True)
                    out.append(r)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
