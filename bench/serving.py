#!/usr/bin/env python3
"""Serving at depth, ours vs upstream: the decode step's byte roofline and the serving table.

    python bench/serving.py bytes CKPT [--concurrency 1,4,16,64,128] [--shape 1024x1024]
    python bench/serving.py copy-bw --out copy.json                      # on the GPU
    python bench/serving.py report --ckpt ours=DIR --ckpt upstream=DIR \\
        --serve ours=serve_ours.json --serve upstream=serve_upstream.json \\
        --profile ours:64=profile.json [...] --copy copy.json [--device-info device.txt] \\
        [--commit SHA] --json serving.json [--md serving.md] [--png serving.png]

The byte roofline of one decode step at batch B (B sequences, one new token each, context L):
the bytes the step must read from HBM at least once, divided by the copy bandwidth measured in the
same run. Bytes, from the checkpoint's own safetensors headers (every dtype and scale tensor as
stored; our loaders keep the same bits per weight in memory):
- every dense tensor (attention, shared expert, norms, mHC, compressor, indexer, router, head);
- B rows of the embedding;
- per MoE layer, the expected number of distinct routed experts touched by B tokens that each pick
  k of E experts uniformly, E * (1 - (1 - k/E)^B), times that layer's bytes per expert
  (uniform routing: a skewed router touches fewer experts, so this is an upper bound);
- the KV cache the attention reads per sequence, in vLLM 0.21.0's DeepSeek V4 formats: the
  sliding window (min(L, window) entries of 584 B, fp8_ds_mla), per C4 layer the indexer's keys
  (L/4 entries of 132 B: 128 fp8 + an fp32 scale) and the top-k compressed entries
  (min(L/4, index_topk) of 584 B), per C128 layer every compressed entry (L/128 of 584 B).
L is the mean decode context of a shape IN x OUT: IN + OUT / 2. The multi-token-prediction block
(`mtp.*`) is not counted (not served here).

Copy bandwidth (`copy-bw`): read + write bytes per second of a 1 GiB -> 1 GiB elementwise bf16
kernel (cutedsl.bench.gemm_sm90.stream_bandwidths_gbps, the GEMM table's same-bytes anchor), so
roofline_us is the time a copy of the step's bytes takes.

`report` joins, per (impl, shape, concurrency): the `vllm bench serve` records of
bench/serve_bench.py (`--repeats`: the first repeat is reported, the spread of output tok/s over
the repeats beside it), the per-step GPU time of bench/profile_server.py at decode batch B (median
sum of kernel durations per decode step at that batch; profiles run at the 1024-token prompt, so
the 8K shape's records carry the roofline but no profile), GPU busy = that time over the bench's
TPOT p50 (the unprofiled step period), and the roofline. Output: `serving.json` ({provenance,
records}), a markdown table and a PNG (output tok/s and TPOT p50 against concurrency).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import struct
import sys
from pathlib import Path

SWA_ENTRY_BYTES = 584  # vLLM 0.21.0 fp8_ds_mla: 448 fp8 + 64 bf16 rope + scales, per token
INDEX_ENTRY_BYTES = 132  # FP8 indexer cache: 128 fp8 + one fp32 scale, per compressed token
_EXPERT_RE = re.compile(r"(?:^|\.)layers\.(\d+)\..*(?:^|\.)experts\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)(embed|embed_tokens)\.")
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "F64": 8,
}  # fmt: skip


class InputError(ValueError):
    """A file or argument this tool cannot use (the message names it)."""


def safetensors_header(path: Path) -> dict:
    """The JSON header of one .safetensors file (tensor name -> dtype, shape, data_offsets)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise InputError(f"{path}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise InputError(f"{path}: header length {n} is not plausible")
            head = json.loads(f.read(n))
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise InputError(f"{path}: header is not JSON ({e})") from None
    head.pop("__metadata__", None)
    return head


def tensor_bytes(entry: dict, name: str, path: Path) -> int:
    dtype = entry.get("dtype")
    if dtype not in _DTYPE_BYTES:
        raise InputError(f"{path}: tensor {name}: unknown dtype {dtype!r}")
    return math.prod(entry.get("shape", [])) * _DTYPE_BYTES[dtype]


def checkpoint_bytes(ckpt: str | Path) -> dict:
    """Bytes of a checkpoint by role: dense, embedding row, routed experts per MoE layer.

    -> {"config": dict, "dense_bytes", "embed_row_bytes", "expert_bytes": {layer: bytes per
    expert}, "experts": {layer: experts found}, "mtp_bytes", "total_bytes"}."""
    ckpt = Path(ckpt)
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except OSError as e:
        raise InputError(f"{ckpt / 'config.json'}: cannot read it ({e.strerror})") from None
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise InputError(f"{ckpt}: no .safetensors files")
    dense = embed = mtp = total = 0
    embed_rows = 0
    per_layer: dict[int, int] = {}
    experts: dict[int, set[int]] = {}
    for f in files:
        for name, entry in safetensors_header(f).items():
            b = tensor_bytes(entry, name, f)
            total += b
            if name.startswith("mtp.") or ".mtp." in name:
                mtp += b
                continue
            m = _EXPERT_RE.search(name)
            if m:
                layer, e = int(m.group(1)), int(m.group(2))
                per_layer[layer] = per_layer.get(layer, 0) + b
                experts.setdefault(layer, set()).add(e)
            elif _EMBED_RE.search(name):
                embed += b
                embed_rows = max(embed_rows, entry["shape"][0])
            else:
                dense += b
    n_exp = int(cfg.get("n_routed_experts", 0))
    for layer, es in experts.items():
        if len(es) != n_exp:
            raise InputError(
                f"{ckpt}: layer {layer} holds {len(es)} routed experts, config says {n_exp}"
            )
    return {
        "config": cfg,
        "dense_bytes": dense,
        "embed_row_bytes": embed // embed_rows if embed_rows else 0,
        "expert_bytes": {layer: b // n_exp for layer, b in sorted(per_layer.items())},
        "experts": {layer: len(es) for layer, es in sorted(experts.items())},
        "mtp_bytes": mtp,
        "total_bytes": total,
    }


def expected_experts(batch: int, n_experts: int, topk: int) -> float:
    """Expected distinct experts touched by `batch` tokens picking `topk` of `n_experts` each,
    uniformly and independently."""
    if not 0 < topk <= n_experts:
        raise InputError(f"topk {topk} must be in 1..n_experts ({n_experts})")
    return n_experts * (1.0 - (1.0 - topk / n_experts) ** batch)


def kv_read_bytes(cfg: dict, batch: int, context: float) -> float:
    """KV-cache bytes one decode step reads for `batch` sequences of `context` tokens."""
    window = int(cfg.get("sliding_window", 128))
    topk = int(cfg.get("index_topk", 512))
    ratios = list(cfg.get("compress_ratios", []))[: int(cfg["num_hidden_layers"])]
    per_seq = 0.0
    for r in ratios:
        per_seq += min(context, window) * SWA_ENTRY_BYTES
        if r == 4:
            per_seq += context / 4 * INDEX_ENTRY_BYTES + min(context / 4, topk) * SWA_ENTRY_BYTES
        elif r > 1:
            per_seq += context / r * SWA_ENTRY_BYTES
    return batch * per_seq


def step_bytes(info: dict, batch: int, context: float) -> dict:
    """The decode step's bytes at `batch` sequences of mean context `context`, by part."""
    cfg = info["config"]
    k = int(cfg["num_experts_per_tok"])
    e = int(cfg["n_routed_experts"])
    touched = expected_experts(batch, e, k)
    parts = {
        "dense": float(info["dense_bytes"]),
        "embed": float(batch * info["embed_row_bytes"]),
        "experts": sum(touched * b for b in info["expert_bytes"].values()),
        "kv": kv_read_bytes(cfg, batch, context),
    }
    parts["total"] = sum(parts.values())
    parts["experts_touched_per_layer"] = touched
    return parts


def parse_shape(text: str) -> tuple[int, int]:
    try:
        a, b = text.lower().split("x")
        shape = (int(a), int(b))
    except ValueError:
        raise InputError(f"shape {text!r} is not INxOUT (e.g. 1024x1024)") from None
    if min(shape) < 1:
        raise InputError(f"shape {text!r}: lengths must be >= 1")
    return shape


def mean_context(shape: str) -> float:
    inp, out = parse_shape(shape)
    return inp + out / 2


# ---------------------------------------------------------------------------------------------
# report


def _load_json(path: str, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise InputError(f"{what} {path}: not JSON ({e})") from None


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or not key or not val:
            raise InputError(f"{what} {it!r}: expected KEY=FILE")
        out[key] = val
    return out


def profile_step(profile: dict, batch: int) -> dict | None:
    """The profile's decode numbers at `batch`: median kernel us per step and the step count."""
    for row in profile.get("steps", []):
        if row.get("batch") == batch and row.get("median_kernel_us"):
            return {
                "step_gpu_us": row["median_kernel_us"],
                "steps": row["steps"],
                "cpu_period_us_profiled": row.get("median_cpu_period_us"),
            }
    return None


def build_records(
    infos: dict[str, dict],
    serves: dict[str, dict],
    profiles: dict[tuple[str, int], dict],
    copy_gbps: float,
) -> list[dict]:
    """One record per (impl, shape, concurrency) that has an ok `vllm bench serve` run."""
    records = []
    for impl, doc in serves.items():
        if impl not in infos:
            raise InputError(f"--serve {impl}: no --ckpt {impl}=DIR to take its bytes from")
        info = infos[impl]
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in doc.get("runs", []):
            if r.get("status") == "ok":
                runs.setdefault((r["requested_shape"], r["concurrency"]), []).append(r)
        for (shape, c), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            rs.sort(key=lambda r: r.get("repeat", 0))
            first = rs[0]
            tok = [r["output_throughput"] for r in rs]
            spread = 100 * (max(tok) - min(tok)) / min(tok) if len(tok) > 1 and min(tok) else None
            sb = step_bytes(info, c, mean_context(shape))
            roof_us = sb["total"] / (copy_gbps * 1e3)
            rec = {
                "impl": impl,
                "shape": shape,
                "concurrency": c,
                "layers": int(info["config"]["num_hidden_layers"]),
                "output_tok_s": round(first["output_throughput"], 1),
                "tpot_p50_ms": _r(first.get("median_tpot_ms"), 3),
                "tpot_p99_ms": _r(first.get("p99_tpot_ms"), 3),
                "ttft_p50_ms": _r(first.get("median_ttft_ms"), 1),
                "ttft_p99_ms": _r(first.get("p99_ttft_ms"), 1),
                "num_prompts": first.get("num_prompts"),
                "repeats_output_tok_s": [round(t, 1) for t in tok],
                "repeat_spread_pct": _r(spread, 1),
                # each repeat with what the server itself counted over it (serve_bench's
                # `server`: null where /metrics was not read): what makes two repeats differ
                "repeats": [
                    {
                        "output_tok_s": round(r["output_throughput"], 1),
                        "tpot_p50_ms": _r(r.get("median_tpot_ms"), 3),
                        "ttft_p50_ms": _r(r.get("median_ttft_ms"), 1),
                        "duration_s": _r(r.get("duration"), 2),
                        **(r.get("server") or {}),
                        # compiles the server logged during the run (null: its log not read)
                        "compiles": (r.get("compiles") or {}).get("n"),
                        # kernel files the JIT caches gained or rewrote (null: not watched)
                        "cache_files": _cache_files(r),
                        "kernels": (r.get("compiles") or {}).get("kernels"),
                        # earlier attempts of this run, discarded because something compiled
                        "discarded": len(r.get("discarded") or []),
                    }
                    for r in rs
                ],
                "step_bytes": round(sb["total"]),
                "step_bytes_parts": {k: round(v) for k, v in sb.items() if k != "total"},
                "roofline_us": round(roof_us, 1),
                # TPOT over the roofline: the step period's bound on GPU/roofline at every point
                # (the GPU time of a step is at most its period), profiled or not
                "tpot_roofline_ratio": (
                    None
                    if not first.get("median_tpot_ms")
                    else round(first["median_tpot_ms"] * 1e3 / roof_us, 3)
                ),
                "step_gpu_us": None,
                "gpu_busy_pct": None,
                "roofline_ratio": None,
            }
            prof = profiles.get((impl, c))
            if prof is not None and parse_shape(shape)[0] == prof.get("prompt_len", 1024):
                ps = profile_step(prof, c)
                if ps:
                    rec["step_gpu_us"] = round(ps["step_gpu_us"], 1)
                    rec["profile_decode_steps"] = ps["steps"]
                    rec["roofline_ratio"] = round(ps["step_gpu_us"] / roof_us, 3)
                    if first.get("median_tpot_ms"):
                        busy = ps["step_gpu_us"] / (first["median_tpot_ms"] * 1e3)
                        rec["gpu_busy_pct"] = round(100 * busy, 1)
            records.append(rec)
    return records


def _r(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)


def _f(v: object, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def markdown(records: list[dict], prov: dict) -> str:
    lines = ["# Serving at depth: ours vs upstream vLLM 0.21.0 (`vllm bench serve`)", ""]
    lines += ["| provenance | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in prov.items() if k != "copy"]
    lines += ["", "![serving: output tokens/s and TPOT vs concurrency](serving.png)", ""]
    impls = sorted({r["impl"] for r in records}, key=lambda i: (i != "ours", i))
    by = {(r["impl"], r["shape"], r["concurrency"]): r for r in records}
    points = sorted({(r["shape"], r["concurrency"]) for r in records},
                    key=lambda p: (parse_shape(p[0]), p[1]))  # fmt: skip
    head = ["shape", "conc"]
    for i in impls:
        head += [f"{i} tok/s", f"{i} TPOT p50/p99 ms", f"{i} TTFT p50/p99 ms",
                 f"{i} step GPU us", f"{i} roofline us", f"{i} GPU/roofline", f"{i} TPOT/roofline",
                 f"{i} busy %"]  # fmt: skip
    if "ours" in impls and "upstream" in impls:
        head.append("ours/upstream tok/s")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, c in points:
        row = [shape, str(c)]
        for i in impls:
            r = by.get((i, shape, c))
            if r is None:
                row += ["—"] * 8
                continue
            row += [
                _f(r["output_tok_s"]) + ("" if r["repeat_spread_pct"] is None
                                          else f" (±{r['repeat_spread_pct']:.1f} %)"),
                f"{_f(r['tpot_p50_ms'], '{:.2f}')} / {_f(r['tpot_p99_ms'], '{:.2f}')}",
                f"{_f(r['ttft_p50_ms'], '{:.0f}')} / {_f(r['ttft_p99_ms'], '{:.0f}')}",
                _f(r["step_gpu_us"]), _f(r["roofline_us"]), _f(r["roofline_ratio"], "{:.2f}"),
                _f(r.get("tpot_roofline_ratio"), "{:.2f}"), _f(r["gpu_busy_pct"]),
            ]  # fmt: skip
        o, u = by.get(("ours", shape, c)), by.get(("upstream", shape, c))
        if "ours" in impls and "upstream" in impls:
            row.append(f"{o['output_tok_s'] / u['output_tok_s']:.2f}" if o and u else "—")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "tok/s: output tokens per second (first repeat; ± the spread over the repeats). "
        "TPOT/TTFT: p50 / p99 over the run's requests. step GPU us: median sum of kernel "
        "durations per decode step at batch = concurrency (torch profiler, 1024-token prompts). "
        "roofline us: the step's weight + KV bytes over the copy bandwidth of the same run "
        f"({_f(prov.get('copy', {}).get('gbps'), '{:.0f}')} GB/s read + write). "
        "GPU/roofline: step GPU us over roofline us (profiled points). TPOT/roofline: TPOT p50 over "
        "roofline us, at every point: a step's GPU time is at most its period, so this bounds "
        "GPU/roofline from above (loosely where the host bounds the step). "
        "busy %: step GPU us over TPOT p50.",
        "",
    ]
    lines += _repeats_markdown(records)
    return "\n".join(lines)


def _cache_files(run: dict) -> int | None:
    """The files the watched JIT caches gained during a run (None: serve_bench watched none)."""
    c = (run.get("compiles") or {}).get("cache_files")
    return None if c is None else sum(c.values())


def _kernels(k: dict | None) -> str:
    """serve_bench's {"KIND: NAME": n} of a run's compiled binaries, short ("-": none, or not
    recorded)."""
    if not k:
        return "-"
    return ", ".join(
        f"{name.split(': ', 1)[-1]}" + (f" x{n}" if n > 1 else "") for name, n in k.items()
    )


def _repeats_markdown(records: list[dict]) -> list[str]:
    """Every repeat of every point, with the server's own counts over it."""
    rows = [(r, k, rep) for r in records for k, rep in enumerate(r.get("repeats") or [])]
    if not rows:
        return []
    lines = [
        "Repeats: each run of each point, with what the server counted over it (`/metrics`: "
        "requests preempted, seconds requests waited in its queue, summed, engine steps) and "
        "the compiles its log reported during the run (each one stalls the step it runs in), the "
        "compiled-kernel files the JIT caches (vLLM's: torch.compile, Triton, DeepGEMM; "
        "TileLang's; ours) gained or rewrote during it (compiles the log does not report: vLLM "
        "warns once per Triton kernel name, DeepGEMM not at all), the earlier attempts "
        "discarded because something compiled during them, and the kept run's compiled binaries "
        "by kernel name.",
        "",
        "| impl | shape | conc | repeat | tok/s | TPOT p50 ms | TTFT p50 ms | duration s "
        "| preemptions | queue s | engine steps | compiles | new cache files | discarded "
        "| kernels compiled |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r, k, rep in rows:
        lines.append(
            f"| {r['impl']} | {r['shape']} | {r['concurrency']} | {k} | {_f(rep['output_tok_s'])} "
            f"| {_f(rep['tpot_p50_ms'], '{:.2f}')} | {_f(rep['ttft_p50_ms'], '{:.0f}')} "
            f"| {_f(rep['duration_s'], '{:.1f}')} | {_f(rep.get('preemptions'), '{:.0f}')} "
            f"| {_f(rep.get('queue_s'), '{:.1f}')} | {_f(rep.get('engine_steps'), '{:.0f}')} "
            f"| {_f(rep.get('compiles'), '{:.0f}')} | {_f(rep.get('cache_files'), '{:.0f}')} "
            f"| {rep.get('discarded', 0)} | {_kernels(rep.get('kernels'))} |"
        )
    return lines + [""]


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in records}, key=parse_shape)
    fig, axes = plt.subplots(2, len(shapes), figsize=(5.5 * len(shapes), 7), squeeze=False)
    for j, shape in enumerate(shapes):
        for impl, style in (("ours", "o-"), ("upstream", "s--")):
            rs = sorted((r for r in records if r["impl"] == impl and r["shape"] == shape),
                        key=lambda r: r["concurrency"])  # fmt: skip
            if not rs:
                continue
            c = [r["concurrency"] for r in rs]
            axes[0][j].plot(c, [r["output_tok_s"] for r in rs], style, label=impl)
            axes[1][j].plot(c, [r["tpot_p50_ms"] for r in rs], style, label=impl)
        for i, ylab in enumerate(("output tok/s", "TPOT p50 (ms)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylab)
            ax.set_title(f"{shape} ({records[0]['layers']} layers)")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _copy_bw(a: argparse.Namespace) -> int:
    from cutedsl.bench.gemm_sm90 import stream_bandwidths_gbps

    bw = stream_bandwidths_gbps()
    doc = {"gbps": max(bw.values()), "streams_gbps": {k: round(v, 1) for k, v in bw.items()},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "what": "read + write GB/s of 1 GiB -> 1 GiB streams; gbps = the faster"}  # fmt: skip
    _write(a.out, json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _bytes(a: argparse.Namespace) -> int:
    info = checkpoint_bytes(a.ckpt)
    ctx = mean_context(a.shape)
    print(f"{a.ckpt}: {info['total_bytes'] / 1e9:.2f} GB on disk, dense "
          f"{info['dense_bytes'] / 1e9:.3f} GB, {len(info['expert_bytes'])} MoE layers")  # fmt: skip
    print(
        f"{'batch':>6} {'experts/layer':>14} {'step GB':>9} {'dense':>7} {'experts':>8} {'kv':>7}"
    )
    for c in a.concurrency:
        sb = step_bytes(info, c, ctx)
        print(f"{c:>6} {sb['experts_touched_per_layer']:>14.1f} {sb['total'] / 1e9:>9.3f} "
              f"{sb['dense'] / 1e9:>7.3f} {sb['experts'] / 1e9:>8.3f} {sb['kv'] / 1e9:>7.3f}")  # fmt: skip
    return 0


def _report(a: argparse.Namespace) -> int:
    infos = {k: checkpoint_bytes(v) for k, v in _pairs(a.ckpt, "--ckpt").items()}
    serves = {k: _load_json(v, "--serve") for k, v in _pairs(a.serve, "--serve").items()}
    profiles = {}
    for key, path in _pairs(a.profile, "--profile").items():
        impl, sep, c = key.partition(":")
        if not sep or not c.isdigit():
            raise InputError(f"--profile {key}: expected IMPL:CONCURRENCY=FILE")
        doc = _load_json(path, "--profile")
        doc.setdefault("prompt_len", (doc.get("workload") or {}).get("prompt_len", 1024))
        profiles[(impl, int(c))] = doc
    copy = _load_json(a.copy, "--copy")
    records = build_records(infos, serves, profiles, float(copy["gbps"]))
    if not records:
        raise InputError("no ok `vllm bench serve` run in the --serve files")
    header = next(iter(serves.values())).get("header", {})
    prov = {
        "command": " ".join(sys.argv) if a.command is None else a.command,
        "date": a.date or header.get("date", "not recorded"),
        "device": a.device or header.get("device", "not recorded"),
        "versions": a.versions or f"vllm {header.get('vllm_version', '?')}",
        "commit": a.commit or "not recorded",
        "checkpoints": {k: str(Path(v).name) for k, v in _pairs(a.ckpt, "--ckpt").items()},
        "copy": copy,
    }
    _write(a.json, json.dumps({"provenance": prov, "records": records}, indent=1) + "\n")
    md = markdown(records, prov)
    if a.md:
        _write(a.md, md)
    if a.png:
        plot(records, a.png)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bytes", help="a checkpoint's decode-step bytes per batch size")
    b.add_argument("ckpt")
    b.add_argument("--concurrency", default="1,4,16,64,128",
                   type=lambda s: [int(x) for x in s.split(",")])  # fmt: skip
    b.add_argument("--shape", default="1024x1024")
    c = sub.add_parser("copy-bw", help="measure the copy bandwidth on the GPU")
    c.add_argument("--out", required=True)
    r = sub.add_parser("report", help="serving.json, the table and the PNG")
    r.add_argument("--ckpt", action="append", default=[], help="IMPL=DIR (repeat)")
    r.add_argument("--serve", action="append", default=[], help="IMPL=serve_bench JSON")
    r.add_argument("--profile", action="append", default=[], help="IMPL:CONC=profile JSON")
    r.add_argument("--copy", required=True, help="copy-bw JSON")
    r.add_argument("--json", required=True)
    r.add_argument("--md")
    r.add_argument("--png")
    r.add_argument("--command", default=None, help="the command to record (default: this one)")
    r.add_argument("--date")
    r.add_argument("--device")
    r.add_argument("--versions")
    r.add_argument("--commit")
    a = ap.parse_args(argv)
    try:
        return {"bytes": _bytes, "copy-bw": _copy_bw, "report": _report}[a.cmd](a)
    except InputError as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
