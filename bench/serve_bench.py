#!/usr/bin/env python3
"""Serving benchmark of a running OpenAI-compatible vLLM server through `vllm bench serve`.

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --model DIR --label NAME
        [--shapes 1024x1024,8192x1024] [--concurrency 1,8,32,64]
        [--prompts-per-concurrency 2 | --num-prompts N] [--seed 0] [--time-budget S]
        [--run-timeout S] [--min-run-s S] [--max-model-len N] [--fit-margin 16] [--log-dir DIR]
        [--resume] [--warmup-requests N] [--repeats N] [--in-process] [--server-log FILE]
        --out FILE.json

For every shape INxOUT (prompt tokens x output tokens) and every concurrency C it runs the real
benchmark CLI of the installed vLLM as a subprocess (`python -m vllm.entrypoints.cli.main bench
serve`, random dataset, --random-range-ratio 0, --ignore-eos, --max-concurrency C, greedy), reads
the result JSON that CLI saves, and appends one record to --out. The JSON is rewritten after
every run, so a run killed from outside keeps every finished record.

Shapes are "scaled to fit": when IN+OUT exceeds the server's max_model_len (read from
/v1/models, or --max-model-len) minus --fit-margin, both lengths are scaled by the same factor
(floored); the record keeps the requested and the effective shape.

Output JSON: {"header": {command, date (UTC ISO), device (nvidia-smi name or "unknown"),
vllm_version, base_url, model, label, max_model_len, bench_flags}, "runs": [record, ...]}. A
record: label, requested_shape, shape, input_len, output_len, concurrency, num_prompts, status
("ok" | "failed" | "timeout" | "skipped" | "interrupted"), completed, failed, duration (s, the
CLI's own benchmark duration), wall_s (subprocess wall time, including the CLI's vLLM import),
output_throughput / total_token_throughput (tok/s), request_throughput (req/s),
{mean,median,p90,p99}_{ttft,tpot,itl,e2el}_ms, total_input_tokens, total_output_tokens,
max_output_tokens_per_s, command (exact argv as a shell string), server (the change over the
run of the server's own counters from /metrics: preemptions, queue_s, engine_steps,
prefix_cache_hit_tokens; null when /metrics cannot be read), compiles (with --server-log: the
compiles the server's log reports during the run, {n, kinds, lines}: a first-use stall inside the
measurement; `cache_files`, {KIND or KIND/SUBFOLDER: n}, the compiled-kernel files the JIT
caches gained or rewrote during the run, see --watch-cache, `new_cache_files`, the first 10 of
them, and `kernels`, {"KIND: NAME": n} of the binaries among them), requests (per request in the CLI's order: start_s after the run's first request,
ttft_ms; which wave a slow TTFT belongs to), and error (tail of the CLI's output) when status is
not "ok". "ok" means rc 0 and completed == num_prompts.

--time-budget S: no new run starts once the remaining budget is smaller than the previous run's
wall time or --min-run-s (those runs are recorded as "skipped"); each run's timeout is also
capped at the remaining budget.

--resume: keep the runs already in --out (a driver calling this once per point, over several
calls); a point (effective shape, concurrency) with an "ok" record there is not run again, a
record that was not ok is replaced when its point runs. The first header is kept; each resumed
invocation is appended to header.resumed (command, date).

--seed-per-run: the random dataset's seed is --seed plus the run's index, so no run repeats an
earlier run's prompts (the server's prefix cache would serve them).
--repeats N: run every point N times (all points once, then all again); records carry
`repeat` (0-based). --in-process: call the CLI's own code (`vllm.benchmarks.serve.main`, the same
arguments) in this process instead of a subprocess per run, which saves the CLI's start (~15-20 s of
imports per run); a run is then not killed at its timeout (the driver's own timeout is the limit).

--warmup-requests N: before the first run of a shape, N concurrent non-streamed requests of that
shape's prompt length (random token ids, --warmup-max-tokens tokens, greedy), so that first-use
JIT compilation (Triton, TileLang) of the server is out of the measured runs; recorded in
header.warmups (shape, n, wall_s, errors), counted in the time budget, and done once per shape
across resumed invocations. --warmup-per-concurrency: instead, before the first run of each
(shape, concurrency) point, one wave of `concurrency` such requests, so that every prefill token
count the measured runs batch (concurrency x prompt length, up to the server's chunk) has been
seen once (first-use compiles belong to the start-up benchmark, not to a steady-state point).
--watch-cache KIND=DIR (repeatable; default: vLLM's cache folder, which holds torch.compile's and
DeepGEMM's caches and, once torch.compile has run, Triton's; Triton's own folder; TileLang's; ours;
each where its environment variable or default puts it): the compiled-kernel files a cache gains
or rewrites during a run are that run's compiles too. The log alone undercounts: vLLM 0.21.0 warns once per Triton
kernel name (`logger.warning_once` in vllm/triton_utils/jit_monitor.py), and a kernel
recompiled for a new specialization of its integer arguments (Triton specializes on divisibility
by 16) compiles silently. --retry-on-compile N: a run during which anything compiled is run again
(a new dataset seed), up to N times; the record is the last attempt, the earlier ones are kept in
its `discarded` list (tok/s, TTFT, TPOT, duration, compiles), so a steady-state point is not
measured across a compile stall, and the table can say how often one happened.
SIGTERM (a driver's `timeout`) or Ctrl-C kills the running CLI's process group,
records that run as "interrupted" and exits 143 (130). Exit status otherwise: 0 when every run
that was started is "ok", 1 when one was not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import startup  # noqa: E402

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,90,99"
_STATS = ("mean", "median", "p90", "p99")
_COPY = (
    "completed",
    "failed",
    "duration",
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
    "total_input_tokens",
    "total_output_tokens",
    "max_output_tokens_per_s",
)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1024x1024,8192x1024' -> [(1024, 1024), (8192, 1024)]; each length must be >= 1."""
    shapes = []
    for part in text.split(","):
        try:
            a, b = part.strip().lower().split("x")
            shape = (int(a), int(b))
        except ValueError:
            raise ValueError(f"--shapes: {part!r} is not INxOUT (e.g. 1024x1024)") from None
        if min(shape) < 1:
            raise ValueError(f"--shapes: {part!r}: lengths must be >= 1")
        shapes.append(shape)
    return shapes


