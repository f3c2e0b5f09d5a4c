"""Compile the CuTeDSL kernels a DeepSeek V4 checkpoint will need, before (or while) its server
starts, into our kernel cache (`cutedsl.jit`, $CUTEDSL_CACHE_DIR).

    dsv4-prewarm-kernels MODEL_DIR [--max-num-batched-tokens N] [--workers W] [--json F]
    (or python -m cutedsl.tools.prewarm_kernels ...)

The server compiles the kernels its layers need in background processes while its weights load
(`cutedsl.vllm.prefetch`), and waits for the rest after loading. Started beside `vllm serve`
(scripts/serve.sh does), this tool does the same compiles from the checkpoint's config.json alone,
during the minute vLLM spends importing and spawning its engine, so that the engine finds them
on disk. The two share the cache safely: an entry is compiled by one process under its file lock
while the others wait for it and load it (`cutedsl.jit`). With everything already cached it lists
the kernels and exits without starting a process.

The kernels: those `cutedsl.vllm.prefetch.kernel_jobs` lists for the built model, derived here from
the checkpoint's layout (`cutedsl.tools.schema`: which projections are NVFP4 in its format) and
shapes, for up to --max-num-batched-tokens rows (the server's max_num_batched_tokens; each
runner's tactics depend on it) on this machine's GPU (its name and SM count choose the tactics;
read through the CUDA driver, without creating a CUDA context, so the server's memory accounting
is untouched). Only the sm90 backend on one GPU (tensor parallel shards the shapes): anything
else exits 0 with a line saying there is nothing to do. A CPU test checks the list against
`kernel_jobs` of the model vLLM 0.21.0 builds from each layout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cutedsl import jit
from cutedsl.tools import cli
from cutedsl.tools.cli import UsageError
from cutedsl.tools.schema import detect_format, storage_of, tensor_specs

OURS = ("nvfp4", "ct_nvfp4")  # storages our kernels serve


def _ours(spec, fmt: str) -> bool:
    return spec.kind == "linear" and storage_of(spec, fmt) in OURS


def kernel_jobs(cfg: dict, max_tokens: int, gpu) -> list[jit.Job]:
    """The sm90 kernels of the main model of a checkpoint with config `cfg` (one GPU)."""
    from cutedsl import grouped_oproj
    from cutedsl.sm90 import runners

    fmt = detect_format(cfg)
    specs = {s.name: s for s in tensor_specs(cfg)}
    limit = cfg.get("swiglu_limit")  # as the model's layers hold it (the key's repr)
    jobs: list[jit.Job] = []
    for L in range(cfg["num_hidden_layers"]):
        a, f = f"layers.{L}.attn.", f"layers.{L}.ffn."
        wq_a, wkv = specs[a + "wq_a"], specs[a + "wkv"]
        if _ours(wq_a, fmt) and _ours(wkv, fmt):  # fused_wqa_wkv
            n = wq_a.shape[0] + wkv.shape[0]
            jobs += runners.linear_jobs(n, wq_a.shape[1], 1, max_tokens, gpu)
        for name in ("wq_b", "wo_b", "indexer.wq_b"):
            s = specs.get(a + name)
            if s is not None and _ours(s, fmt):
                jobs += runners.linear_jobs(s.shape[0], s.shape[1], 1, max_tokens, gpu)
        wo_a = specs[a + "wo_a"]
        if _ours(wo_a, fmt):
            g = int(cfg["o_groups"])
            n, k, hd = wo_a.shape[0] // g, wo_a.shape[1], int(cfg["head_dim"])
            jobs += grouped_oproj.sm90_jobs(n, k, g, hd, max_tokens, gpu)
        se = [specs[f + f"shared_experts.{w}"] for w in ("w1", "w3", "w2")]
        if all(_ours(s, fmt) for s in se):  # the fused shared expert
            h, i = se[2].shape
            jobs += runners.shared_mlp_jobs(h, i, limit, max_tokens, gpu)
        e0 = specs[f + "experts.0.w2"]
        if _ours(e0, fmt):
            e, (h, i) = int(cfg["n_routed_experts"]), e0.shape
            jobs += runners.moe_jobs(e, h, i, limit, max_tokens, gpu)
    return jobs


def _driver_gpu():
    """(GpuSpec, "sm_XYa") of CUDA device 0 through the driver API (no context), or None."""
    from cuda.bindings import driver as cu

    from cutedsl.sm90.tactics import GpuSpec

    def ok(res):
        err, *vals = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return vals[0] if len(vals) == 1 else vals

    try:
        ok(cu.cuInit(0))
        if ok(cu.cuDeviceGetCount()) < 1:
            return None
        dev = ok(cu.cuDeviceGet(0))
        name = ok(cu.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode()
        attr = cu.CUdevice_attribute
        sms = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        major = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    except RuntimeError:
        return None
    return GpuSpec(name, int(sms)), f"sm_{major}{minor}a"


def _config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise UsageError(f"MODEL_DIR {model_dir} is not a folder")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} not found") from None
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "deepseek_v4":
        raise UsageError(f"{path}: not a DeepSeek V4 config (model_type 'deepseek_v4')")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.prewarm_kernels", "dsv4-prewarm-kernels", __doc__)
    ap.add_argument("model_dir", metavar="MODEL_DIR", help="the checkpoint folder (config.json)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                    help="the server's max_num_batched_tokens (default 8192)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=None,
                    help=f"compile processes (default ${jit.WORKERS_ENV} or half the CPUs, <= 8)")  # fmt: skip
    ap.add_argument("--json", default="", help="write what was done to this file")
    a = ap.parse_args(argv)
    return cli.run(ap.prog, lambda: _main(a), a.debug)


def _main(a) -> int:
    t0 = time.monotonic()
    if a.max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens {a.max_num_batched_tokens}: must be >= 1")
    if a.workers is not None and a.workers < 1:
        raise UsageError(f"--workers {a.workers}: must be >= 1")
    cfg = _config(a.model_dir)
    doc: dict = {"model_dir": a.model_dir, "max_num_batched_tokens": a.max_num_batched_tokens}

    def done(why: str) -> int:
        doc.update(result=why, seconds=round(time.monotonic() - t0, 1))
        print(f"dsv4-prewarm-kernels: {why}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        return 0

    if jit.cache_dir() is None:
        return done(f"nothing to do: the kernel cache is off (${jit.CACHE_ENV}=0)")
    if os.environ.get("CUTEDSL_BACKEND", "sm90") != "sm90":
        return done(f"nothing to do: CUTEDSL_BACKEND={os.environ['CUTEDSL_BACKEND']}")
    found = _driver_gpu()
    if found is None:
        return done("nothing to do: no CUDA GPU visible")
    gpu, arch = found
    try:
        fmt = detect_format(cfg)
    except ValueError as e:
        return done(f"nothing to do: {e}")
    doc.update(gpu=gpu.name, sms=gpu.num_sms, arch=arch, format=fmt)
    if not arch.startswith("sm_9"):
        return done(f"nothing to do: {gpu.name} ({arch}) is not served by the sm90 kernels")
    os.environ["CUTE_DSL_ARCH"] = arch  # the cache key's arch, without touching CUDA here
    jobs = kernel_jobs(cfg, a.max_num_batched_tokens, gpu)
    doc["kernels"] = len({(j.build, j.args, j.kwargs) for j in jobs})
    if not jobs:
        return done(f"nothing to do: no NVFP4 layer of ours in this {doc['format']} checkpoint")
    started = jit.prefetch(jobs, a.workers)
    doc["compiled"] = started
    failed = [(log, rc) for log, rc in jit.wait_all() if rc != 0]
    doc["failed_workers"] = [f"exit {rc}: {log}" for log, rc in failed]
    for log, rc in failed:
        print(f"dsv4-prewarm-kernels: a compile process exited {rc} (see {log})", file=sys.stderr)
    done(
        f"{doc['kernels']} kernels for {gpu.name}: {started} compiled now, the rest cached "
        f"({len(failed)} compile processes failed)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
