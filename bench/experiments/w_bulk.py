"""H200 experiment for issue 5 (2026-12-03, session 4): is the sm90 W4A16 GEMM's weight stream
limited by the TMA tensor copy of a (tile_n rows x 32 B) box, 32 B per row (tile_n row requests
per K tile)? Variant "bulk" stores the weights K-tile-major ([L, K/64, N, 32 B]: one K tile of
tile_n rows is one contiguous tile_n x 32 B block) and fetches weights and scales with one 1-D
`cp.async.bulk` each; "tma" is the kernel as shipped. The same heuristic tactic for both; outputs
must be bit-identical. The 2026-12-02 layout experiment (moe_layout.py at 3162691) kept 2-D tensor
boxes for its tiled layout (no gain), so it did not test the request count.

    python3 bench/experiments/w_bulk.py [OUT.json]
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


def tiled_view(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, N, K/2] -> (the [L, K/64, N, 32] copy, its kernel view (N, 32, K/64 * L))."""
    L, N, KH = w.shape
    t = w.reshape(L, N, KH // 32, 32).permute(0, 2, 1, 3).contiguous()
    return t, t.reshape(L * (KH // 32), N, 32).permute(1, 2, 0)


def main() -> int:
    out = []
    cases = [
        ("routed_w13", 256, 4096, 4096, (16, 64)),
        ("routed_w2", 256, 4096, 2048, (16,)),
        ("wq_b", 1, 32768, 1024, (1, 128)),
        ("wo_b", 1, 4096, 8192, (16,)),
    ]
    for name, e, n, k, ms in cases:
        moe = e > 1
        wps = [random_prepared_weight(e, n, k) for _ in range(1 if moe else 6)]
        w_rs = [wp.w.permute(1, 2, 0) for wp in wps]
        tiled = [tiled_view(wp.w) for wp in wps]
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
            for var in ("tma", "bulk"):
                fn_c = G.compile_kernel(tn, tm, sk, moe, w_bulk=var == "bulk")
                y = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                a_v = a.unsqueeze(0).permute(1, 2, 0)
                y_v = y.unsqueeze(0).permute(2, 1, 0)
                ws = [tv[1] for tv in tiled] if var == "bulk" else w_rs
                fns = [
                    functools.partial(fn_c, a_v, w_v, sf_v, wp.gs, y_v, offs)
                    for w_v, sf_v, wp in zip(ws, sf_vs, wps)
                ]
                us = _graph_time_us(fns, 48)
                outs[var] = y.clone()
                r = {"shape": name, "M": m, "tactic": [tn, tm, sk], "variant": var,
                     "us": round(us, 2), "GBps": round(active * n * k * 0.5625 / us / 1e3)}  # fmt: skip
                if var == "bulk":
                    r["equal_to_tma"] = bool(torch.equal(outs["tma"], y))
                    r["tma_has_nan"] = bool(outs["tma"].isnan().any())
                print(json.dumps(r), flush=True)
                out.append(r)
        del wps, w_rs, tiled, sf_vs
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