def parse_ints(text: str, name: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; each value must be >= 1."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of ints") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{name}: {text!r}: values must be >= 1")
    return vals


def fit_shape(input_len: int, output_len: int, max_model_len: int | None, margin: int) -> tuple:
    """Scale (input_len, output_len) by one factor so that in + out <= max_model_len - margin.

    Returns the shape unchanged when it fits or max_model_len is None; raises ValueError when
    nothing >= 1x1 fits."""
    if max_model_len is None:
        return input_len, output_len
    limit = max_model_len - margin
    if input_len + output_len <= limit:
        return input_len, output_len
    f = limit / (input_len + output_len)
    a, b = math.floor(input_len * f), math.floor(output_len * f)
    if a < 1 or b < 1:
        raise ValueError(
            f"shape {input_len}x{output_len} cannot fit max_model_len {max_model_len} "
            f"with margin {margin}"
        )
    return a, b


def should_skip(remaining_s: float | None, prev_wall_s: float | None, min_s: float = 0.0) -> bool:
    """Budget rule: skip when a budget is set and what remains is below the previous run's wall
    time or min_s (or nothing remains). The first run (prev_wall_s None) starts while more than
    min_s remains."""
    if remaining_s is None:
        return False
    if remaining_s <= 0 or remaining_s < min_s:
        return True
    return prev_wall_s is not None and remaining_s < prev_wall_s


def warmup(base_url: str, model: str, prompt_len: int, n: int, max_tokens: int, seed: int,
           timeout: float) -> dict:  # fmt: skip
    """n concurrent greedy non-streamed /v1/completions of prompt_len random token ids."""
    import http.client
    import random
    import threading
    import urllib.parse

    u = urllib.parse.urlparse(base_url)
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(prompt_len)] for _ in range(n)]
    errors: list[str] = []

    def one(prompt: list[int]) -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        try:
            conn.request("POST", u.path.rstrip("/") + "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                errors.append(f"HTTP {r.status}: {data[:200]!r}")
        except (OSError, http.client.HTTPException) as e:
            errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout - (time.monotonic() - t0)))
    if any(t.is_alive() for t in threads):
        errors.append(f"warm-up still running after {timeout:.0f} s")
    return {"n": n, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "wall_s": round(time.monotonic() - t0, 2), "errors": errors[:5]}  # fmt: skip


