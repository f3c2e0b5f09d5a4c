#!/usr/bin/env python3
"""Per-kernel GPU profile of a running vLLM server (torch profiler, /start_profile, /stop_profile).

    python bench/profile_server.py run --base-url http://127.0.0.1:8001 --model flash
        --trace-dir /tmp/prof_ours --label cutedsl-nvfp4 [--concurrency 64] [--prompt-len 1024]
        [--max-tokens 4096] [--warm-tokens 8] [--profile-s 3] --out P.json [--md P.md]
    python bench/profile_server.py parse TRACE.json[.gz] [...] --label L --out P.json [--md P.md]
    python bench/profile_server.py compare OURS.json BASE.json [...] --md CMP.md [--json CMP.json]
    python bench/profile_server.py server-args DIR   # the --profiler-config value the drivers pass

Server side (vLLM 0.21.0): the torch profiler of the engine's GPU worker is enabled only by the
`--profiler-config` option (the VLLM_TORCH_PROFILER_DIR variable of older vLLM no longer exists),
which also adds the POST /start_profile and /stop_profile routes. `server_args(DIR)` gives the
flags the drivers use: torch profiler, traces (gzipped chrome JSON) under DIR, no Python stacks,
no AsyncLLM front-end trace, and no key_averages table at stop (slow on long traces). The worker
builds its profiler lazily at the first /start_profile, so an enabled but idle profiler costs
nothing. /stop_profile returns after the worker has stopped the profiler, and the trace is written
inside that stop (tensorboard_trace_handler); the files are still polled until their size is stable.

`run`: N streamed /v1/completions requests (token-id prompts of --prompt-len, greedy, ignore_eos,
--max-tokens) are started together; once every stream has received --warm-tokens tokens (all
prefills done: pure decode at batch N from then on), /start_profile, --profile-s seconds of decode,
/stop_profile, then the streams are closed (the server aborts them) and the new trace files in
--trace-dir are parsed. CUDA-graph replays: CUPTI records the kernels of a replayed graph with the
correlation id of the cudaGraphLaunch, so they are attributed like eagerly launched ones; the JSON
counts graph launches and the kernels found under them (`graph_launches`,
`kernels_under_graph_launches`), and warns when graphs were launched but none of their kernels
were recorded.

Parsing (`parse`, also done by `run`): GPU events are the chrome-trace "X" events of category
kernel, gpu_memcpy and gpu_memset. Kernel time is aggregated by name and by category (the first
matching rule of CATEGORY_RULES, case-insensitive regex on the kernel name; --rule CAT=REGEX puts
extra rules first). Steps are the worker's per-step annotations
"execute_context_C(Tc)_generation_G(Tg)" (user_annotation, one per engine step); a kernel belongs
to the step whose window [its annotation start, the next annotation start) holds the CPU launch of
the kernel (matched by correlation id; kernels without a launch record fall back to their own
start time). Decode steps are the steps with C == 0. Per batch size G: number of steps, median
kernel time per step (sum of kernel durations), median GPU span per step (first kernel start to
last kernel end) and median CPU step period (annotation start to the next one); per category the
kernel time per decode step at the most common decode batch size.

Output JSON: command, date, label, base_url, workload, trace_files, totals (kernel time, GPU busy
time = union of kernel intervals, trace GPU span, graph counts), steps (per batch size), categories
(rows: category, calls, total_us, pct, us_per_decode_step, calls_per_decode_step), kernels (rows:
name, category, calls, total_us, mean_us, pct, us_per_decode_step), idle (where the GPU waits in
the decode steps at that batch size: every gap of at least MIN_GAP_US between the latest kernel end
and the next kernel start, in-graph when both kernels came from the same CUDA-graph launch, per step
and by the pair of kernels around it, with that pair's median and longest gap), host (the other
user annotations, the worker's CPU phases, and the CUDA runtime calls that can block on the GPU -
synchronize, memcpy - named "[cuda] ...", in us per step), warnings. --md: the same as tables (the top --top kernels). Exit status: 0, 1 when no GPU kernel was found or the workload
failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import glob
import gzip
import http.client
import json
import os
import random
import re
import shlex
import statistics
import sys
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from pathlib import Path

# (category, regex on the kernel name), first match wins; memcpy/memset go by event category.
CATEGORY_RULES: list[tuple[str, str]] = [
    ("cutedsl_w4a16_gemm", r"w4a16|nvfp4\w*gemm|gemm\w*nvfp4|cutedsl|kernel_cutlass_kernel"),
    ("mhc", r"mhc|hc_pre|hc_post|hyper_?conn|sinkhorn"),
    (
        "attention/indexer",
        r"mqa_logits|paged_mqa|indexer|flash_?mla|flash_fwd|splitkv|sparse_attn|sparse_prefill"
        r"|attn|attention|_mla|mla_|top_?k_?per_?row|compressor|kv_?cache|cache_kernel",
    ),
    ("gemm_marlin", r"marlin"),
    ("gemm_deepgemm", r"deep_?gemm|fp8_gemm|fp8_einsum|sm90_fp8|gemm_1d[12]d|m_grouped"),
    ("moe_gemm_triton", r"fused_moe_kernel|matmul_ogs|moe_gemm|grouped_gemm|moe_mm"),
    (
        "moe_routing/topk/combine",
        r"topk|top_k|moe|expert|routing|radix|sort|cub::|searchsorted|index_?add|indexfunc"
        r"|scatter|gather|permute|combine|bincount|histogram|hash",
    ),
    ("gemm_cublas/cutlass", r"nvjet|xmma|cublas|gemm|gemv|cutlass|s16816|wgmma|splitk"),
    (
        "norm/elementwise",
        r"norm|rms|elementwise|vectorized|unrolled|silu|act_and_mul|swiglu|gelu|triton_|fill"
        r"|copy|cast|quant|reduce|softmax|rotary|rope|cat|add|mul|clamp|where|arange|index",
    ),
]
MEMORY = "memcpy/memset"
OTHER = "other"
CATEGORIES = [c for c, _ in CATEGORY_RULES] + [MEMORY, OTHER]
_GPU_CATS = {"kernel": None, "gpu_memcpy": MEMORY, "gpu_memset": MEMORY}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
MIN_GAP_US = 5.0  # idle gaps shorter than this are launch latency, not waiting
IDLE_TOP = 12
HOST_TOP = 15
# CUDA runtime calls that can block the host until the GPU gets there: their time in a step is
# the host waiting, not working
_BLOCKING_RE = re.compile(r"synchronize|memcpy", re.IGNORECASE)
STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def server_args(trace_dir: str) -> list[str]:
    """`vllm serve` flags (0.21.0) that enable the worker's torch profiler into trace_dir."""
    cfg = {
        "profiler": "torch",
        "torch_profiler_dir": os.path.abspath(trace_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "torch_profiler_record_shapes": False,
        "ignore_frontend": True,
    }
    return ["--profiler-config", json.dumps(cfg, separators=(",", ":"))]


class Classifier:
    def __init__(self, extra: list[tuple[str, str]] | None = None) -> None:
        self.rules = [(c, re.compile(r, re.I)) for c, r in (extra or []) + CATEGORY_RULES]
        self._cache: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        cat = self._cache.get(name)
        if cat is None:
            cat = next((c for c, rx in self.rules if rx.search(name)), OTHER)
            self._cache[name] = cat
        return cat


def load_trace(path: str) -> list[dict]:
    """traceEvents of one chrome-trace JSON file (gzipped when it ends in .gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", []) if isinstance(doc, dict) else doc


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def _idle(steps: list[dict]) -> dict:
    """Where the GPU waits inside the decode steps `steps`: each gap of at least MIN_GAP_US between
    one kernel's end (the latest end so far) and the next kernel's start, named by the kernels on
    either side and counted as in-graph when both came from the same CUDA-graph launch."""
    n = len(steps)
    pairs: dict[tuple[str, str, bool], list[float]] = {}  # each pair's gaps (us)
    in_graph = outside = short = overlap = 0.0
    for s in steps:
        ks = sorted(s["k"])
        if not ks:
            continue
        end, prev = ks[0][1], ks[0]
        for k in ks[1:]:
            gap = k[0] - end
            overlap += max(0.0, min(end, k[1]) - k[0])  # run beside an earlier kernel
            if 0 < gap < MIN_GAP_US:
                short += gap
            if gap >= MIN_GAP_US:
                same = prev[3] is not None and prev[3] == k[3]
                pairs.setdefault((_short(prev[2]), _short(k[2]), same), []).append(gap)
                if same:
                    in_graph += gap
                else:
                    outside += gap
            if k[1] > end:
                end, prev = k[1], k
    top = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:IDLE_TOP]
    return {
        "min_gap_us": MIN_GAP_US,
        "in_graph_us_per_step": round(in_graph / n, 2) if n else None,
        "outside_graph_us_per_step": round(outside / n, 2) if n else None,
        # gaps under MIN_GAP_US (one kernel launching after another), and kernel time that ran
        # beside another kernel (other streams): many small kernels cost the first, concurrent
        # streams save the second
        "short_gaps_us_per_step": round(short / n, 2) if n else None,
        "overlap_us_per_step": round(overlap / n, 2) if n else None,
        "top": [
            {
                "after": a,
                "before": b,
                "in_graph": g,
                "us_per_step": round(sum(v) / n, 2),
                "gaps_per_step": round(len(v) / n, 2),
                # a typical gap next to the mean: a few long stalls inflate the mean alone
                "median_us": _median(v),
                "max_us": round(max(v), 2),
            }
            for (a, b, g), v in top
        ],  # fmt: skip
    }


def _grid(ev: dict) -> str | None:
    """A kernel event's launch grid as "x,y,z" (the profiler's CUPTI args), None for copies and
    memsets (no grid)."""
    g = (ev.get("args") or {}).get("grid")
    if isinstance(g, (list, tuple)) and g:
        return ",".join(str(int(v)) for v in g)
    return None


def _short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


class _Acc:
    """Aggregates kernels and steps over one or more trace files."""

    def __init__(self, classify: Classifier) -> None:
        self.classify = classify
        self.kernels: dict[str, dict] = {}
        self.steps: list[dict] = []
        self.n_gpu = self.graph_launches = self.under_graph = self.by_time = 0
        self.unattributed = 0
        self.kernel_us = self.busy_us = self.span_us = 0.0
        self.files: list[str] = []

    def add_file(self, path: str) -> None:
        self.files.append(str(path))
        self.add_events(load_trace(path))

    def add_events(self, events: list[dict]) -> None:
        gpu, launches, anns, host = [], {}, [], []
        graph_corr = set()
        for ev in events:
            if ev.get("ph") != "X":
                continue
            cat = str(ev.get("cat", "")).lower()
            if cat in _GPU_CATS:
                gpu.append((ev, _GPU_CATS[cat]))
            elif cat in _LAUNCH_CATS:
                name = str(ev.get("name", ""))
                graph = "graphlaunch" in name.lower()
                corr = (ev.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[corr] = float(ev["ts"])
                    if graph:
                        graph_corr.add(corr)
                self.graph_launches += graph
                if _BLOCKING_RE.search(name):  # where the host waits on the GPU
                    host.append((float(ev["ts"]), float(ev.get("dur", 0)), f"[cuda] {name}"))
            elif cat == "user_annotation":
                m = STEP_RE.match(str(ev.get("name", "")))
                if m:
                    anns.append((float(ev["ts"]), float(ev.get("dur", 0)), m))
                else:
                    host.append((float(ev["ts"]), float(ev.get("dur", 0)), str(ev.get("name", ""))))
        anns.sort(key=lambda a: a[0])
        starts = [a[0] for a in anns]
        periods = [b - a for a, b in zip(starts, starts[1:])]
        tail = _median(periods) or (anns[-1][1] if anns else 0.0)
        steps = []
        for i, (ts, dur, m) in enumerate(anns):
            c, tc, g, tg = (int(x) for x in m.groups())
            end = starts[i + 1] if i + 1 < len(anns) else ts + max(dur, tail)
            steps.append({"ctx": c, "ctx_tokens": tc, "gen": g, "gen_tokens": tg,
                          "cpu_period_us": end - ts, "kernel_us": 0.0, "n_kernels": 0,
                          "first": None, "last": None, "cats": Counter(), "cat_n": Counter(),
                          "names": Counter(), "k": [], "host": Counter(),
                          "host_n": Counter()})  # fmt: skip
        for ts, dur, name in host:
            i = bisect.bisect_right(starts, ts) - 1
            if i >= 0 and ts < starts[i] + steps[i]["cpu_period_us"]:
                steps[i]["host"][name] += dur
                steps[i]["host_n"][name] += 1
        intervals = []
        for ev, fixed in gpu:
            name = str(ev.get("name", ""))
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0))
            cat = fixed or self.classify(name)
            # one row per kernel and launch grid: one compiled GEMM serves several shapes (its
            # grid tells them apart), one elementwise kernel several tensor sizes
            grid = _grid(ev)
            key = (name, grid)
            row = self.kernels.setdefault(key, {"name": name, "grid": grid, "category": cat,
                                                "calls": 0, "total_us": 0.0})  # fmt: skip
            row["calls"] += 1
            row["total_us"] += dur
            self.n_gpu += 1
            self.kernel_us += dur
            intervals.append((ts, ts + dur))
            corr = (ev.get("args") or {}).get("correlation")
            if corr in graph_corr:
                self.under_graph += 1
            t_launch = launches.get(corr)
            if t_launch is None:
                t_launch = ts
                self.by_time += 1
            i = bisect.bisect_right(starts, t_launch) - 1
            if i < 0 or t_launch >= starts[i] + steps[i]["cpu_period_us"]:
                self.unattributed += 1
                continue
            st = steps[i]
            st["kernel_us"] += dur
            st["n_kernels"] += 1
            st["first"] = ts if st["first"] is None else min(st["first"], ts)
            st["last"] = ts + dur if st["last"] is None else max(st["last"], ts + dur)
            st["cats"][cat] += dur
            st["cat_n"][cat] += 1
            st["names"][key] += dur
            st["k"].append((ts, ts + dur, name, corr if corr in graph_corr else None))
        if intervals:
            self.busy_us += _union_us(intervals)
            self.span_us += max(e for _, e in intervals) - min(s for s, _ in intervals)
        self.steps += steps

    def result(self) -> dict:
        decode = [s for s in self.steps if s["ctx"] == 0 and s["gen"] > 0]
        by_batch: dict[int, list[dict]] = defaultdict(list)
        for s in decode:
            by_batch[s["gen"]].append(s)
        batch = max(by_batch, key=lambda b: len(by_batch[b])) if by_batch else None
        ref = by_batch.get(batch, [])
        n_ref = len(ref)
        cat_step, name_step = Counter(), Counter()
        for s in ref:
            cat_step.update(s["cats"])
            name_step.update(s["names"])
        steps_rows = []
        for b in sorted(by_batch):
            ss = by_batch[b]
            steps_rows.append({
                "batch": b, "steps": len(ss),
                "median_kernel_us": _median([s["kernel_us"] for s in ss]),
                "median_gpu_span_us": _median([s["last"] - s["first"] for s in ss
                                               if s["first"] is not None]),
                "median_cpu_period_us": _median([s["cpu_period_us"] for s in ss]),
                "median_kernels": _median([s["n_kernels"] for s in ss]),
            })  # fmt: skip
        total = self.kernel_us or 1.0
        cats: dict[str, dict] = {
            c: {"category": c, "calls": 0, "total_us": 0.0} for c in CATEGORIES
        }
        for row in self.kernels.values():
            c = cats.setdefault(row["category"], {"category": row["category"], "calls": 0,
                                                  "total_us": 0.0})  # fmt: skip
            c["calls"] += row["calls"]
            c["total_us"] += row["total_us"]
        calls_step = Counter()
        for s in ref:
            calls_step.update(s["cat_n"])
        cat_rows = []
        for c in cats.values():
            if not c["calls"]:
                continue
            cat_rows.append({
                **c, "total_us": round(c["total_us"], 2),
                "pct": round(100 * c["total_us"] / total, 2),
                "us_per_decode_step": round(cat_step[c["category"]] / n_ref, 2) if n_ref else None,
                "calls_per_decode_step": round(calls_step[c["category"]] / n_ref, 2)
                if n_ref
                else None,
            })  # fmt: skip
        cat_rows.sort(key=lambda r: -r["total_us"])
        k_rows = []
        for r in self.kernels.values():
            k_rows.append({
                "name": r["name"], "grid": r["grid"], "category": r["category"], "calls": r["calls"],
                "total_us": round(r["total_us"], 2),
                "mean_us": round(r["total_us"] / r["calls"], 3),
                "pct": round(100 * r["total_us"] / total, 3),
                "us_per_decode_step": round(name_step[(r["name"], r["grid"])] / n_ref, 3)
                if n_ref
                else None,
            })  # fmt: skip
        k_rows.sort(key=lambda r: -r["total_us"])
        idle = _idle(ref)
        host_tot, host_n = Counter(), Counter()
        for s in ref:
            host_tot.update(s["host"])
            host_n.update(s["host_n"])
        host_rows = [
            {
                "name": n,
                "us_per_step": round(v / n_ref, 2),
                "calls_per_step": round(host_n[n] / n_ref, 2),
            }
            for n, v in host_tot.most_common(HOST_TOP)
        ]
        warnings = []
        if not self.n_gpu:
            warnings.append("no GPU kernel events in the trace(s)")
        if self.graph_launches and not self.under_graph:
            warnings.append(
                f"{self.graph_launches} CUDA-graph launches but no kernel recorded under them: "
                "graph-replayed kernels are missing from the trace"
            )
        if not self.steps:
            warnings.append(
                "no execute_context_*_generation_* step annotations: no per-step numbers"
            )
        return {
            "trace_files": self.files,
            "totals": {
                "gpu_events": self.n_gpu,
                "kernel_us": round(self.kernel_us, 2),
                "gpu_busy_us": round(self.busy_us, 2),
                "gpu_span_us": round(self.span_us, 2),
                "gpu_busy_pct_of_span": round(100 * self.busy_us / self.span_us, 2)
                if self.span_us
                else None,
                "graph_launches": self.graph_launches,
                "kernels_under_graph_launches": self.under_graph,
                "kernels_without_launch_record": self.by_time,
                "kernels_outside_steps": self.unattributed,
                "steps": len(self.steps),
                "decode_steps": len(decode),
                "decode_batch": batch,
                "decode_steps_at_batch": n_ref,
            },
            "steps": steps_rows,
            "categories": cat_rows,
            "kernels": k_rows,
            "idle": idle,
            "host": host_rows,
            "warnings": warnings,
        }


def parse_traces(paths: list[str], extra_rules: list[tuple[str, str]] | None = None) -> dict:
    acc = _Acc(Classifier(extra_rules))
    for p in paths:
        acc.add_file(p)
    return acc.result()


def _fmt(v: float | None, f: str = "{:.1f}") -> str:
    return "—" if v is None else f.format(v)


def markdown(res: dict, top: int = 30) -> str:
    t = res["totals"]
    w = res.get("workload") or {}
    lines = [f"## GPU profile: {res.get('label')}", ""]
    if w:
        lines.append(
            f"Workload: {w.get('concurrency')} streamed requests, prompt {w.get('prompt_len')} "
            f"tokens, greedy, ignore_eos; profiled {w.get('profile_s')} s of pure decode "
            f"({w.get('tokens_in_window')} tokens received in the window, "
            f"{_fmt(w.get('client_tok_per_s'))} tok/s under the profiler)."
        )
    lines += [
        f"Kernel time {t['kernel_us'] / 1e3:.2f} ms over {t['gpu_events']} GPU events; GPU busy "
        f"{t['gpu_busy_us'] / 1e3:.2f} ms of a {t['gpu_span_us'] / 1e3:.2f} ms span "
        f"({_fmt(t['gpu_busy_pct_of_span'])}%). Steps {t['steps']} (decode {t['decode_steps']}, "
        f"batch {t['decode_batch']}: {t['decode_steps_at_batch']}). CUDA-graph launches "
        f"{t['graph_launches']}, kernels under them {t['kernels_under_graph_launches']}.",
        "",
        "| decode batch | steps | kernel us/step | GPU span us/step | CPU period us/step | kernels/step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["steps"]:
        lines.append(f"| {s['batch']} | {s['steps']} | {_fmt(s['median_kernel_us'])} | "
                     f"{_fmt(s['median_gpu_span_us'])} | {_fmt(s['median_cpu_period_us'])} | "
                     f"{_fmt(s['median_kernels'], '{:.0f}')} |")  # fmt: skip
    lines += ["", f"| category | calls | total ms | % | us per decode step (batch {t['decode_batch']}) |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for c in res["categories"]:
        lines.append(f"| {c['category']} | {c['calls']} | {c['total_us'] / 1e3:.2f} | {c['pct']:.1f} | "
                     f"{_fmt(c['us_per_decode_step'])} |")  # fmt: skip
    lines += ["", f"Top {top} kernels:", "",
              "| kernel | grid | category | calls | total ms | % | mean us | us per decode step |",
              "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for k in res["kernels"][:top]:
        name = k["name"].replace("|", "\\|")
        name = name if len(name) <= 100 else name[:97] + "..."
        grid = k.get("grid") or "-"
        lines.append(f"| `{name}` | {grid} | {k['category']} | {k['calls']} | {k['total_us'] / 1e3:.3f} | "
                     f"{k['pct']:.2f} | {k['mean_us']:.2f} | {_fmt(k['us_per_decode_step'], '{:.2f}')} |")  # fmt: skip
    lines += _idle_markdown(res)
    for wmsg in res.get("warnings", []):
        lines += ["", f"WARNING: {wmsg}"]
    lines += ["", f"Command: `{res.get('command')}`; date {res.get('date')}; traces: "
              + ", ".join(f"`{os.path.basename(p)}`" for p in res["trace_files"])]  # fmt: skip
    return "\n".join(lines) + "\n"


def _idle_markdown(res: dict) -> list[str]:
    idle, host = res.get("idle") or {}, res.get("host") or []
    if idle.get("in_graph_us_per_step") is None:
        return []
    lines = [
        "", f"Where the GPU waits (decode steps at batch {res['totals']['decode_batch']}; gaps of at "
        f"least {idle['min_gap_us']:g} us between kernels): {_fmt(idle['in_graph_us_per_step'])} us "
        f"per step inside CUDA graphs, {_fmt(idle['outside_graph_us_per_step'])} us outside them; "
        f"shorter gaps {_fmt(idle.get('short_gaps_us_per_step'))} us per step; kernel time run beside "
        f"another kernel {_fmt(idle.get('overlap_us_per_step'))} us per step.",
        "", "| after kernel | before kernel | in graph | idle us/step | gaps/step | median gap us "
        "| max gap us |",
        "|---|---|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for g in idle["top"]:
        a, b = (x.replace("|", "\\|") for x in (g["after"], g["before"]))
        lines.append(f"| `{a}` | `{b}` | {'yes' if g['in_graph'] else 'no'} | "
                     f"{_fmt(g['us_per_step'])} | {_fmt(g['gaps_per_step'], '{:.2f}')} | "
                     f"{_fmt(g['median_us'])} | {_fmt(g['max_us'])} |")  # fmt: skip
    if host:
        lines += ["", "Host annotations in the same steps (CPU us per step; nested ones overlap):", "",
                  "| annotation | us/step | calls/step |", "|---|---:|---:|"]  # fmt: skip
        for h in host:
            lines.append(f"| `{h['name'].replace('|', '/')}` | {_fmt(h['us_per_step'])} | "
                         f"{_fmt(h['calls_per_step'], '{:.2f}')} |")  # fmt: skip
    return lines


def compare_markdown(results: list[dict]) -> tuple[str, dict]:
    """Side-by-side per-category us per decode step (and the step summaries) of several profiles;
    ratios over the last one (the baseline)."""
    labels = [r.get("label") or f"#{i}" for i, r in enumerate(results)]
    base = labels[-1]
    per = [{c["category"]: c for c in r["categories"]} for r in results]
    cats = [c for c in CATEGORIES if any(c in p for p in per)]
    cats += sorted({c for p in per for c in p} - set(cats))
    hdr = ["category"] + [f"{lab} us/step" for lab in labels]
    hdr += [f"{lab}/{base}" for lab in labels[:-1]]
    lines = ["## GPU time per decode step by category", "",
             "Batch per profile: " + ", ".join(
                 f"{lab} {r['totals']['decode_batch']} ({r['totals']['decode_steps_at_batch']} steps)"
                 for lab, r in zip(labels, results)) + ".", "",
             "| " + " | ".join(hdr) + " |", "|---|" + "---:|" * (len(hdr) - 1)]  # fmt: skip
    rows = []
    sums = [0.0] * len(results)
    for c in cats:
        vals = [p.get(c, {}).get("us_per_decode_step") for p in per]
        sums = [s + (v or 0.0) for s, v in zip(sums, vals)]
        b = vals[-1]
        ratios = [(v / b) if (v is not None and b) else None for v in vals[:-1]]
        rows.append({"category": c, "us_per_decode_step": dict(zip(labels, vals)),
                     "ratio_over_baseline": dict(zip(labels[:-1], ratios))})  # fmt: skip
        lines.append("| " + " | ".join([c] + [_fmt(v) for v in vals]
                                       + [_fmt(x, "{:.2f}") for x in ratios]) + " |")  # fmt: skip
    b = sums[-1]
    lines.append("| **sum** | " + " | ".join([_fmt(s) for s in sums]
                 + [_fmt(s / b if b else None, "{:.2f}") for s in sums[:-1]]) + " |")  # fmt: skip
    lines += ["", "| profile | decode batch | kernel us/step | GPU span us/step | CPU period us/step "
              "| GPU busy % of span | idle in graphs us/step | idle outside us/step "
              "| client tok/s under profiler |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for lab, r in zip(labels, results):
        t, idle = r["totals"], r.get("idle") or {}
        s = next((s for s in r["steps"] if s["batch"] == t["decode_batch"]), {})
        lines.append(f"| {lab} | {t['decode_batch']} | {_fmt(s.get('median_kernel_us'))} | "
                     f"{_fmt(s.get('median_gpu_span_us'))} | {_fmt(s.get('median_cpu_period_us'))} | "
                     f"{_fmt(t.get('gpu_busy_pct_of_span'))} | {_fmt(idle.get('in_graph_us_per_step'))} | "
                     f"{_fmt(idle.get('outside_graph_us_per_step'))} | "
                     f"{_fmt((r.get('workload') or {}).get('client_tok_per_s'))} |")  # fmt: skip
    lines += ["", "kernel us/step: sum of kernel durations; GPU span: first kernel start to last "
              "kernel end; CPU period: step annotation start to the next (the decode step time "
              "under the profiler). Sources: " + ", ".join(
                  f"{lab} ({r.get('date')})" for lab, r in zip(labels, results)) + "."]  # fmt: skip
    return "\n".join(lines) + "\n", {"labels": labels, "baseline": base, "categories": rows}


# --- the workload -----------------------------------------------------------------------------


def _conn(base_url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlparse(base_url)
    if u.hostname not in _LOOPBACK and not (u.hostname or "").startswith("127."):
        raise SystemExit(f"profile_server.py: refusing non-loopback target {u.hostname!r}")
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), u.path.rstrip("/")


def post(base_url: str, path: str, timeout: float, body: dict | None = None) -> tuple[int, bytes]:
    conn, base = _conn(base_url, timeout)
    try:
        data = json.dumps(body or {})
        conn.request("POST", base + path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class _Stream(threading.Thread):
    """One streamed greedy completion; counts tokens with their arrival times until stopped."""

    def __init__(self, base_url: str, model: str, prompt: list[int], max_tokens: int,
                 timeout: float, stop: threading.Event) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.args = (base_url, model, prompt, max_tokens, timeout)
        self.stop = stop
        self.times: list[float] = []
        self.error: str | None = None
        self.finished = False

    def run(self) -> None:
        base_url, model, prompt, max_tokens, timeout = self.args
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
        conn = None
        try:
            conn, base = _conn(base_url, timeout)
            conn.request("POST", base + "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            for raw in r:
                if self.stop.is_set():
                    return
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    self.finished = True
                    return
                choices = json.loads(data).get("choices") or []
                if not choices:  # a usage-only chunk
                    continue
                choice = choices[0]
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                now = time.monotonic()
                self.times += [now] * n
        except Exception as e:  # reported in the JSON, never hidden
            if not self.stop.is_set():
                self.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if conn is not None:
                conn.close()


def _trace_files(trace_dir: str) -> dict[str, int]:
    out = {}
    for p in glob.glob(os.path.join(trace_dir, "**", "*.pt.trace.json*"), recursive=True):
        if p.endswith(".tmp"):
            continue
        try:
            out[p] = os.path.getsize(p)
        except OSError:
            pass
    return out


def wait_new_traces(trace_dir: str, before: set[str], timeout: float, settle: float = 2.0,
                    poll: float = 1.0) -> list[str]:  # fmt: skip
    """New trace files in trace_dir once their sizes stop changing (and `settle` s passed with
    no new file); [] after `timeout` s without any."""
    t_end = time.monotonic() + timeout
    last: dict[str, int] = {}
    stable_since = None
    while time.monotonic() < t_end:
        now = {p: s for p, s in _trace_files(trace_dir).items() if p not in before}
        if now and now == last:
            stable_since = stable_since or time.monotonic()
            if time.monotonic() - stable_since >= settle:
                return sorted(now)
        else:
            stable_since = None
        last = now
        time.sleep(poll)
    return sorted(last)


def start_decode(
    a: argparse.Namespace, stop: threading.Event
) -> tuple[list[_Stream], float, list[str]]:
    """a.concurrency streams started together (prompts of a.prompt_len random token ids from
    a.seed), until each has a.warm_tokens tokens (all prefills done) or a.warm_timeout passed:
    -> (streams, seconds it took, errors)."""
    errors: list[str] = []
    rng = random.Random(a.seed)
    streams = [
        _Stream(a.base_url, a.model, [rng.randrange(a.vocab_lo, a.vocab) for _ in range(a.prompt_len)],
                a.max_tokens, a.request_timeout, stop)
        for _ in range(a.concurrency)
    ]  # fmt: skip
    t0 = time.monotonic()
    for s in streams:
        s.start()
    deadline = t0 + a.warm_timeout
    while time.monotonic() < deadline:
        if all(len(s.times) >= a.warm_tokens or s.error or s.finished for s in streams):
            break
        time.sleep(0.05)
    warm_s = time.monotonic() - t0
    not_warm = sum(len(s.times) < a.warm_tokens for s in streams)
    if not_warm:
        errors.append(f"{not_warm} of {a.concurrency} streams had < {a.warm_tokens} tokens "
                      f"after {warm_s:.0f} s")  # fmt: skip
    return streams, warm_s, errors


def run_workload(a: argparse.Namespace) -> tuple[dict, list[str], list[str]]:
    """-> (workload record, new trace files, errors)."""
    os.makedirs(a.trace_dir, exist_ok=True)
    before = set(_trace_files(a.trace_dir))
    stop = threading.Event()
    streams, warm_s, errors = start_decode(a, stop)
    t_start = time.monotonic()
    try:
        status, body = post(a.base_url, "/start_profile", a.control_timeout)
    except (OSError, http.client.HTTPException) as e:
        status, body = 0, f"{type(e).__name__}: {e}".encode()
    t_started = time.monotonic()
    if status != 200:
        errors.append(f"/start_profile: HTTP {status} {body[:200]!r} (server started without "
                      "--profiler-config?)")  # fmt: skip
    else:
        time.sleep(a.profile_s)
    t_stop = time.monotonic()
    if status == 200:
        try:
            st2, body2 = post(a.base_url, "/stop_profile", a.trace_timeout)
            if st2 != 200:
                errors.append(f"/stop_profile: HTTP {st2} {body2[:200]!r}")
        except (OSError, http.client.HTTPException) as e:
            errors.append(f"/stop_profile: {type(e).__name__}: {e}"[:300])
    t_stopped = time.monotonic()
    stop.set()
    t_join = time.monotonic() + 10  # daemon threads: a stalled stream does not hold us
    for s in streams:
        s.join(timeout=max(0.0, t_join - time.monotonic()))
    files = []
    if status == 200:
        files = wait_new_traces(a.trace_dir, before, timeout=a.trace_timeout)
        if not files:
            errors.append(f"no new trace file in {a.trace_dir} after {a.trace_timeout:.0f} s")
    errors += [f"stream: {s.error}" for s in streams if s.error]
    finished = sum(s.finished for s in streams)
    if finished:
        errors.append(f"{finished} streams finished inside the workload: raise --max-tokens")
    in_window = sum(sum(t_started <= t <= t_stop for t in s.times) for s in streams)
    window = max(t_stop - t_started, 1e-9)
    workload = {
        "concurrency": a.concurrency, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
        "warm_tokens": a.warm_tokens, "profile_s": a.profile_s, "seed": a.seed,
        "warm_s": round(warm_s, 2), "start_profile_s": round(t_started - t_start, 2),
        "stop_profile_s": round(t_stopped - t_stop, 2), "tokens_in_window": in_window,
        "client_tok_per_s": round(in_window / window, 1),
    }  # fmt: skip
    return workload, files, errors


def _rules(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for it in items:
        cat, sep, rx = it.partition("=")
        if not sep or not cat:
            raise ValueError(f"--rule {it!r}: expected CATEGORY=REGEX")
        re.compile(rx)
        out.append((cat, rx))
    return out


def _write(res: dict, a: argparse.Namespace) -> None:
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    text = markdown(res, a.top)
    if a.md:
        Path(a.md).write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--label", default="server")
    common.add_argument("--out", default="", help="result JSON")
    common.add_argument("--md", default="", help="markdown tables")
    common.add_argument("--top", type=int, default=30, help="kernels in the markdown table")
    common.add_argument("--rule", action="append", default=[], metavar="CAT=REGEX",
                        help="extra classification rule, tried before the built-in ones")  # fmt: skip
    r = sub.add_parser("run", parents=[common], help="profile a running server")
    r.add_argument("--base-url", required=True)
    r.add_argument("--model", required=True, help="model id as served")
    r.add_argument("--trace-dir", required=True, help="the server's torch_profiler_dir")
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--prompt-len", type=int, default=1024)
    r.add_argument(
        "--max-tokens", type=int, default=4096, help="long enough to outlast the profile"
    )
    r.add_argument("--warm-tokens", type=int, default=8, help="tokens per stream before profiling")
    r.add_argument("--profile-s", type=float, default=3.0)
    r.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this")
    r.add_argument("--vocab-lo", type=int, default=10, help="and at or above this")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--warm-timeout", type=float, default=120.0)
    r.add_argument("--control-timeout", type=float, default=60.0, help="/start_profile (s)")
    r.add_argument("--trace-timeout", type=float, default=180.0,
                   help="/stop_profile and trace-file wait (s)")  # fmt: skip
    r.add_argument("--request-timeout", type=float, default=600.0)
    p = sub.add_parser("parse", parents=[common], help="parse existing trace files")
    p.add_argument("traces", nargs="+")
    sa = sub.add_parser("server-args", help="print the --profiler-config value for a trace dir")
    sa.add_argument("trace_dir")
    c = sub.add_parser("compare", help="side-by-side categories of profile JSONs (last = baseline)")
    c.add_argument("profiles", nargs="+")
    c.add_argument("--md", default="")
    c.add_argument("--json", default="")
    a = ap.parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/profile_server.py", *argv])])  # fmt: skip
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    if a.cmd == "server-args":
        print(server_args(a.trace_dir)[1])
        return 0
    if a.cmd == "compare":
        try:
            results = [json.loads(Path(x).read_text()) for x in a.profiles]
            text, doc = compare_markdown(results)
        except (OSError, ValueError, KeyError) as e:
            print(f"profile_server: cannot compare: {e!r}", file=sys.stderr)
            return 2
        text += f"\nTable: `{command}`\n"
        if a.md:
            Path(a.md).write_text(text)
        if a.json:
            Path(a.json).write_text(json.dumps({"command": command, "date": date, **doc}, indent=1))
        print(text)
        return 0
    try:
        rules = _rules(a.rule)
    except (ValueError, re.error) as e:
        print(f"profile_server: {e}", file=sys.stderr)
        return 2
    head = {"command": command, "date": date, "label": a.label}
    if a.cmd == "parse":
        res = {**head, **parse_traces(a.traces, rules)}
        _write(res, a)
        return 0 if res["totals"]["gpu_events"] else 1
    if min(a.concurrency, a.prompt_len, a.max_tokens, a.warm_tokens) < 1 or a.vocab <= a.vocab_lo:
        print("profile_server: sizes must be >= 1 and --vocab > --vocab-lo", file=sys.stderr)
        return 2
    workload, files, errors = run_workload(a)
    res = {**head, "base_url": a.base_url, "model": a.model, "trace_dir": a.trace_dir,
           "workload": workload}  # fmt: skip
    res.update(parse_traces(files, rules) if files else parse_traces([], rules))
    res["errors"] = errors
    _write(res, a)
    for e in errors:
        print(f"profile_server: {e}", file=sys.stderr)
    return 0 if res["totals"]["gpu_events"] and not any("stream:" in e for e in errors) else 1


if __name__ == "__main__":
    sys.exit(main())
