#!/usr/bin/env python3
"""Bounded soak of an OpenAI-compatible server on this machine (loopback only).

    python bench/soak.py --url http://127.0.0.1:8000 --model MODEL [--clients 64] [--duration 300]
        [--vocab 1024] [--out soak.json]

N client threads send /v1/completions requests (token-id prompts, so tokenizer-less tiny
checkpoints work) with mixed prompt and output lengths, half of them streaming, until the
duration has passed; each request has its own timeout, so the run always ends. GPU memory is
read from nvidia-smi when present. Writes one JSON: command, date, counts, errors (must be 0),
latency percentiles (total and time to first token), memory before/after, and the greedy check.

Greedy check: three fixed token-id prompts (5, 40 and 300 tokens) are sent one at a time
(sequential, temperature 0, 24 tokens, not streamed) twice before the load ("before": cold, their
first prefill; "repeat": the same requests again, idle, whose full KV blocks now come from the
prefix cache) and once after it ("after"). Stored: the outputs, the prompt tokens each answer
took from the prefix cache (usage.prompt_tokens_details.cached_tokens; the server needs
--enable-prompt-tokens-details, and then pass --prompt-tokens-details here), and per prompt which
pairs match (greedy_pairs: cold_vs_cached, cached_vs_after, cold_vs_after) with a verdict
(greedy_check: identical / prefix_cache_effect / nondeterministic_idle / state_leak), so that a
different prefill length (prefix-cache hit: other numerics) is told apart from state the load left
behind. greedy_identical is the strict before == after. Exit status 0 when there were requests,
no errors, greedy_ok (verdict identical or prefix_cache_effect) and memory flat (when measured).
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
import socket
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
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    timeout: float,
    info: dict | None = None,
    active: set | None = None,
) -> tuple[list, float, float]:
    """One /v1/completions request, greedy. Returns (output pieces, total s, time to first piece s).
    Non-streamed, `info["cached_tokens"]` gets usage.prompt_tokens_details.cached_tokens (None
    when the answer has no such field: vLLM sends it only with --enable-prompt-tokens-details and
    only when some tokens were cached). `active` holds the open socket while the request
    runs, so that the soak can cut it at its hard stop."""
    conn, base = _conn(url, timeout)
    sock = None
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
        if active is not None:
            conn.connect()
            sock = conn.sock  # kept: http.client drops conn.sock once a response will close
            active.add(sock)
        conn.request(
            "POST", f"{base}/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        pieces, ttft = [], None
        if not stream:
            doc = json.loads(r.read())
            choice = doc["choices"][0]
            if info is not None:
                details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
                info["cached_tokens"] = details.get("cached_tokens")
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
                choices = json.loads(data).get("choices") or []
                if not choices:  # a usage-only chunk
                    continue
                choice = choices[0]
                if ttft is None:
                    ttft = time.perf_counter() - t0
                pieces += choice.get("token_ids") or [choice.get("text", "")]
            else:  # the stream ended without its [DONE]: cut, not a complete answer
                raise RuntimeError(f"stream ended without [DONE] after {len(pieces)} pieces")
        return pieces, time.perf_counter() - t0, ttft if ttft is not None else float("nan")
    finally:
        if sock is not None:
            active.discard(sock)
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


_VERDICTS = ("identical", "prefix_cache_effect", "nondeterministic_idle", "state_leak")


def greedy_check(cold: list | None, cached: list | None, after: list | None,
                 hits: dict[str, list | None]) -> dict:  # fmt: skip
    """Which greedy runs agree, per fixed prompt: cold (first prefill) vs cached (same request
    again, idle) vs after (the load). hits[run][i] = prompt tokens served from the prefix cache
    (None: unknown). "after" is judged against the idle run with the same cache state (cached
    tokens equal; unknown: either idle run): a mismatch there is "state_leak" (something the load
    left behind). Otherwise a cold/cached mismatch is "prefix_cache_effect" when the cached run
    did take tokens from the cache (or that is unknown), and "nondeterministic_idle" when it took
    none (the same prefill twice gave two answers). The overall verdict is the worst per prompt;
    greedy_ok is False for state_leak, nondeterministic_idle and missing runs."""
    if cold is None or cached is None or after is None:
        return {"greedy_pairs": None, "greedy_verdicts": None, "greedy_verdict": "missing_run",
                "greedy_ok": False}  # fmt: skip
    n = len(cold)

    def hit(run: str, i: int) -> int | None:
        h = hits.get(run)
        return None if h is None else h[i]

    pairs = {
        "cold_vs_cached": [cold[i] == cached[i] for i in range(n)],
        "cached_vs_after": [cached[i] == after[i] for i in range(n)],
        "cold_vs_after": [cold[i] == after[i] for i in range(n)],
    }
    verdicts = []
    for i in range(n):
        ha, hc, h0 = hit("after", i), hit("repeat", i), hit("before", i)
        if ha is not None and ha == hc and ha != h0:
            refs = [cached[i]]
        elif ha is not None and ha == h0 and ha != hc:
            refs = [cold[i]]
        else:  # unknown, or all three the same cache state
            refs = [cold[i], cached[i]]
        if after[i] not in refs:
            verdicts.append("state_leak")
        elif cold[i] == cached[i] == after[i]:
            verdicts.append("identical")
        elif cold[i] != cached[i] and hc == 0:
            verdicts.append("nondeterministic_idle")
        else:
            verdicts.append("prefix_cache_effect")
    worst = max(verdicts, key=_VERDICTS.index) if verdicts else "identical"
    return {"greedy_pairs": pairs, "greedy_verdicts": verdicts, "greedy_verdict": worst,
            "greedy_ok": worst in ("identical", "prefix_cache_effect")}  # fmt: skip


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4)


class GreedyProbe:
    """The greedy check's fixed token-id prompts (5, 40 and 300 tokens, drawn from `rng`), sent
    one at a time (greedy, 24 tokens, not streamed). `run(when)` returns the outputs (None on an
    error, which goes to `errors`) and keeps in `cached[when]` how many prompt tokens the server
    took from its prefix cache for each; `check()` is `greedy_check` over before/repeat/after."""

    LENS = (5, 40, 300)

    def __init__(self, url: str, model: str, rng: random.Random, vocab: int, timeout: float,
                 details: bool, errors: list[str]) -> None:  # fmt: skip
        self.url, self.model, self.timeout, self.details = url, model, timeout, details
        self.prompts = [[rng.randrange(vocab) for _ in range(n)] for n in self.LENS]
        self.errors = errors
        self.cached: dict[str, list | None] = {}
        self.outputs: dict[str, list | None] = {}

    def run(self, when: str) -> list | None:
        outs, hits = [], []
        try:
            for p in self.prompts:
                info: dict = {}
                outs.append(complete(self.url, self.model, p, 24, False, self.timeout, info)[0])
                hit = info.get("cached_tokens")
                hits.append(hit if hit is not None else (0 if self.details else None))
        except Exception as e:
            self.errors.append(f"greedy {when}: {type(e).__name__}: {e}"[:300])
            self.cached[when] = self.outputs[when] = None
            return None
        self.cached[when], self.outputs[when] = hits, outs
        return outs

    def check(self) -> dict:
        o = self.outputs
        return greedy_check(o.get("before"), o.get("repeat"), o.get("after"), self.cached)


def memory_growth(samples: list, before, after, warmup_s: float) -> tuple:
    """(baseline, growth MiB): the baseline is the first sample taken >= warmup_s into the load
    (pools grow to the largest batch first; `before` when there is none), growth = after -
    baseline (None when either is unknown). A sample is (s, MiB | [MiB per GPU] | None)."""

    def total(m):
        return sum(m) if isinstance(m, list) else m

    warm = next((m for ts, m in samples if ts >= warmup_s and m is not None), before)
    growth = total(after) - total(warm) if warm is not None and after is not None else None
    return warm, growth


def cut_sockets(active: set) -> None:
    """Shut down every socket in `active` (the server sees the clients disconnect and aborts
    their requests)."""
    for sock in list(active):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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
    ap.add_argument(
        "--prompt-tokens-details",
        action="store_true",
        help="the server runs with --enable-prompt-tokens-details: a greedy answer without "
        "cached_tokens means 0 cached (vLLM omits the field then)",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds after --duration that requests still running may take; then they are "
        "cut (closed: the server aborts them) and counted as cut_at_drain, not as errors "
        "(default: --timeout + 30)",
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
    lat, ttft, errors, lock = [], [], [], threading.Lock()

    probe = GreedyProbe(args.url, args.model, rng, args.vocab, args.timeout,
                        args.prompt_tokens_details, errors)  # fmt: skip
    greedy, cached = probe.run, probe.cached

    def memory() -> int | list[int] | None:
        return server_memory_mib(args.server_pid) if args.server_pid else gpu_memory_mib()

    # Cold (the prompts' first prefill), then the same requests again, still idle (their full
    # blocks now come from the prefix cache: a shorter prefill, possibly other numerics), then
    # once after the load; greedy_check() says which of the three agree and why.
    greedy_before = greedy("before")
    greedy_repeat = greedy("repeat")
    mem_before = memory()
    stop_at = time.monotonic() + args.duration
    counts = {"requests": 0, "streamed": 0, "cut_at_drain": 0}
    active: set = set()
    cutting = threading.Event()

    def client(cid: int) -> None:
        r = random.Random(args.seed * 1000 + cid)
        while time.monotonic() < stop_at:
            prompt = [r.randrange(args.vocab) for _ in range(r.choice(plens))]
            stream = r.random() < 0.5
            try:
                _, total, first = complete(
                    args.url,
                    args.model,
                    prompt,
                    r.choice(olens),
                    stream,
                    args.timeout,
                    active=active,
                )
                with lock:
                    lat.append(total)
                    ttft.append(first)
                    counts["requests"] += 1
                    counts["streamed"] += stream
            except Exception as e:  # recorded, never hidden: errors must be 0
                with lock:
                    if cutting.is_set():
                        counts["cut_at_drain"] += 1
                    else:
                        errors.append(f"client {cid}: {type(e).__name__}: {e}"[:300])

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    samples = []  # (s since start, memory) every ~30 s: flat, not only equal at the ends
    drain = args.timeout + 30 if args.drain_timeout is None else args.drain_timeout
    hard_stop = stop_at + drain
    while any(t.is_alive() for t in threads) and time.monotonic() < hard_stop:
        samples.append((round(time.monotonic() - t0, 1), memory()))
        tick = min(time.monotonic() + 30, hard_stop)
        for t in threads:
            t.join(max(0.0, tick - time.monotonic()))
    if any(t.is_alive() for t in threads):
        # Cut what still runs, so that the greedy check after the load sees an idle server
        # (a batch of other requests would change its numerics).
        cutting.set()
        cut_sockets(active)
        t_cut = time.monotonic() + 5
        for t in threads:
            t.join(max(0.0, t_cut - time.monotonic()))
        time.sleep(2.0)  # the server aborts the closed requests
    wall = time.monotonic() - t0
    greedy_after, mem_after = greedy("after"), memory()
    warm, growth = memory_growth(samples, mem_before, mem_after, args.memory_warmup_s)
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
        "greedy_prompt_lens": [len(p) for p in probe.prompts],
        "greedy_outputs": {"before": greedy_before, "repeat": greedy_repeat, "after": greedy_after},
        "greedy_cached_tokens": cached,
        **probe.check(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = not errors and result["greedy_ok"] and counts["requests"] > 0
    return 0 if ok and (growth is None or result["memory_flat"]) else 1


if __name__ == "__main__":
    sys.exit(main())