# Lines a server logs when something compiles (a shape's first use): the JIT of each kind that can
# run inside an engine step. One compile stalls every request in that step.
COMPILE_PATTERNS = {
    "triton": re.compile(r"Triton kernel JIT compilation during inference|Triton autotuning for"),
    "tilelang": re.compile(r"TileLang begins to compile kernel"),
    "cutedsl": re.compile(r"cutedsl\.jit: (compiling|.*recompiling)"),
    "torch.compile": re.compile(
        r"Compiling a graph for|torch\.compile takes|Recompiling function|recompile_limit|"
        r"Dynamo bytecode transform time"
    ),
}


def compile_lines(lines: list[str]) -> list[dict]:
    """The lines of a server log that report a compile, each {kind, line}."""
    out = []
    for ln in lines:
        for kind, pat in COMPILE_PATTERNS.items():
            if pat.search(ln):
                out.append({"kind": kind, "line": ln.strip()[:300]})
                break
    return out


def log_size(path: Path | None) -> int | None:
    """Bytes in the server log now (None: no log given, or none there yet)."""
    try:
        return path.stat().st_size if path is not None else None
    except OSError:
        return None


def compiles_since(path: Path | None, pos: int | None) -> dict | None:
    """The compiles the server log reports after byte `pos`: {n, kinds: {kind: n}, lines: the
    first 3}; None without a log. A log that shrank (rotated, restarted) is read whole."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            if pos is not None and f.seek(0, os.SEEK_END) >= pos:
                f.seek(pos)
            else:
                f.seek(0)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    ev = compile_lines(text.splitlines())
    kinds: dict[str, int] = {}
    for e in ev:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return {"n": len(ev), "kinds": kinds, "lines": [e["line"] for e in ev[:3]]}


def default_caches() -> dict[str, Path]:
    """The JIT caches a DSv4 server compiles into, where the server's environment (the same as
    this process's) puts them: vLLM's (VLLM_CACHE_ROOT, $XDG_CACHE_HOME/vllm, ~/.cache/vllm:
    torch.compile's, the Triton kernels compiled after it points TRITON_CACHE_DIR there, and
    DeepGEMM's unless DG_JIT_CACHE_DIR says otherwise), Triton's own (TRITON_CACHE_DIR,
    ~/.triton/cache), TileLang's (TILELANG_CACHE_DIR, ~/.tilelang/cache) and ours
    (CUTEDSL_CACHE_DIR, ~/.cache/cutedsl)."""
    env = os.environ.get
    xdg = Path(env("XDG_CACHE_HOME") or Path.home() / ".cache")
    caches = {
        "vllm": Path(env("VLLM_CACHE_ROOT") or xdg / "vllm"),
        "triton": Path(env("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"),
        "tilelang": Path(env("TILELANG_CACHE_DIR") or Path.home() / ".tilelang" / "cache"),
        "cutedsl": Path(env("CUTEDSL_CACHE_DIR") or Path.home() / ".cache" / "cutedsl"),
    }
    if env("DG_JIT_CACHE_DIR"):
        caches["deepgemm"] = Path(env("DG_JIT_CACHE_DIR"))
    return caches


def cache_snapshot(caches: dict[str, Path]) -> dict[str, dict]:
    """Per cache: relative path -> (size, mtime) of every compiled-kernel file in it (startup.py's
    snapshot: locks, temporaries and logs left out)."""
    return {kind: startup.snapshot(d) for kind, d in caches.items()}


def cache_changes(
    before: dict[str, dict], after: dict[str, dict]
) -> tuple[dict[str, int], list[str]]:
    """The kernel files created or changed between two snapshots: their count per "KIND/SUBFOLDER"
    ("KIND" for those directly in the cache's folder: which JIT wrote them, e.g. vllm/deep_gemm,
    vllm/torch_compile_cache for Triton once torch.compile has run), and their paths."""
    counts: dict[str, int] = {}
    paths: list[str] = []
    for kind, snap in after.items():
        for rel in startup.changed(before.get(kind, {}), snap):
            head, sep, _ = rel.partition("/")
            key = f"{kind}/{head}" if sep else kind
            counts[key] = counts.get(key, 0) + 1
            paths.append(f"{kind}/{rel}")
    return counts, paths


def compiled_kernels(paths: list[str]) -> dict[str, int]:
    """The kernels behind changed cache files, {KIND: NAME: n}, one per compiled binary: Triton's
    `NAME.cubin` (and its launcher, `__triton_launcher*.so`), DeepGEMM's
    `kernel.NAME.HASH/kernel.cubin`, our `DIGEST-SHA.o`, any other `*.so` (TileLang's) by its
    folder. Other files (sources, IR, records) name no new binary."""
    out: dict[str, int] = {}
    for p in paths:
        kind, _, rel = p.partition("/")
        parts = rel.split("/")
        base, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
        if base == "kernel.cubin" and parent.startswith("kernel."):
            name = parent.split(".")[1]  # DeepGEMM
        elif base.endswith(".cubin"):
            name = base[: -len(".cubin")]  # Triton
        elif base.startswith("__triton_launcher"):
            name = "triton launcher"
        elif base.endswith(".o"):
            name = "cutedsl kernel"
        elif base.endswith(".so"):
            name = f"{parent or kind} library"
        else:
            continue
        key = f"{kind}: {name}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def compiled(rec: dict) -> bool:
    """Whether anything compiled during the run: a compile line in the log or a new cache file."""
    c = rec.get("compiles") or {}
    return bool(c.get("n") or c.get("cache_files"))


# vLLM 0.21.0's cumulative server-side series (Prometheus names of its V1 metrics) whose change
# over one run explains that run: requests preempted for KV room, seconds requests waited in the
# queue (summed), engine steps, prompt tokens served from the prefix cache.
SERVER_SERIES = {
    "preemptions": "vllm:num_preemptions_total",
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "engine_steps": "vllm:iteration_tokens_total_count",
    "prefix_cache_hit_tokens": "vllm:prefix_cache_hits_total",
}


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{.*\})?\s+(\S+)")


def metric_samples(text: str) -> dict[str, list[float]]:
    """Prometheus text -> {series name: its values, one per label set}."""
    vals: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                vals.setdefault(m[1], []).append(float(m[2]))
            except ValueError:
                continue
    return vals


def parse_series(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: value summed over its label sets}."""
    return {k: sum(v) for k, v in metric_samples(text).items()}


def server_counters(base_url: str, timeout: float = 5.0) -> dict[str, float | None] | None:
    """SERVER_SERIES from the server's /metrics (None per series it does not report); None when
    /metrics cannot be read."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            vals = parse_series(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return {k: vals.get(name) for k, name in SERVER_SERIES.items()}


def counter_delta(before: dict | None, after: dict | None) -> dict[str, float | None] | None:
    """after - before per series (None where either side lacks it); None without both reads."""
    if before is None or after is None:
        return None
    return {
        k: None if before.get(k) is None or after.get(k) is None else round(after[k] - before[k], 3)
        for k in SERVER_SERIES
    }


def server_max_model_len(base_url: str, model: str, timeout: float = 10.0) -> int | None:
    """max_model_len of `model` (or of the only/first model) from GET {base_url}/v1/models."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout) as r:
            data = json.loads(r.read()).get("data") or []
    except (OSError, ValueError) as e:
        print(f"serve_bench: /v1/models unreadable ({e}); no shape fitting", file=sys.stderr)
        return None
    cards = [c for c in data if c.get("id") == model] or data[:1]
    return cards[0].get("max_model_len") if cards else None


def device_name() -> str:
    """First GPU's name from nvidia-smi, or "unknown"."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "unknown"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return f"{len(names)}x {names[0]}" if len(names) > 1 else (names[0] if names else "unknown")


def bench_command(a: argparse.Namespace, inp: int, out: int, conc: int, n: int, rdir: str,
                  rfile: str, seed: int | None = None) -> list[str]:  # fmt: skip
    """argv of one `vllm bench serve` run (vLLM 0.21.0 flags); seed: the random dataset's
    (default --seed)."""
    cmd = [
        a.python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm",
        "--base-url", a.base_url.rstrip("/"),
        "--endpoint", "/v1/completions",
        "--model", a.model,
        "--tokenizer", a.tokenizer or a.model,
        "--dataset-name", "random",
        "--random-input-len", str(inp),
        "--random-output-len", str(out),
        "--random-range-ratio", "0",
        "--num-prompts", str(n),
        "--max-concurrency", str(conc),
        "--request-rate", "inf",
        "--ignore-eos",
        "--temperature", str(a.temperature),
        "--seed", str(a.seed if seed is None else seed),
        "--num-warmups", str(a.num_warmups),
        "--percentile-metrics", PERCENTILE_METRICS,
        "--metric-percentiles", METRIC_PERCENTILES,
        "--label", a.label,
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # per-request start times and TTFTs (`_record`)
        "--result-dir", rdir,
        "--result-filename", rfile,
    ]  # fmt: skip
    if a.served_model_name:
        cmd += ["--served-model-name", a.served_model_name]
    if a.tokenizer_mode:
        cmd += ["--tokenizer-mode", a.tokenizer_mode]
    return cmd


class _Interrupted(Exception):
    """SIGTERM arrived (e.g. a driver's `timeout`): the running CLI is killed, its row kept."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def _run(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, float, str]:
    """Run cmd in its own process group, output to `log`; (rc or None on timeout, wall, tail).

    The group is killed on timeout and on any exception (SIGTERM, Ctrl-C) while waiting, so no
    benchmark client outlives this script and keeps loading the server."""
    t0 = time.monotonic()
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 0.1))
        except BaseException as e:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            rc = None
    wall = time.monotonic() - t0
    tail = log.read_text(errors="replace")[-3000:]
    return rc, wall, tail


def _run_in_process(cmd: list[str], log: Path) -> tuple[int, float, str]:
    """One run through `vllm.benchmarks.serve.main` in this process, its output to `log`."""
    import contextlib
    import traceback

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    i = cmd.index("serve")  # [python, -m, vllm.entrypoints.cli.main, bench, serve, flags...]
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    t0 = time.monotonic()
    rc = 0
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        try:
            bench_main(parser.parse_args(cmd[i + 1 :]))
        except (_Interrupted, KeyboardInterrupt):
            raise
        except BaseException:  # noqa: BLE001 - a failed run is a record, not the end
            traceback.print_exc()
            rc = 1
    return rc, time.monotonic() - t0, log.read_text(errors="replace")[-3000:]


def _record(res: dict) -> dict:
    rec = {k: res.get(k) for k in _COPY}
    for m in PERCENTILE_METRICS.split(","):
        for s in _STATS:
            rec[f"{s}_{m}_ms"] = res.get(f"{s}_{m}_ms")
    starts, ttfts = res.get("start_times") or [], res.get("ttfts") or []
    t0 = min(starts, default=0.0)
    rec["requests"] = [
        {"start_s": round(st - t0, 4), "ttft_ms": round(1e3 * tt, 2)}
        for st, tt in zip(starts, ttfts, strict=False)
    ] or None
    return rec


# the keys that name a point (kept when a run is repeated after a compile)
_POINT_KEYS = ("label", "requested_shape", "shape", "input_len", "output_len", "concurrency",
               "num_prompts", "repeat")  # fmt: skip


def _summary(rec: dict) -> dict:
    """What a discarded attempt leaves in its point's record."""
    keys = ("seed", "status", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms",
            "compiles")  # fmt: skip
    return {k: rec.get(k) for k in keys}


def _compile_text(rec: dict) -> str:
    c = rec.get("compiles") or {}
    parts = [f"{k} {v}" for k, v in (c.get("kinds") or {}).items()]
    parts += [f"{k} +{v} files" for k, v in (c.get("cache_files") or {}).items()]
    return ", ".join(parts) or "none"


def _append(doc: dict, rec: dict) -> None:
    """Add rec, replacing an earlier (not ok) record of the same point and repeat (--resume)."""
    key = (rec["shape"], rec["concurrency"], rec.get("repeat", 0))
    doc["runs"] = [
        r for r in doc["runs"] if (r.get("shape"), r.get("concurrency"), r.get("repeat", 0)) != key
    ]
    doc["runs"].append(rec)


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="model id as served (the checkpoint DIR)")
    ap.add_argument("--label", required=True, help="series name, e.g. cutedsl-nvfp4")
    ap.add_argument("--out", required=True, help="result JSON (rewritten after every run)")
    ap.add_argument("--shapes", default="1024x1024,8192x1024", help="INxOUT[,INxOUT...]")
    ap.add_argument("--concurrency", default="1,8,32,64")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prompts-per-concurrency", type=int, default=2,
                   help="num_prompts = this x concurrency (default 2)")  # fmt: skip
    g.add_argument("--num-prompts", type=int, default=None, help="fixed num_prompts per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--num-warmups", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="default: --model")
    ap.add_argument("--tokenizer-mode", default=None, help="passed through when given")
    ap.add_argument("--served-model-name", default=None, help="when the server renamed it")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="override the server's /v1/models max_model_len for fitting")  # fmt: skip
    ap.add_argument(
        "--fit-margin",
        type=int,
        default=16,
        help="tokens kept free below max_model_len when fitting (default 16)",
    )
    ap.add_argument("--no-fit", action="store_true", help="run shapes as given")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for all runs")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--min-run-s", type=float, default=0.0,
                    help="with --time-budget: start no run with less than this left")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="keep and skip the ok runs in --out")
    ap.add_argument("--warmup-requests", type=int, default=0, help="per shape, before its runs")
    ap.add_argument("--warmup-per-concurrency", action="store_true",
                    help="one wave of `concurrency` requests before each point's first run")  # fmt: skip
    ap.add_argument("--warmup-max-tokens", type=int, default=4)
    ap.add_argument("--warmup-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default=None, help="CLI logs (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point (default 1)")
    ap.add_argument(
        "--seed-per-run",
        action="store_true",
        help="dataset seed = --seed + the run's index (no prompt repeats across runs)",
    )
    ap.add_argument("--in-process", action="store_true", help="no subprocess per run")
    ap.add_argument("--server-log", default=None,
                    help="the server's log: each run and warm-up records the compiles it reports")  # fmt: skip
    ap.add_argument("--watch-cache", action="append", default=None, metavar="KIND=DIR",
                    help="a JIT cache whose new kernel files count as compiles (default: vLLM's, Triton's, TileLang's, ours)")  # fmt: skip
    ap.add_argument("--retry-on-compile", type=int, default=0, metavar="N",
                    help="run a point again, up to N times, when something compiled during it")  # fmt: skip
    ap.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes)
        concs = parse_ints(a.concurrency, "--concurrency")
        if a.num_prompts is not None and a.num_prompts < 1:
            raise ValueError(f"--num-prompts {a.num_prompts}: must be >= 1")
        if a.repeats < 1:
            raise ValueError(f"--repeats {a.repeats}: must be >= 1")
        if a.prompts_per_concurrency < 1:
            raise ValueError(f"--prompts-per-concurrency {a.prompts_per_concurrency}: >= 1")
        if a.retry_on_compile < 0:
            raise ValueError(f"--retry-on-compile {a.retry_on_compile}: must be >= 0")
        a.caches = default_caches()
        if a.watch_cache is not None:
            a.caches = {}
            for kv in a.watch_cache:
                kind, sep, d = kv.partition("=")
                if not sep or not kind or not d:
                    raise ValueError(f"--watch-cache {kv!r}: give KIND=DIR")
                a.caches[kind] = Path(d)
    except ValueError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 2

    t_start = time.monotonic()
    max_len = a.max_model_len
    if max_len is None and not a.no_fit:
        max_len = server_max_model_len(a.base_url, a.served_model_name or a.model)
    try:
        fitted = [
            (i, o, *((i, o) if a.no_fit else fit_shape(i, o, max_len, a.fit_margin)))
            for i, o in shapes
        ]
    except ValueError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="serve_bench_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = "not installed"
    header = {
        "command": shlex.join(
            [sys.executable, *sys.argv] if argv is None else ["bench/serve_bench.py", *argv]
        ),  # fmt: skip
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "vllm_version": vllm_version,
        "base_url": a.base_url,
        "model": a.model,
        "label": a.label,
        "max_model_len": max_len,
        "fit_margin": None if a.no_fit else a.fit_margin,
        "log_dir": str(log_dir),
        "watched_caches": {k: str(v) for k, v in a.caches.items()},
        "bench_flags": f"--backend vllm --endpoint /v1/completions --dataset-name random "
        f"--random-range-ratio 0 --ignore-eos --temperature {a.temperature} --seed {a.seed} "
        f"--num-warmups {a.num_warmups} --percentile-metrics {PERCENTILE_METRICS} "
        f"--metric-percentiles {METRIC_PERCENTILES}",
    }
    doc = {"header": header, "runs": []}
    if a.resume and out.exists():
        try:
            old = json.loads(out.read_text())
            doc = {"header": old["header"], "runs": list(old["runs"])}
        except (OSError, ValueError, KeyError) as e:
            print(f"serve_bench: --resume: {out} unreadable ({e!r}); starting it anew",
                  file=sys.stderr)  # fmt: skip
        else:
            doc["header"].setdefault("resumed", []).append(
                {"command": header["command"], "date": header["date"]}
            )
    _write(out, doc)

    old_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _loop(a, fitted, concs, out, log_dir, doc, t_start)
    finally:
        signal.signal(signal.SIGTERM, old_handler)


def _loop(
    a: argparse.Namespace,
    shapes: list[tuple[int, int, int, int]],
    concs: list[int],
    out: Path,
    log_dir: Path,
    doc: dict,
    t_start: float,
) -> int:
    """All runs in order; shapes are (requested in, out, effective in, out); -> exit status."""
    prev_wall: float | None = None
    n_bad = 0
    total = len(shapes) * len(concs) * a.repeats
    done = {
        (r["shape"], r["concurrency"], r.get("repeat", 0))
        for r in doc["runs"]
        if r.get("status") == "ok"
    }
    warmed = {
        w.get("key", w["shape"]) for w in doc["header"].get("warmups", []) if not w.get("errors")
    }
    slog = Path(a.server_log) if a.server_log else None
    with tempfile.TemporaryDirectory(prefix="serve_bench_") as rdir:
        points = [(s, c) for s in shapes for c in concs]
        for i, (rep, ((req_in, req_out, inp, outl), conc)) in enumerate(
            ((rep, p) for rep in range(a.repeats) for p in points), start=1
        ):
            n = a.num_prompts or a.prompts_per_concurrency * conc
            tag = f"{a.label}_{inp}x{outl}_c{conc}" + (f"_r{rep}" if a.repeats > 1 else "")
            if (f"{inp}x{outl}", conc, rep) in done:
                print(f"[{i}/{total}] {tag}: ok in an earlier invocation (--resume)", flush=True)
                continue
            rec = {
                "label": a.label,
                "requested_shape": f"{req_in}x{req_out}",
                "shape": f"{inp}x{outl}",
                "input_len": inp,
                "output_len": outl,
                "concurrency": conc,
                "num_prompts": n,
                "repeat": rep,
            }
            remaining = None
            if a.time_budget is not None:
                remaining = a.time_budget - (time.monotonic() - t_start)
            if should_skip(remaining, prev_wall, a.min_run_s):
                rec["status"] = "skipped"
                rec["error"] = (
                    f"time budget: {remaining:.0f} s left < previous run {prev_wall or 0:.0f}"
                    f" s or --min-run-s {a.min_run_s:.0f} s"
                )
                _append(doc, rec)
                _write(out, doc)
                print(f"[{i}/{total}] {tag}: skipped ({rec['error']})", flush=True)
                continue
            wkey, wn = f"{inp}x{outl}", a.warmup_requests
            if a.warmup_per_concurrency:
                wkey, wn = f"{inp}x{outl}@c{conc}", conc
            if wn > 0 and wkey not in warmed:
                wt = a.warmup_timeout if remaining is None else min(a.warmup_timeout, remaining)
                wpos = log_size(slog)
                w = warmup(a.base_url, a.served_model_name or a.model, inp, wn,
                           a.warmup_max_tokens, a.seed + 1, wt)  # fmt: skip
                w["shape"], w["key"] = f"{inp}x{outl}", wkey
                if slog is not None:
                    w["compiles"] = compiles_since(slog, wpos)
                if a.warmup_per_concurrency:
                    w["concurrency"] = conc
                doc["header"].setdefault("warmups", []).append(w)
                warmed.add(wkey)
                _write(out, doc)
                print(f"[{i}/{total}] warm-up {wkey}: {w['n']} requests, "
                      f"{w['wall_s']:.0f} s, errors {w['errors']}", flush=True)  # fmt: skip
                if a.time_budget is not None:
                    remaining = a.time_budget - (time.monotonic() - t_start)
                    if should_skip(remaining, prev_wall, a.min_run_s):
                        rec["status"] = "skipped"
                        rec["error"] = f"time budget: {remaining:.0f} s left after the warm-up"
                        _append(doc, rec)
                        _write(out, doc)
                        print(f"[{i}/{total}] {tag}: skipped ({rec['error']})", flush=True)
                        continue
            discarded: list[dict] = []
            for attempt in range(1 + a.retry_on_compile):
                if attempt:  # the last attempt compiled: run the point again, if time allows
                    if a.time_budget is not None:
                        remaining = a.time_budget - (time.monotonic() - t_start)
                        if should_skip(remaining, prev_wall, a.min_run_s):
                            break
                    discarded.append(_summary(rec))
                    rec = {k: rec[k] for k in _POINT_KEYS}
                rfile = f"{tag}.json" if not attempt else f"{tag}_a{attempt}.json"
                # One dataset seed per run (and per attempt): a prompt repeated from an earlier
                # run would hit the server's prefix cache.
                rec["seed"] = a.seed + (i - 1 if a.seed_per_run else 0) + attempt * total
                cmd = bench_command(a, inp, outl, conc, n, rdir, rfile, rec["seed"])
                timeout = a.run_timeout if remaining is None else min(a.run_timeout, remaining)
                rec["command"] = shlex.join(cmd)
                before, pos = server_counters(a.base_url), log_size(slog)
                files0 = cache_snapshot(a.caches)
                try:
                    if a.in_process:
                        rc, wall, tail = _run_in_process(cmd, log_dir / f"{tag}.log")
                    else:
                        rc, wall, tail = _run(cmd, timeout, log_dir / f"{tag}.log")
                except (_Interrupted, KeyboardInterrupt) as e:
                    rec["status"] = "interrupted"
                    why = str(e) or "SIGINT"
                    rec["error"] = f"serve_bench stopped by {why}; the CLI was killed"
                    if discarded:
                        rec["discarded"] = discarded
                    _append(doc, rec)
                    _write(out, doc)
                    print(f"[{i}/{total}] {tag}: interrupted; wrote {out}", flush=True)
                    return 143 if isinstance(e, _Interrupted) else 130
                prev_wall = wall
                rec["wall_s"] = round(wall, 2)
                rec["server"] = counter_delta(before, server_counters(a.base_url))
                rec["compiles"] = compiles_since(slog, pos) if slog is not None else None
                grown, new_files = cache_changes(files0, cache_snapshot(a.caches))
                rec["compiles"] = {**(rec["compiles"] or {}), "cache_files": grown,
                                   "new_cache_files": new_files[:10],
                                   "kernels": compiled_kernels(new_files)}  # fmt: skip
                rpath = Path(rdir) / rfile
                if rpath.exists():
                    rec.update(_record(json.loads(rpath.read_text())))
                    rpath.unlink()
                if rc is None:
                    rec["status"] = "timeout"
                elif rc == 0 and rec.get("completed") == n:
                    rec["status"] = "ok"
                else:
                    rec["status"] = "failed"
                if rec["status"] != "ok" or not compiled(rec):
                    break
                print(f"[{i}/{total}] {tag}: compiled during the run "
                      f"({_compile_text(rec)})", flush=True)  # fmt: skip
            if discarded:
                rec["discarded"] = discarded
            if rec["status"] != "ok":
                n_bad += 1
                rec["rc"] = rc
                rec["error"] = tail
            _append(doc, rec)
            _write(out, doc)
            if rec["status"] == "ok":
                msg = (
                    f"out {rec['output_throughput']:.1f} tok/s, "
                    f"TTFT p50 {rec['median_ttft_ms']:.1f} ms, "
                    f"TPOT p50 {rec['median_tpot_ms']:.2f} ms"
                )
                if compiled(rec):
                    msg += f", compiled during the run ({_compile_text(rec)})"
                if discarded:
                    msg += f", {len(discarded)} earlier attempt(s) discarded for compiles"
            else:
                msg = f"rc {rc}, completed {rec.get('completed')}/{n}"
            print(f"[{i}/{total}] {tag} n={n}: {rec['status']} ({wall:.0f} s): {msg}",
                  flush=True)  # fmt: skip
    print(f"serve_bench: wrote {out} ({len(doc['runs'])} records, {n_bad} not ok)")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
