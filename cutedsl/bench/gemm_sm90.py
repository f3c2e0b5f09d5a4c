"""`python -m cutedsl.bench.gemm_sm90`: the sm_90a NVFP4 W4A16 GEMM vs cuBLAS BF16 (and Marlin).

python -m cutedsl.bench.gemm_sm90 [--model flash|pro|both] [--ms 1,4,...] [--json PATH] [--md PATH]

Timing: each implementation is captured in a CUDA graph of `reps` back-to-back calls that cycle
through enough weight copies to exceed 3x the 60 MB L2 (weights are cold every call, as in decode
where each layer's weights are read once); the graph is replayed 5 times and the median is
divided by `reps`. Launch overhead of the host wrapper is therefore excluded (as under vLLM's
CUDA graphs). Byte formula (one place): weight + scale bytes = N*K*(0.5 + 1/16) per group
(NVFP4, 0.5625 B/param); cuBLAS BF16 reads N*K*2. Activations/outputs are not counted in GB/s.
FLOPs = 2*M*N*K per group. Copy bandwidth is measured here as a 1 GiB device-to-device copy
(read + write bytes / time).
Marlin: vLLM 0.21.0's `apply_fp4_marlin_linear` on weights of the same shape when vLLM imports;
otherwise its columns are empty and the header says so.
"""

# ruff: noqa: B023  (the lambdas are captured into a graph within the same iteration)

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys

import torch

L2_BYTES = 60 * 2**20
M_LIST = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
SHAPES = {  # name: (groups, N, K)
    "flash": [
        ("fused_wqa_wkv", 1, 1536, 4096),
        ("wq_b", 1, 32768, 1024),
        ("wo_a(G=8)", 8, 1024, 4096),
        ("wo_b", 1, 4096, 8192),
        ("expert_w13", 1, 4096, 4096),
        ("expert_w2", 1, 4096, 2048),
    ],
    "pro": [
        ("wo_a(G=16)", 16, 1024, 4096),
        ("shared_w13", 1, 6144, 7168),
        ("shared_w2", 1, 7168, 3072),
    ],
}


def weight_bytes(groups: int, n: int, k: int) -> float:
    return groups * n * k * (0.5 + 1 / 16)


def _graph_time_us(fns: list, reps: int) -> float:
    """Median per-call time of a CUDA graph that runs fns[i % len(fns)] for i < reps."""
    for f in fns[: min(3, len(fns))]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / reps)
    del g
    return statistics.median(ts)


def copy_bandwidth_gbps() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = _graph_time_us([lambda: y.copy_(x)], 10)
    return 2 * x.numel() / t / 1e3


def _marlin():
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_workspace_new,
        )
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            apply_fp4_marlin_linear,
            rand_marlin_weight_nvfp4_like,
        )
    except Exception as e:  # noqa: BLE001 - report why Marlin is absent, never fail the bench
        return None, f"unavailable ({type(e).__name__}: {str(e)[:80]})"
    ws = marlin_make_workspace_new(torch.device("cuda"))
    return (apply_fp4_marlin_linear, rand_marlin_weight_nvfp4_like, ws), "vllm 0.21.0 Marlin"


