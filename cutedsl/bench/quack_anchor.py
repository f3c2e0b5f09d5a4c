"""The quack column of `cutedsl.bench.gemm_sm90`: quack-kernels' CuTeDSL W4A16 GEMM (`gemm_w4a16`,
NVFP4) on the dense shapes, timed like ours, in its own Python environment.

    python -m cutedsl.bench.quack_anchor SPEC.json OUT.json BUDGET_S

quack-kernels 0.6.x needs a newer nvidia-cutlass-dsl (and apache-tvm-ffi) than our pin, so it
cannot share a process with our kernels: `gemm_sm90 --impls ...,quack --quack-env FILE` runs this
module in the environment FILE sets up (sourced by bash), on the same GPU, before its own
measurements. This module imports torch, quack and the torch-only parts of `cutedsl` (the
formats' dequantization and the bench's timing helpers), never `cutlass` of our pin.

SPEC: {"shapes": [{"name", "n", "k"}, ...], "ms": [...]}. Per shape: `_copies` random NVFP4
weights (u8 [N, K/2], low nibble = even k; e4m3 block scales [N, K/16]; global scale TS) turned
into quack's layout once (`quack.gemm_w4.prepare_w4_weight(q, sf, wformat="nvfp4")`), so the
rotation keeps them L2-cold as ours are; per M: one call checked against torch math on the
dequantized weights (`cutedsl.formats.dequantize_nvfp4`; a relative error over MAX_REL_ERR is
recorded as the row's error, not timed), then `graph_time_us` over the copies with `_reps`
calls, as gemm_sm90 times ours. quack picks its own tile (`pick_w4_cfg`, recorded when readable).
OUT: {"meta": {versions, device}, "rows": [{"shape", "M", "us", "rel_err", "tactic", "error"}]},
rewritten after every row; exit status 0, 1 when quack cannot be imported (OUT says why).
"""

from __future__ import annotations

import json
import time
import traceback

import torch

TS = 0.01  # the fp32 global scale (quack: tensor_scale, applied in its epilogue)
MAX_REL_ERR = 2e-2  # max |out - ref| / max |ref| for a row to be timed


def _err(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def run(spec: dict, out_path: str, budget_s: float) -> int:
    from cutedsl.bench.common import graph_time_us
    from cutedsl.bench.gemm_sm90 import _copies, _reps, weight_bytes
    from cutedsl.formats import dequantize_nvfp4

    t0 = time.monotonic()
    meta: dict = {"torch": torch.__version__,
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}  # fmt: skip
    rows: list[dict] = []

    def dump() -> None:
        meta["elapsed_s"] = round(time.monotonic() - t0, 1)
        with open(out_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    try:
        import cutlass
        import quack
        from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

        meta.update(quack=quack.__version__, cutlass_dsl=cutlass.__version__)
    except Exception as e:
        meta["import_error"] = _err(e)
        dump()
        return 1
    try:
        from quack.operand_transform.host import pick_w4_cfg
    except ImportError:
        pick_w4_cfg = None

    for sh in spec["shapes"]:
        name, n, k = sh["name"], int(sh["n"]), int(sh["k"])
        if time.monotonic() - t0 > budget_s:
            rows += [{"shape": name, "M": m, "error": "time budget"} for m in spec["ms"]]
            continue
        torch.manual_seed(0)
        ws, ref_w = [], None
        for i in range(_copies(weight_bytes(1, n, k))):
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            sf = (torch.rand(n, k // 16, device="cuda") * 4 + 2**-7).to(torch.float8_e4m3fn)
            ws.append(prepare_w4_weight(q, sf, wformat="nvfp4"))
            if i == 0:
                ref_w = dequantize_nvfp4(q, sf, TS, dtype=torch.float32)
            del q, sf
        for m in spec["ms"]:
            r: dict = {"shape": name, "M": m, "us": None, "rel_err": None, "tactic": None,
                       "error": None}  # fmt: skip
            rows.append(r)
            if time.monotonic() - t0 > budget_s:
                r["error"] = "time budget"
                continue
            try:
                if pick_w4_cfg is not None:
                    cfg = pick_w4_cfg(m, n, k // 64, sm120=False, device=torch.device("cuda"))
                    r["tactic"] = [int(x) for x in cfg]
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                gemm_w4a16(a, ws[0][0], ws[0][1], tensor_scale=TS, out=out, wformat="nvfp4")
                ref = a.float() @ ref_w.t()
                r["rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                if not r["rel_err"] <= MAX_REL_ERR:
                    r["error"] = f"wrong result: max rel err {r['rel_err']:.3g} > {MAX_REL_ERR}"
                    continue
                fns = [
                    lambda a=a, b=b, s=s, o=out: gemm_w4a16(a, b, s, tensor_scale=TS, out=o,
                                                            wformat="nvfp4")
                    for b, s in ws
                ]  # fmt: skip
                r["us"] = round(graph_time_us(fns, _reps(2.0 * m * n * k)), 2)
            except Exception as e:
                traceback.print_exc()
                r["error"] = _err(e)
            print(r, flush=True)
            dump()
        del ws, ref_w
        torch.cuda.empty_cache()
    dump()
    return 0


EXAMPLES = [
    "python -m cutedsl.bench.quack_anchor spec.json out.json 300   # in quack's environment",
    "python -m cutedsl.bench.gemm_sm90 --impls ours,quack --quack-env /opt/quack/env.sh   # runs it",
]


def main(argv: list[str] | None = None) -> int:
    from cutedsl.bench.common import make_parser

    p = make_parser("cutedsl.bench.quack_anchor", __doc__.split("\n\n")[0], EXAMPLES)
    p.add_argument("spec", help='JSON: {"shapes": [{"name", "n", "k"}, ...], "ms": [...]}')
    p.add_argument("out", help="result JSON, rewritten after every row")
    p.add_argument("budget_s", type=float, help="no new shape or row after this many seconds")
    a = p.parse_args(argv)
    with open(a.spec) as f:
        spec = json.load(f)
    return run(spec, a.out, a.budget_s)


if __name__ == "__main__":
    raise SystemExit(main())
