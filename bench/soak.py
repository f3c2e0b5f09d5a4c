#!/usr/bin/env python3
"""Bounded soak of an OpenAI-compatible server on this machine (loopback only).

    python bench/soak.py --url http://127.0.0.1:8000 --model MODEL [--clients 64] [--duration 300]
        [--vocab 1024] [--out soak.json]

N client threads send /v1/completions requests (token-id prompts, so tokenizer-less tiny
checkpoints work) with mixed prompt and output lengths, half of them streaming, until the
duration has passed; each request has its own timeout, so the run always ends. Before and after
the load, fixed prompts are sent greedily and their outputs compared (must be identical), and GPU
memory is read from nvidia-smi when present. Writes one JSON: command, date, counts, errors
(must be 0), latency percentiles (total and time to first token), memory before/after, and
whether the greedy outputs matched.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlparse(url)
    if u.hostname not in _LOOPBACK and not (u.hostname or "").startswith("127."):
        raise SystemExit(f"soak.py: refusing non-loopback target {u.hostname!r}")
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), u.path.rstrip("/")


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int, stream: bool, timeout: float
) -> tuple[list, float, float]:
    """One /v1/completions request, greedy. Returns (output pieces, total s, time to first piece s)."""
    conn, base = _conn(url, timeout)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    try:
        conn.request(
            "POST", f"{base}/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        pieces, ttft = [], None
        if not stream:
            choice = json.loads(r.read())["choices"][0]
            pieces = choice.get("token_ids") or [choice.get("text", "")]
            ttft = time.perf_counter() - t0
        else:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                choice = json.loads(data)["choices"][0]
                if ttft is None:
                    ttft = time.perf_counter() - t0
                pieces += choice.get("token_ids") or [choice.get("text", "")]
        return pieces, time.perf_counter() - t0, ttft if ttft is not None else float("nan")
    finally:
        conn.close()


def _smi(query: str) -> str | None:
    """nvidia-smi's CSV answer to `query` (e.g. "--query-gpu=memory.used"); None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def gpu_memory_mib() -> list[int] | None:
    out = _smi("--query-gpu=memory.used")
    if out is None:
        return None
    return [int(x) for x in out.split()] or None


def process_tree(pid: int) -> set[int]:
    """pid and all its descendants (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def server_memory_mib(pid: int) -> int | None:
    """GPU memory held by the processes of the server's process tree (nvidia-smi compute apps);
    None when nvidia-smi is absent or shows none of them (e.g. another PID namespace)."""
    out = _smi("--query-compute-apps=pid,used_memory")
    if out is None:
        return None
    tree, total, seen = process_tree(pid), 0, False
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in tree:
            total, seen = total + int(parts[1]), True
    return total if seen else None


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--vocab", type=int, default=1024, help="token ids are drawn below this")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request (s)")
    ap.add_argument("--prompt-lens", default="8,64,512,2000")
    ap.add_argument("--output-lens", default="1,16,64,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--server-pid",
        type=int,
        default=0,
        help="measure GPU memory of this process tree (not the whole GPU)",
    )
    ap.add_argument("--memory-tolerance-mib", type=int, default=64)
    ap.add_argument(
        "--memory-warmup-s",
        type=float,
        default=30.0,
        help="load seconds before the memory baseline (pools grow to the largest batch first)",
    )
    args = ap.parse_args(argv)
    plens = [int(x) for x in args.prompt_lens.split(",")]
    olens = [int(x) for x in args.output_lens.split(",")]
    rng = random.Random(args.seed)
    fixed = [[rng.randrange(args.vocab) for _ in range(n)] for n in (5, 40, 300)]

    lat, ttft, errors, lock = [], [], [], threading.Lock()

    def greedy(when: str) -> list | None:
        try:
            return [complete(args.url, args.model, p, 24, False, args.timeout)[0] for p in fixed]
        except Exception as e:
            errors.append(f"greedy {when}: {type(e).__name__}: {e}"[:300])
            return None

    def memory() -> int | list[int] | None:
        return server_memory_mib(args.server_pid) if args.server_pid else gpu_memory_mib()

    greedy_before = greedy("before")
    # The same requests again, still idle: if these differ the server is not repeatable at all
    # (e.g. atomics), which tells that apart from a change caused by the load (cache, state).
    greedy_repeat = greedy("repeat")
    mem_before = memory()
    stop_at = time.monotonic() + args.duration
    counts = {"requests": 0, "streamed": 0}

    def client(cid: int) -> None:
        r = random.Random(args.seed * 1000 + cid)
        while time.monotonic() < stop_at:
            prompt = [r.randrange(args.vocab) for _ in range(r.choice(plens))]
            stream = r.random() < 0.5
            try:
                _, total, first = complete(
                    args.url, args.model, prompt, r.choice(olens), stream, args.timeout
                )
                with lock:
                    lat.append(total)
                    ttft.append(first)
                    counts["requests"] += 1
                    counts["streamed"] += stream
            except Exception as e:  # recorded, never hidden: errors must be 0
                with lock:
                    errors.append(f"client {cid}: {type(e).__name__}: {e}"[:300])

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    samples = []  # (s since start, memory) every ~30 s: flat, not only equal at the ends
    hard_stop = stop_at + args.timeout + 30
    while any(t.is_alive() for t in threads) and time.monotonic() < hard_stop:
        samples.append((round(time.monotonic() - t0, 1), memory()))
        tick = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, tick - time.monotonic()))
    wall = time.monotonic() - t0
    greedy_after, mem_after = greedy("after"), memory()

    def _total(m):
        return sum(m) if isinstance(m, list) else m

    warm = next(
        (m for ts, m in samples if ts >= args.memory_warmup_s and m is not None), mem_before
    )
    growth = (
        _total(mem_after) - _total(warm) if warm is not None and mem_after is not None else None
    )
    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "clients": args.clients,
        "duration_s": round(wall, 1),
        **counts,
        "errors": len(errors),
        "error_samples": errors[:20],
        "latency_s": {p: _pct(lat, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "ttft_s": {p: _pct(ttft, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "mean_latency_s": round(statistics.fmean(lat), 4) if lat else None,
        "gpu_memory_mib_before": mem_before,
        "gpu_memory_mib_after": mem_after,
        "gpu_memory_scope": f"process tree of pid {args.server_pid}"
        if args.server_pid
        else "whole GPU (nvidia-smi memory.used)",
        "gpu_memory_samples": samples,
        "gpu_memory_mib_after_warmup": warm,
        "gpu_memory_warmup_s": args.memory_warmup_s,
        "gpu_memory_growth_mib": growth,  # after the warm-up sample -> after the load
        "memory_flat": growth is not None and growth <= args.memory_tolerance_mib,
        "greedy_identical": greedy_before is not None and greedy_before == greedy_after,
        "greedy_repeatable_idle": greedy_before is not None and greedy_before == greedy_repeat,
        "greedy_outputs": {"before": greedy_before, "repeat": greedy_repeat, "after": greedy_after},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = not errors and result["greedy_identical"] and counts["requests"] > 0
    return 0 if ok and (growth is None or result["memory_flat"]) else 1


if __name__ == "__main__":
    sys.exit(main())