def bench_shape(name, groups, n, k, ms, marlin, rows, copy_bw):
    from cutedsl import sm90 as S

    wb = weight_bytes(groups, n, k)
    copies = max(1, min(64, math.ceil(3 * L2_BYTES / wb)))
    wps = []
    for _ in range(copies):
        packed = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, device="cuda")
        sf = (torch.rand(groups, n, k // 16, device="cuda") * 4 + 2**-7).to(torch.float8_e4m3fn)
        wps.append(S.prepare_nvfp4_weight(packed, sf, torch.full((groups,), 0.01, device="cuda")))
    bf_copies = max(1, min(64, math.ceil(3 * L2_BYTES / (groups * n * k * 2))))
    from cutedsl import formats

    w0 = formats.dequantize_nvfp4(wps[0].w, wps[0].sf.transpose(1, 2), wps[0].gs)  # (G, N, K)
    wbf = [w0] + [w0.clone() for _ in range(bf_copies - 1)]
    mq = None
    if marlin is not None and groups == 1:
        apply, rand_like, mws = marlin
        mq = []
        for _ in range(copies):
            _, qw, sc, gs = rand_like(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, 16
            )
            mq.append((qw, sc, gs))
    for m in ms:
        flops = 2.0 * groups * m * n * k
        reps = int(max(3, min(200, 2e5 / max(1.0, flops / 5e8))))  # ~<=200 calls, long shapes fewer
        a = torch.randn(groups, m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(groups, m, n, device="cuda", dtype=torch.bfloat16)
        if groups == 1:
            a2, o2 = a[0], out[0]
            fns = [lambda wp=wp: S.sm90_nvfp4_gemm_prepared(a2, wp, out=o2) for wp in wps]
        else:
            fns = [lambda wp=wp: S.sm90_nvfp4_grouped_gemm(a, wp, out=out) for wp in wps]
        fns[0]()  # compile outside capture
        t_ours = _graph_time_us(fns, reps)
        tactic = S.choose_tactic(m, n, k, groups)
        if groups == 1:
            bfn = [lambda w=w: torch.matmul(a[0], w[0].t(), out=out[0]) for w in wbf]
        else:
            bfn = [lambda w=w: torch.bmm(a, w.transpose(1, 2), out=out) for w in wbf]
        t_bf = _graph_time_us(bfn, reps)
        t_mar = None
        if mq is not None:
            apply, _, mws = marlin
            x = a[0]
            mfn = [
                lambda q=q: apply(
                    input=x,
                    weight=q[0],
                    weight_scale=q[1],
                    weight_global_scale=q[2],
                    workspace=mws,
                    size_n=n,
                    size_k=k,
                )
                for q in mq
            ]
            t_mar = _graph_time_us(mfn, reps)
        r = dict(
            shape=name,
            G=groups,
            M=m,
            N=n,
            K=k,
            tactic=list(tactic),
            us=round(t_ours, 2),
            tflops=round(flops / t_ours / 1e6, 1),
            weight_GBps=round(wb / t_ours / 1e3),
            pct_copy_bw=round(100 * wb / t_ours / 1e3 / copy_bw, 1),
            cublas_us=round(t_bf, 2),
            cublas_tflops=round(flops / t_bf / 1e6, 1),
            cublas_weight_GBps=round(groups * n * k * 2 / t_bf / 1e3),
            marlin_us=None if t_mar is None else round(t_mar, 2),
            marlin_tflops=None if t_mar is None else round(flops / t_mar / 1e6, 1),
            marlin_weight_GBps=None if t_mar is None else round(wb / t_mar / 1e3),
            x_cublas=round(t_bf / t_ours, 2),
            x_marlin=None if t_mar is None else round(t_mar / t_ours, 2),
        )
        rows.append(r)
        print(_fmt(r), flush=True)
    del wps, wbf, mq
    torch.cuda.empty_cache()


HEAD = (
    f"{'shape':20s} {'M':>6s} {'N':>6s} {'K':>5s} {'tactic':>11s} | {'us':>8s} {'TF/s':>6s} "
    f"{'GB/s':>5s} {'%cp':>5s} | {'cuBLAS us':>9s} {'TF/s':>6s} | {'Marlin us':>9s} {'TF/s':>6s} "
    f"{'GB/s':>5s} | {'x cuBLAS':>8s} {'x Marlin':>8s}"
)


def _fmt(r: dict) -> str:
    def f(v, w, p=1):
        return f"{'-':>{w}s}" if v is None else f"{v:>{w}.{p}f}"

    t = "x".join(str(x) for x in r["tactic"])
    return (
        f"{r['shape']:20s} {r['M']:6d} {r['N']:6d} {r['K']:5d} {t:>11s} | {r['us']:8.1f} "
        f"{r['tflops']:6.1f} {r['weight_GBps']:5d} {r['pct_copy_bw']:5.1f} | {r['cublas_us']:9.1f} "
        f"{r['cublas_tflops']:6.1f} | {f(r['marlin_us'], 9)} {f(r['marlin_tflops'], 6)} "
        f"{f(r['marlin_weight_GBps'], 5, 0)} | {r['x_cublas']:8.2f} {f(r['x_marlin'], 8, 2)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="both", choices=["flash", "pro", "both"])
    p.add_argument("--ms", default=",".join(map(str, M_LIST)))
    p.add_argument("--shapes", default="", help="comma list of shape names to keep")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="")
    args = p.parse_args(argv)
    ms = [int(x) for x in args.ms.split(",")]
    import cutlass

    marlin, marlin_note = _marlin()
    copy_bw = copy_bandwidth_gbps()
    dev = torch.cuda.get_device_properties(0)
    header = [
        f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}; "
        f"nvidia-cutlass-dsl {cutlass.__version__}",
        "timing: CUDA graph of back-to-back calls over rotated weight copies (>3x L2), median of 5",
        f"measured copy bandwidth (1 GiB d2d, read+write): {copy_bw:.0f} GB/s",
        f"GB/s = NVFP4 weight+scale bytes (0.5625 B/param) / time; Marlin: {marlin_note}",
    ]
    print("\n".join(header))
    print(HEAD, flush=True)
    models = ["flash", "pro"] if args.model == "both" else [args.model]
    keep = set(filter(None, args.shapes.split(",")))
    rows: list[dict] = []
    for mdl in models:
        for name, g, n, k in SHAPES[mdl]:
            if keep and name not in keep:
                continue
            bench_shape(f"{mdl}.{name}", g, n, k, ms, marlin, rows, copy_bw)
    dec = [r for r in rows if r["M"] <= 32]
    pre = [r for r in rows if r["M"] >= 4096]
    summary = {
        "decode_pct_copy_bw_min": min((r["pct_copy_bw"] for r in dec), default=None),
        "decode_pct_copy_bw_geomean": _geo([r["pct_copy_bw"] for r in dec]),
        "prefill_x_cublas_min": min((r["x_cublas"] for r in pre), default=None),
        "prefill_x_cublas_geomean": _geo([r["x_cublas"] for r in pre]),
        "x_marlin_geomean": _geo([r["x_marlin"] for r in rows if r["x_marlin"]]),
        "x_marlin_min": min((r["x_marlin"] for r in rows if r["x_marlin"]), default=None),
    }
    print("summary:", json.dumps(summary))
    cmd = "python -m cutedsl.bench.gemm_sm90 " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.json:
        meta = dict(
            command=cmd,
            date=date,
            device=dev.name,
            sms=dev.multi_processor_count,
            torch=torch.__version__,
            cutlass_dsl=cutlass.__version__,
            marlin=marlin_note,
            copy_bw_GBps=round(copy_bw),
            timing=header[1],
            summary=summary,
            rows=rows,
        )
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# sm_90a NVFP4 W4A16 GEMM bench ({date})\n\n`{cmd}`\n\n")
            f.write("\n".join(f"- {h}" for h in header) + "\n\n```\n" + HEAD + "\n")
            f.write(
                "\n".join(_fmt(r) for r in rows) + "\n```\n\nsummary: " + json.dumps(summary) + "\n"
            )
    return 0


def _geo(xs: list[float]):
    xs = [x for x in xs if x and x > 0]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
