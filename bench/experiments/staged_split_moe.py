"""H200 experiment for issue 5: where does the staged epilogue (stmatrix into the idle ring, then
16-byte stores of token rows) pay for split-K tactics (each CTA of the cluster stages its token
slice of tile_m / split_k tokens) and for the MoE (a barrier before the ring is refilled), against
the register stores of the same tactic? Each case is timed in alternating rounds (register,
staged, register, staged, ...), median per variant, so drift between the two is shared. The two
outputs must be bit-identical and fully written (outputs start as NaN).

    python3 bench/experiments/staged_split_moe.py [OUT.json]
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from cutedsl import sm90 as S
from cutedsl.bench.ab import alternating_rounds
from cutedsl.bench.gemm_sm90 import (
    SHAPES,
    _copies,
    dense_shapes,
    expert_counts,
    expert_offsets,
    random_prepared_weight,
    routing,
    weight_bytes,
)
from cutedsl.kernels.gemm_sm90 import compile_kernel

DENSE = [  # Flash shape, M, split tactics (tile_n, tile_m, split_k)
    ("fused_wqa_wkv", 128, [(64, 128, 4), (64, 128, 8), (64, 128, 2)]),
    ("fused_wqa_wkv", 256, [(64, 256, 4), (64, 256, 2), (128, 256, 4)]),
    ("fused_wqa_wkv", 512, [(128, 256, 4), (128, 256, 2)]),
    ("fused_wqa_wkv", 1024, [(128, 256, 2)]),
    ("fused_wqa_wkv", 4096, [(128, 256, 2)]),
    ("wo_b", 256, [(64, 256, 2)]),
    ("wo_b", 512, [(128, 256, 2)]),
    ("shared_w13", 128, [(64, 128, 2)]),
    ("shared_w13", 256, [(64, 256, 2)]),
    ("shared_w2", 128, [(64, 128, 2)]),
    ("shared_w2", 512, [(128, 256, 2)]),
]
MOE = [s for s in SHAPES["flash"] if s.kind == "moe"]  # routed w13 / w2, E = 256, top-6
MOE_MS = (16, 64, 256, 1024, 4096)
ROUNDS = 3


@functools.cache
def compiled(tile_n: int, tile_m: int, split_k: int, moe: bool, staged: bool):
    return compile_kernel(tile_n, tile_m, split_k, moe, staged_epilogue=staged)


def compare(case: dict, operands: list[tuple], out: torch.Tensor, reps: int) -> dict:
    """Time both variants over the rotated `operands` in alternating rounds."""
    tac = case["tactic"]
    calls = {
        staged: [functools.partial(compiled(*tac, case["moe"], staged), *ops) for ops in operands]
        for staged in (False, True)
    }
    outs, med, times = alternating_rounds(calls, out, reps, ROUNDS)
    reg, stg = med[False], med[True]
    return dict(
        case,
        tactic=list(tac),
        equal=bool(torch.equal(outs[False], outs[True])),
        nan=bool(outs[True].isnan().any() or outs[False].isnan().any()),
        register_us=round(reg, 2),
        staged_us=round(stg, 2),
        speedup=round(reg / stg, 3),
        rounds={str(k): [round(t, 2) for t in v] for k, v in times.items()},
    )


def main() -> int:
    rows = []
    for name, m, tactics in DENSE:
        _, n, k = dense_shapes("flash")[name]
        wps = [random_prepared_weight(1, n, k) for _ in range(_copies(weight_bytes(1, n, k)))]
        a = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, m, n, device="cuda", dtype=torch.bfloat16)
        for tac in tactics:
            case = {"shape": name, "M": m, "tactic": tac, "moe": False}
            try:
                r = compare(case, [S.kernel_operands(a, w, y) for w in wps], y, 100)
            except ValueError as e:  # the staged slice does not fit this tactic's ring
                r = dict(case, tactic=list(tac), error=str(e))
            print(json.dumps(r), flush=True)
            rows.append(r)
        del wps
        torch.cuda.empty_cache()
    for shape in MOE:
        name, n, k, e, topk = shape.name, shape.n, shape.k, shape.groups, shape.topk
        wp = random_prepared_weight(e, n, k)
        for m in MOE_MS:
            t = m * topk
            offs = [expert_offsets(expert_counts(routing(m, e, topk, seed=s), e)).cuda()
                    for s in range(4)]  # fmt: skip
            a = torch.randn(1, t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(1, t, n, device="cuda", dtype=torch.bfloat16)
            tac = S.launch_tactic(t, n, k, e, True)
            case = {"shape": name, "M": m, "tactic": tac, "moe": True}
            ops = [S.kernel_operands(a, wp, y, o) for o in offs]
            r = compare(case, ops, y, 20 if m >= 1024 else 50)
            print(json.dumps(r), flush=True)
            rows.append(r)
        del wp
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
