"""H200 experiment for issue 5 (2026-12-03): what limits the sm90 W4A16 GEMM at decode, now that
pipeline depth (moe_stages.py) and the MoE grid (moe_vs_grouped.py, grouped only 3-5 % faster)
are ruled out? Two compile-time switches of the kernel, four variants per shape:

  layout  row:   weights [L, N, K/2]: a K tile reads 32 B of each of tile_n rows, K/2 bytes apart
          tiled: weights [L, K/64, N, 32]: a K tile of tile_n rows is one contiguous tile_n x 32 B
  decode  on / off (no_dequant: the WGMMAs run on zero fragments, results wrong; timing only)

If tiled beats row, the DRAM access pattern is the gap (repack the format); if decode-off beats
decode-on by a lot, the register dequantization (ALU) is. Also checks that tiled and row give
bit-identical outputs. Prints one JSON line per (shape, M, variant).

    python3 bench/experiments/moe_layout.py [OUT.json]
"""

from __future__ import annotations

import functools
import json
import sys

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

VARIANTS = {
    "row": {},
    "tiled": {"w_tiled": True},
    "row_nodeq": {"no_dequant": True},
    "tiled_nodeq": {"w_tiled": True, "no_dequant": True},
}


def tiled_view(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, N, K/2] row layout -> (the [L, K/64, N, 32] copy, its kernel view (N, 32, K/64 * L))."""
    L, N, KH = w.shape
    t = w.reshape(L, N, KH // 32, 32).permute(0, 2, 1, 3).contiguous()
    return t, t.reshape(L * (KH // 32), N, 32).permute(1, 2, 0)


def main() -> int:
    out = []
    cases = [
        ("routed_w13", 256, 4096, 4096, (16, 64, 256)),
        ("routed_w2", 256, 4096, 2048, (16, 64, 256)),
        ("wo_b", 1, 4096, 8192, (1, 16, 32)),
        ("wq_b", 1, 32768, 1024, (1, 16, 32)),
    ]
    for name, e, n, k, ms in cases:
        moe = e > 1
        # dense: 6 copies in turn (>= 96 MiB) so the weights do not stay in the 50 MiB L2
        wps = [random_prepared_weight(e, n, k) for _ in range(1 if moe else 6)]
        w_rs = [wp.w.permute(1, 2, 0) for wp in wps]
        w_ts = [tiled_view(wp.w)[1] for wp in wps]
        sf_vs = [wp.sf.permute(2, 1, 0) for wp in wps]
        for m in ms:
            if moe:
                offs = expert_offsets(expert_counts(routing(m, e, 6), e)).cuda()
                t = m * 6
                active = int((offs[1:] > offs[:-1]).sum())
            else:
                offs, t, active = torch.zeros(1, dtype=torch.int32, device="cuda"), m, 1
            tn, tm, sk = S.launch_tactic(t, n, k, e, moe)
            a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            outs = {}
            part = torch.empty((1, 1, 1), dtype=torch.float32, device="cuda")
            sem = torch.zeros(1, dtype=torch.int32, device="cuda")
            if sk > 1:
                part = torch.empty((sk, t, n), dtype=torch.float32, device="cuda").permute(2, 1, 0)
                sem = torch.zeros(S.splitk_counters(1, t, n, tn, tm), dtype=torch.int32).cuda()
            for var, kw in VARIANTS.items():
                fn_c = G.compile_kernel(tn, tm, sk, moe, **kw)
                y = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                a_v = a.unsqueeze(0).permute(1, 2, 0)
                y_v = y.unsqueeze(0).permute(2, 1, 0)
                fns = [
                    functools.partial(fn_c, a_v, w_v, sf_v, wp.gs, y_v, part, sem, offs)
                    for w_v, sf_v, wp in zip(w_ts if kw.get("w_tiled") else w_rs, sf_vs, wps)
                ]
                us = _graph_time_us(fns, 24)
                outs[var] = y
                r = {"shape": name, "M": m, "tactic": [tn, tm, sk], "variant": var,
                     "us": round(us, 1), "GBps": round(active * n * k * 0.5625 / us / 1e3)}  # fmt: skip
                if var == "tiled":
                    r["equal_to_row"] = bool(torch.equal(outs["row"], y))
                    r["row_has_nan"] = bool(outs["row"].isnan().any())
                print(json.dumps(r), flush=True)
                out.append(r)
        del wps, w_rs, w_ts, sf_vs
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
