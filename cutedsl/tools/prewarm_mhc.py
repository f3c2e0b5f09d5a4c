"""Compile vLLM's token-count-dependent mHC TileLang kernels before a DeepSeek V4 server starts.

    dsv4-prewarm-mhc MODEL_DIR [--workers N] [--timeout S] [--json F]
    (or python -m cutedsl.tools.prewarm_mhc ...)

vLLM 0.21.0's mHC ops (`vllm.model_executor.layers.mhc`) pick a split-K count from the number of
tokens in the step (`compute_num_split`), and the split count is a compile-time argument of the
TileLang kernel `mhc_pre_big_fuse_tilelang`: every new split count compiles on first use, about
10 s each, inside the engine step, stalling every running request. (H200, 2026-12-03: 14 such
compiles during a 64-client soak gave a TTFT p99 of 62 s and 11 client time-outs.) TileLang
keeps compiled kernels in its disk cache (TILELANG_CACHE_DIR, default ~/.tilelang/cache), which
every process on the machine shares, so compiling them once here, in parallel processes, before
`vllm serve` means the server only loads them.

The token counts come from vLLM's own `compute_num_split` (one per distinct split count, up to the
first count where it reaches 1, beyond which nothing new compiles) plus the small-batch fused
path (1 and 8 tokens); the kernel arguments (hidden size, hc_mult, the epsilons, the Sinkhorn
iterations) from the checkpoint's config.json, as the model passes them. It calls the registered
vLLM ops (torch.ops.vllm.mhc_pre, mhc_fused_post_pre, mhc_post, hc_head_fused_kernel) on random
inputs: nothing of vLLM is patched. Needs a CUDA GPU. Exit status 0 when every call ran.

The same calls run vLLM's mHC GEMM, DeepGEMM's `tf32_hc_prenorm_gemm`, whose split count is a
compile-time argument too: DeepGEMM keeps those kernels in its own JIT cache (DG_JIT_CACHE_DIR,
which vLLM sets to VLLM_CACHE_ROOT/deep_gemm), one folder per kernel, named by a hash that
includes its compile flags and with them the path of the DeepGEMM package's headers: a vLLM
installed at another path compiles them again.

Fast path: after a run in which every call succeeded, a stamp
(`<TILELANG_CACHE_DIR>/cutedsl-prewarm-mhc/<fingerprint>.json`) lists the TileLang cache entries
the workers compiled or loaded (the in-memory cache keys of TileLang's per-backend caches) and
the files each complete entry has on disk, and the mHC GEMM entries complete in DeepGEMM's cache
after the run, with their files. The fingerprint is everything that decides which kernels are
needed and where they are found (the mHC arguments, the GPU's name and SM count, the vLLM,
TileLang and torch versions, the DeepGEMM package's path and its cache folder). When the stamp of
this fingerprint exists and every entry it lists still has all its files, the prewarm stops
there: no worker process, no vLLM import, no kernel load. Anything else (no stamp, a missing or
incomplete entry, an unreadable stamp) runs the full prewarm, which writes a new stamp.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cutedsl.tools import cli
from cutedsl.tools.cli import UsageError

# config.json keys the DeepSeek V4 decoder layer reads for its mHC calls (vllm deepseek_v4.py),
# and the defaults vLLM's hf_config (transformers 5.17.0 DeepseekV4Config) gives the absent ones.
CONFIG_KEYS = ("hidden_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps")
CONFIG_DEFAULTS = {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "rms_norm_eps": 1.0e-6}
SMALL_BATCH = (1, 8)  # mhc_fused_post_pre's fused path: < 8 and 8..16 tokens compile apart
BLOCK_M = 64  # the token tile of vLLM's split-count choice ("these number are from deepgemm")
BLOCK_K = 64


def mhc_config(model_dir: str | Path) -> dict:
    """The mHC arguments of one checkpoint, from its config.json; UsageError naming the file."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        what = "is not a folder" if Path(model_dir).exists() else "does not exist"
        raise UsageError(f"MODEL_DIR {model_dir} {what}")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} not found") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path} is not a JSON object")
    if cfg.get("model_type") != "deepseek_v4" or "hidden_size" not in cfg:
        raise UsageError(
            f"{path} is not a DeepSeek V4 config (model_type "
            f"{cfg.get('model_type')!r}, hidden_size {cfg.get('hidden_size')!r})"
        )
    out = {k: cfg.get(k, CONFIG_DEFAULTS.get(k)) for k in CONFIG_KEYS}
    for k in ("hidden_size", "hc_mult", "hc_sinkhorn_iters"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{path}: {k} must be an integer >= 1, got {v!r}")
    for k in ("hc_eps", "rms_norm_eps"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UsageError(f"{path}: {k} must be a finite number, got {v!r}")
    return out


def token_counts(num_split: Callable[[int], int], limit: int = 1 << 20) -> list[int]:
    """One token count per distinct split count of `num_split(grid)` (grid = token tiles of
    BLOCK_M), the largest count of each run of equal splits, walking grids until the split count
    reaches 1; then the small-batch counts. Sorted, distinct."""
    counts: dict[int, int] = {}
    grid = 1
    while grid * BLOCK_M <= limit:
        s = num_split(grid)
        counts[s] = grid * BLOCK_M  # the last grid of this split count seen so far
        if s <= 1:
            break
        grid += 1
    else:
        raise RuntimeError(f"split count never reached 1 up to {limit} tokens")
    return sorted(set(counts.values()) | set(SMALL_BATCH))


def _vllm_num_split(hc_hidden: int) -> Callable[[int], int]:
    from vllm.model_executor.layers.mhc import compute_num_split

    return lambda grid: compute_num_split(BLOCK_K, hc_hidden, grid)


def _run_counts(cfg: dict, counts: list[int], done: mp.Queue | None) -> None:
    """Call each mHC op once per token count (compiling or loading its kernels)."""
    import torch
    import vllm.model_executor.layers.mhc  # noqa: F401  registers torch.ops.vllm.mhc_*

    h, hc = cfg["hidden_size"], cfg["hc_mult"]
    hc3 = (2 + hc) * hc
    eps, hc_eps, iters = cfg["rms_norm_eps"], cfg["hc_eps"], cfg["hc_sinkhorn_iters"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(shape, generator=g, device=dev) * scale).to(dtype)

    fn, base, scale = rnd(hc3, hc * h, scale=0.01), rnd(hc3), rnd(3)
    head_fn, head_base, head_scale = rnd(hc, hc * h, scale=0.01), rnd(hc), rnd(1)
    for t in counts:
        res = rnd(t, hc, h, dtype=torch.bfloat16)
        post, comb, x = torch.ops.vllm.mhc_pre(
            res, fn, scale, base, eps, hc_eps, hc_eps, 2.0, iters
        )
        x = x.clone()
        torch.ops.vllm.mhc_fused_post_pre(
            x, res, post, comb, fn, scale, base, eps, hc_eps, hc_eps, 2.0, iters
        )
        torch.ops.vllm.mhc_post(x, res, post, comb)
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        torch.ops.vllm.hc_head_fused_kernel(
            res, head_fn, head_scale, head_base, out, h, eps, hc_eps, hc
        )
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise RuntimeError(f"hc_head_fused_kernel gave non-finite values at {t} tokens")
        if done is not None:
            done.put(t)


def _tilelang_cache_keys() -> tuple[str, dict[str, list[str]]] | None:
    """(TileLang's kernel cache folder, {key: the files of its complete disk entry}) for every
    kernel this process compiled or loaded, or None when this TileLang does not expose them.

    TileLang keeps one cache per execution backend (`tilelang.cache._dispatch_map`: tvm_ffi,
    cython, nvrtc, ...), each a singleton of its own subclass with its own memory cache and its own
    entry files (tvm_ffi stores `executable.so`, cython `kernel_lib.so`): a bare `KernelCache()` is
    a separate, empty instance."""
    try:
        from tilelang.cache import _dispatch_map
        from tilelang.cache.kernel_cache import KernelCache

        entries: dict[str, list[str]] = {}
        for cache in {id(c): c for c in _dispatch_map.values()}.values():
            for key in list(cache._memory_cache):
                path = cache._get_cache_path(key)
                files = cache._get_complete_cache_files(path)
                entries[key] = sorted(os.path.relpath(f, path) for f in files)
        return KernelCache._get_cache_root(), entries
    except (ImportError, AttributeError):
        return None


DEEPGEMM_MHC = (
    "kernel.*hc_prenorm*"  # DeepGEMM's cache folders of the mHC GEMM (cache/kernel.NAME.HASH)
)


def deepgemm_location() -> dict[str, str | None]:
    """Where a process of this environment would take DeepGEMM from and keep its compiled kernels,
    found without importing anything: `package`, vLLM's choice (an installed `deep_gemm` first,
    else the copy vendored in vLLM; None when neither exists) and `cache`, its JIT cache folder
    (DG_JIT_CACHE_DIR, else VLLM_CACHE_ROOT/deep_gemm, as vLLM sets it)."""
    package = None
    spec = importlib.util.find_spec("deep_gemm")  # a top-level name: found, not imported
    if spec is not None and spec.origin:
        package = os.path.dirname(spec.origin)
    else:
        spec = importlib.util.find_spec("vllm")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            vendored = Path(loc) / "third_party" / "deep_gemm"
            if (vendored / "__init__.py").is_file():
                package = str(vendored)
                break
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    vllm_root = os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", os.path.join(xdg, "vllm")))
    cache = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(vllm_root, "deep_gemm")
    return {"package": package, "cache": cache}


def _deepgemm_entries() -> tuple[str, dict[str, list[str]]]:
    """(DeepGEMM's JIT cache folder, {entry: its files}) for the mHC GEMM entries complete there
    (their cubin written) after this process's calls; ("", {}) when this process never set up
    DeepGEMM (vLLM sets DG_JIT_CACHE_DIR on its first DeepGEMM call)."""
    root = os.environ.get("DG_JIT_CACHE_DIR", "")
    if not root:
        return "", {}
    found = sorted((Path(root) / "cache").glob(DEEPGEMM_MHC))
    entries = {
        e.name: sorted(f.name for f in e.iterdir() if f.is_file()) for e in found if e.is_dir()
    }
    return root, {k: v for k, v in entries.items() if "kernel.cubin" in v}


def _worker(cfg: dict, counts: list[int], done: mp.Queue, errors: mp.Queue, used: mp.Queue) -> None:
    try:
        _run_counts(cfg, counts, done)
        used.put((_tilelang_cache_keys(), _deepgemm_entries()))
    except BaseException as e:  # reported by the parent (the counts not yet done name the failure)
        errors.put(f"{type(e).__name__}: {e} (this worker's token counts: {counts})"[:2000])
        raise SystemExit(1) from None


STAMP_DIR = "cutedsl-prewarm-mhc"


def fingerprint(cfg: dict, gpu: tuple[str, int], deep_gemm: dict | None = None) -> dict:
    """What decides the mHC kernels a server needs and where it finds them: the checkpoint's mHC
    arguments, the GPU (name, SM count: vLLM's split count reads the SM count), the versions of
    vLLM, TileLang and torch (read from the installed metadata: nothing is imported) and
    `deep_gemm`, DeepGEMM's package and cache folders (`deepgemm_location()`)."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "none"

    return {"config": cfg, "gpu": list(gpu), "deep_gemm": deep_gemm,
            "versions": {d: ver(d) for d in ("vllm", "tilelang", "torch")}}  # fmt: skip


def stamp_path(cache: str | Path, fp: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache) / STAMP_DIR / f"{digest}.json"


def _missing(root: Path, kernels: dict) -> list[str]:
    return [k for k, files in kernels.items() if not files
            or not all((root / k / f).is_file() for f in files)]  # fmt: skip


def cached_everything(cache: str | Path, fp: dict) -> tuple[bool, str]:
    """(True, what) when the stamp of `fp` lists only complete TileLang and DeepGEMM entries;
    else (False, why not)."""
    path = stamp_path(cache, fp)
    try:
        stamp = json.loads(path.read_text())
        root, kernels = Path(stamp["cache_root"]), stamp["kernels"]
        dg = stamp.get("deep_gemm") or {"cache": "", "kernels": {}}
        dg_root, dg_kernels = Path(dg["cache"]) / "cache", dg["kernels"]
        if stamp["fingerprint"] != fp:
            return False, f"{path} is of another configuration"
        if not isinstance(kernels, dict) or not kernels or not isinstance(dg_kernels, dict):
            return False, f"{path} lists no kernels"
        missing, dg_missing = _missing(root, kernels), _missing(dg_root, dg_kernels)
    except FileNotFoundError:
        return False, "no stamp of a previous prewarm"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"{path} unreadable ({type(e).__name__})"
    if missing:
        return False, f"{len(missing)} of {len(kernels)} kernels no longer in {root}"
    if dg_missing:
        return (
            False,
            f"{len(dg_missing)} of {len(dg_kernels)} DeepGEMM kernels no longer in {dg_root}",
        )
    dg_what = f" and {len(dg_kernels)} DeepGEMM kernels in {dg_root}" if dg_kernels else ""
    return True, f"{len(kernels)} kernels in {root}{dg_what}"


def write_stamp(
    cache: str | Path, fp: dict, used: list, deep_gemm: list | None = None
) -> Path | None:
    """Record the kernels the workers used, each with the files of its complete entry (atomically:
    a temporary file renamed into place), and the DeepGEMM entries they reported (`deep_gemm`:
    one (cache folder, {entry: files}) per worker, as `_deepgemm_entries` gives). None, and
    nothing written, when a worker could not report, the workers disagree on a cache folder, no
    TileLang kernel was reported, or DeepGEMM's folder is not the fingerprint's."""
    if not used or any(u is None for u in used) or len({u[0] for u in used}) != 1:
        return None
    kernels: dict[str, list[str]] = {}
    for _, entries in used:
        kernels.update(entries)
    if not kernels:
        return None
    dg_kernels: dict[str, list[str]] = {}
    dg_cache = ""
    if deep_gemm:
        if len({d[0] for d in deep_gemm}) != 1:
            return None
        dg_cache = deep_gemm[0][0]
        looked_in = (fp.get("deep_gemm") or {}).get("cache")
        if dg_cache and looked_in and dg_cache != looked_in:
            return None  # the workers' folder is not the one a later check looks in
        for _, entries in deep_gemm:
            dg_kernels.update(entries)
    path = stamp_path(cache, fp)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    doc = {"fingerprint": fp, "cache_root": used[0][0], "kernels": kernels,
           "deep_gemm": {"cache": dg_cache, "kernels": dg_kernels}}  # fmt: skip
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def split_work(counts: list[int], workers: int) -> list[list[int]]:
    """Round-robin from the largest count (the largest tensors and, usually, the slowest calls)."""
    order = sorted(counts, reverse=True)
    parts = [order[i::workers] for i in range(max(1, min(workers, len(order))))]
    return [p for p in parts if p]


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.prewarm_mhc", "dsv4-prewarm-mhc", __doc__)
    ap.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="checkpoint folder (its config.json gives the mHC arguments)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="parallel processes (each compiles its own token counts; default: half the CPUs, <= 8)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds for the whole prewarm (> 0); then the workers are stopped and it fails",
    )
    ap.add_argument("--json", default="", help="write the counts and timings to this file")
    a = ap.parse_args(argv)
    if a.workers < 1:
        ap.error(f"argument --workers: must be >= 1, got {a.workers}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        ap.error(f"argument --timeout: must be a positive number of seconds, got {a.timeout}")
    return cli.run(ap.prog, lambda: _main(a), a.debug)


def _write_json(path: str, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2))


def _main(a) -> int:
    if a.json:
        parent = Path(a.json).resolve().parent
        if Path(a.json).is_dir():
            raise UsageError(f"--json {a.json} is a folder; give a file name")
        if not parent.is_dir():
            raise UsageError(f"--json {a.json}: folder {parent} does not exist")
    cfg = mhc_config(a.model)

    import torch

    if not torch.cuda.is_available():
        raise UsageError("no CUDA GPU is visible (the kernels compile for it)")
    cache = os.environ.get("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    fp = fingerprint(cfg, (props.name, props.multi_processor_count), deepgemm_location())
    ready, what = cached_everything(cache, fp)
    if ready:
        print(f"prewarm_mhc: nothing to do, {what} (stamp {stamp_path(cache, fp)})", flush=True)
        if a.json:
            _write_json(a.json, {"config": cfg, "cached": True, "seconds": 0.0, "ok": True,
                                 "errors": []})  # fmt: skip
        return 0
    print(f"prewarm_mhc: compiling or loading ({what})", flush=True)
    counts = token_counts(_vllm_num_split(cfg["hc_mult"] * cfg["hidden_size"]))
    parts = split_work(counts, a.workers)
    print(
        f"prewarm_mhc: {len(counts)} token counts {counts} in {len(parts)} processes "
        f"(hidden {cfg['hidden_size']}, hc_mult {cfg['hc_mult']}; TileLang cache {cache})",
        flush=True,
    )
    from tqdm import tqdm

    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    done, errors, used_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(cfg, p, done, errors, used_q)) for p in parts]
    finished = 0
    timed_out = False
    try:
        for p in procs:
            p.start()
        with tqdm(total=len(counts), desc="prewarm_mhc", unit="count") as bar:
            while finished < len(counts):
                if time.monotonic() - t0 > a.timeout:
                    timed_out = True
                    break
                try:
                    done.get(timeout=1.0)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        break  # a worker failed: its error is in `errors`
                    continue
                finished += 1
                bar.update(1)
    except BaseException:  # SIGTERM / Ctrl-C (cutedsl.tools.cli): stop the workers too
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise
    used, dg_used = [], []
    if not timed_out:  # each worker reports its keys before it exits (read before join)
        for p in procs:
            while p.is_alive() or not used_q.empty():
                try:
                    tilelang, deep_gemm = used_q.get(timeout=1.0)
                    used.append(tilelang)
                    dg_used.append(deep_gemm)
                    break
                except queue.Empty:
                    continue
    for p in procs:
        if timed_out:
            p.terminate()
        p.join()
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    failed += [f"a worker exited with code {p.exitcode}" for p in procs if p.exitcode]
    if timed_out:
        failed.append(f"timed out after {a.timeout:.0f} s with {finished} of {len(counts)} done")
    seconds = round(time.monotonic() - t0, 1)
    stamp = None if failed else write_stamp(cache, fp, used, dg_used)
    if a.json:
        _write_json(a.json, {"config": cfg, "cached": False, "token_counts": counts,
                             "workers": len(parts), "seconds": seconds, "ok": not failed,
                             "errors": failed, "stamp": str(stamp) if stamp else None})  # fmt: skip
    if not failed and stamp is None:
        print("prewarm_mhc: warning: the cache entries were not readable (TileLang's) or not where "
              f"they are looked for (DeepGEMM's: {fp['deep_gemm']['cache']}); no stamp written "
              "(the next start runs the full prewarm again)", file=sys.stderr)  # fmt: skip
    if failed:
        for f in failed:
            print(f"prewarm_mhc: error: {f}", file=sys.stderr)
        return 1
    print(f"prewarm_mhc: {len(counts)} token counts ready in {seconds} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
