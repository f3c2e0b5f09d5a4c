"""H200 experiment for issue 5 (prefill): does the sm90 W4A16 GEMM lose its prefill time in the
epilogue and in the per-CTA pipeline fill? Variants, each on the Flash dense / grouped shapes at
M = 256 ... 16384, with cuBLAS BF16 timed in the same run:
  - "table":   the tuned tactic, bf16 stored from registers (2-byte stores; the kernel as of 45564b1);
  - "staged":  the same tactic, bf16 tile through shared memory (stmatrix .trans, 16-byte stores;
               split-K: each CTA of the cluster its token slice);
  - "2cta-*":  tactics whose ring is cut so that two CTAs share an SM (128x128 with 5 stages,
               64x256 with 3), so one CTA's epilogue / fill overlaps the other's mainloop.
Every variant's output must be bit-identical to "table" (same accumulation order) and fully
written (outputs start as NaN; M not a multiple of the token tile is included).

    python3 bench/experiments/prefill_epi.py [OUT.json [SHAPE,...]]
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.gemm_sm90 import (
    _copies,
    _graph_time_us,
    _reps,
    dense_shapes,
    random_prepared_weight,
    weight_bytes,
)
from cutedsl.kernels.gemm_sm90 import compile_kernel

SHAPES = dense_shapes("flash")  # name: (groups, N, K)
MS = (512, 1024, 4096, 16384)


@functools.cache
def compiled(tile_n: int, tile_m: int, split_k: int, stages: int | None, staged: bool):
    return compile_kernel(tile_n, tile_m, split_k, False, staged_epilogue=staged, stages=stages)


def variants(tac: tuple[int, int, int]) -> dict[str, tuple]:
    tn, tm, sk = tac
    v = {"table": (tn, tm, sk, None, False)}
    if tm % (16 * sk) == 0:
        v["staged"] = (tn, tm, sk, None, True)
    if sk > 1:  # split tactic: compare with the unsplit one, both epilogues
        v["unsplit"] = (tn, tm, 1, None, False)
        v["unsplit-staged"] = (tn, tm, 1, None, True)
    v["2cta-128x128"] = (128, 128, 1, 5, True)
    v["2cta-128x128-direct"] = (128, 128, 1, 5, False)
    v["2cta-64x256"] = (64, 256, 1, 3, True)
    v["128x256-s4"] = (128, 256, 1, 4, True)
    return v


def main() -> int:
    rows = []
    dev = "cuda"
    keep = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
    for name, (g, n, k) in SHAPES.items():
        if name not in keep:
            continue
        copies = _copies(weight_bytes(g, n, k))
        wps = [random_prepared_weight(g, n, k) for _ in range(copies)]
        wbf = [S.dequantize_prepared(wp).to(torch.bfloat16) for wp in wps[:2]]
        for m in MS:
            for mm in (m, m - 3):  # the tail case only checks values
                a = torch.randn(g, mm, k, device=dev, dtype=torch.bfloat16)
                tac = S.launch_tactic(mm, n, k, g, False)
                ref = None
                flops = 2.0 * g * mm * n * k
                for var, cfg in variants(tac).items():
                    try:
                        fn = compiled(*cfg)
                    except ValueError as e:
                        print(f"{name} M={mm} {var}: {e}", flush=True)
                        continue
                    y = torch.full((g, mm, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    fns = [functools.partial(fn, *S.kernel_operands(a, wp, y)) for wp in wps]
                    fns[0]()
                    torch.cuda.synchronize()
                    first = y.clone()
                    r = {"shape": name, "M": mm, "variant": var, "cfg": list(cfg[:4])}
                    r["nan"] = bool(first.isnan().any())
                    if ref is None:
                        ref = first
                        want = torch.einsum("gmk,gnk->gmn", a.float(), wbf[0].float())
                        err = (first.float() - want).abs().max().item()
                        r["max_abs_err_vs_bf16_ref"] = round(err, 4)
                        r["ref_absmax"] = round(want.abs().max().item(), 2)
                    else:
                        r["equal_to_table"] = bool(torch.equal(first, ref))
                    if mm == m:
                        us = _graph_time_us(fns, _reps(flops))
                        r["us"] = round(us, 2)
                        r["tflops"] = round(flops / us / 1e6, 1)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
                if mm == m:
                    out = torch.empty(g, m, n, device=dev, dtype=torch.bfloat16)
                    if g == 1:
                        cfns = [
                            functools.partial(torch.matmul, a[0], w[0].t(), out=out[0]) for w in wbf
                        ]
                    else:
                        cfns = [
                            functools.partial(torch.bmm, a, w.transpose(1, 2), out=out) for w in wbf
                        ]
                    us = _graph_time_us(cfns, _reps(flops))
                    r = {"shape": name, "M": m, "variant": "cublas", "us": round(us, 2),
                         "tflops": round(flops / us / 1e6, 1)}  # fmt: skip
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        del wps, wbf
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
