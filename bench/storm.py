#!/usr/bin/env python3
"""Storm of an OpenAI-compatible vLLM server on this machine (loopback only): rude traffic for a
duration, then checks that nothing was lost, leaked or compiled.

    python bench/storm.py --url http://127.0.0.1:8000 --model MODEL --vocab V [--clients 128]
        [--duration 1200] [--server-pid PID] [--server-log LOG] [--cache-dir DIR ...]
        [--out storm.json]

Load: --clients threads, each sending one well-formed request after another until --duration
has passed: /v1/completions (token-id prompts) or /v1/chat/completions (text), half of them
streamed; prompt and output lengths drawn from --prompt-lens / --output-lens ("max" = whatever
--max-model-len, read from /v1/models, leaves); some with n > 1, logprobs, stop strings,
ignore_eos, sampling with a seed. A streamed request is aborted by the client (socket shut down)
with probability --abort-prob, after a uniformly drawn number of chunks (0: before the answer).
A good request must get 200 and a well-formed answer (n choices, finish reasons, logprobs when
asked for, a stream ending in [DONE]); a 5xx (a status or an error event in a stream) is counted
in errors_5xx, anything else unexpected in errors_other.

Bad requests: one every --bad-interval s, cycling through BAD_CASES (invalid JSON, wrong types,
negative and huge max_tokens, a prompt longer than max_model_len, an unknown model, token ids out
of the vocabulary and negative, invalid UTF-8, empty prompts, too many logprobs). Each must get a
4xx whose error message matches the case's pattern. Exception: vLLM 0.21.0 clamps a max_tokens
larger than the context to what is left (vllm/entrypoints/utils.py `get_max_tokens`), so
`huge_max_tokens` (sent with a prompt of max_model_len - 8 tokens) also passes as a 200 with at
most 8 completion tokens; its record says which happened.

Afterwards (requests still running --drain-timeout s after the duration are cut, as in soak.py):
- greedy: the fixed prompts of soak.py's GreedyProbe (before the storm cold and repeated, after
  it), greedy_identical = before == after, greedy_verdict as in soak.py;
- /metrics: vllm:num_requests_running + vllm:num_requests_waiting (leaked_requests) and
  vllm:kv_cache_usage_perc (kv_usage_end), polled until both are 0 or --settle-timeout passes;
- GPU memory of the --server-pid process tree (else the whole GPU), sampled every
  --sample-interval s; mem_growth_mib = end - first sample after --memory-warmup-s;
- compiles after healthy: lines of --server-log after its last "Application startup complete"
  that report a compile (serve_bench.COMPILE_PATTERNS: TileLang, CuTeDSL, Triton,
  torch.compile), plus files created or changed in each --cache-dir (JIT disk caches) during the
  storm.
A progress line every --sample-interval s. Writes --out (JSON, atomically) and a readable table
(--table, default OUT with .md); exit 0 only when every check of `verdict` passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402
import startup  # noqa: E402
from serve_bench import compile_lines, metric_samples  # noqa: E402

HEALTHY = "Application startup complete"
STOPS = (["\n\n"], [" the", "\n"], ["aa"], ["."])
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


# ---------------------------------------------------------------------------------------------
# One HTTP request


@dataclass
class Reply:
    status: int = 0  # 0: no status (aborted before it, or a connection error)
    doc: dict | None = None  # the JSON answer of a non-streamed 200
    message: str = ""  # the error message of a non-200 (or of an error event in a stream)
    chunks: int = 0
    finish: dict = field(default_factory=dict)  # stream: choice index -> finish_reason
    logprobs: bool = False  # stream: some chunk carried logprobs
    done: bool = False  # stream: [DONE] arrived
    aborted: bool = False


def error_message(raw: bytes) -> str:
    """The message of a vLLM error body ({"error": {"message"}}, or FastAPI's {"detail"})."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        msg = err.get("message") if isinstance(err, dict) else err or doc.get("message")
        msg = msg or doc.get("detail")
        if msg:
            return (msg if isinstance(msg, str) else json.dumps(msg))[:500]
    return json.dumps(doc)[:500]


def post(url: str, path: str, body: bytes, timeout: float, active: set, stream: bool = False,
         abort_after: int | None = None) -> Reply:  # fmt: skip
    """POST `body` to url+path. abort_after: for a stream, shut the socket down after that many
    data chunks (0: right after sending, before any answer), as a client that goes away."""
    conn, base = soak._conn(url, timeout)
    conn.connect()
    sock = conn.sock  # kept: http.client drops conn.sock once a response will close
    active.add(sock)
    out = Reply()

    def abort() -> Reply:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        out.aborted = True
        return out

    try:
        conn.request("POST", base + path, body, {"Content-Type": "application/json"})
        if abort_after == 0:
            return abort()
        r = conn.getresponse()
        out.status = r.status
        if r.status != 200:
            out.message = error_message(r.read())
            return out
        if not stream:
            out.doc = json.loads(r.read())
            return out
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                break
            ev = json.loads(data)
            if "error" in ev:  # vLLM reports a failure after the 200 as an event
                err = ev["error"] if isinstance(ev["error"], dict) else {"message": ev["error"]}
                out.status = int(err.get("code") or 500)
                out.message = str(err.get("message"))[:500]
                return out
            for c in ev.get("choices") or []:
                out.chunks += 1
                if c.get("logprobs"):
                    out.logprobs = True
                if c.get("finish_reason"):
                    out.finish[c.get("index", 0)] = c["finish_reason"]
            if abort_after is not None and out.chunks >= abort_after:
                return abort()
        return out
    finally:
        active.discard(sock)
        conn.close()


# ---------------------------------------------------------------------------------------------
# Well-formed requests


@dataclass
class Req:
    path: str
    body: dict
    stream: bool
    n: int
    max_tokens: int
    logprobs: bool
    abort_after: int | None


def _lengths(spec: str, limit: int) -> list[int]:
    return [limit if x == "max" else min(int(x), limit) for x in spec.split(",")]


def make_request(r: random.Random, a: argparse.Namespace, max_len: int) -> Req:
    """One well-formed request whose prompt + output fit in max_len (chat: one token per
    character at most, plus 64 for the template)."""
    chat = r.random() < 0.5
    reserve = 64 if chat else 1
    plen = max(1, r.choice(_lengths(a.prompt_lens, max_len - reserve - 1)))
    olen = max(1, r.choice(_lengths(a.output_lens, max_len - reserve - plen)))
    stream = r.random() < 0.5
    n = r.choice((2, 3, 4)) if r.random() < a.n_prob else 1
    logprobs = r.random() < a.logprobs_prob
    body: dict = {"model": a.model, "max_tokens": olen, "stream": stream, "n": n}
    if r.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=r.randrange(1 << 30))
    if r.random() < 0.5:
        body["ignore_eos"] = True
    if r.random() < a.stop_prob:
        body["stop"] = r.choice(STOPS)
    if chat:
        text, words = "", []
        while len(text) < plen:
            words.append(r.choice(WORDS))
            text = " ".join(words)
        body["messages"] = [{"role": "user", "content": text[:plen]}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=r.randint(0, 5))
        path = "/v1/chat/completions"
    else:
        body["prompt"] = [r.randrange(a.vocab) for _ in range(plen)]
        if logprobs:
            body["logprobs"] = r.randint(0, 5)
        path = "/v1/completions"
    abort_after = None
    if stream and r.random() < a.abort_prob:
        abort_after = r.randrange(0, n * olen + 1)  # 0: before the answer
    return Req(path, body, stream, n, olen, logprobs, abort_after)


def invalid_answer(req: Req, rep: Reply) -> str | None:
    """Why a 200 answer to a well-formed request is malformed (None: it is fine)."""
    reasons = ("stop", "length")
    if req.stream:
        if not rep.done:
            return f"stream ended without [DONE] after {rep.chunks} chunks"
        if sorted(rep.finish) != list(range(req.n)):
            return f"finish_reason for choices {sorted(rep.finish)}, expected 0..{req.n - 1}"
        if any(f not in reasons for f in rep.finish.values()):
            return f"finish_reason {rep.finish}"
        if req.logprobs and not rep.logprobs and rep.chunks:
            return "logprobs asked for, none streamed"
        return None
    choices = (rep.doc or {}).get("choices")
    if not isinstance(choices, list) or len(choices) != req.n:
        return (
            f"{len(choices) if isinstance(choices, list) else choices!r} choices, expected {req.n}"
        )
    for c in choices:
        if c.get("finish_reason") not in reasons:
            return f"finish_reason {c.get('finish_reason')!r}"
        if "messages" in req.body and not isinstance(c.get("message"), dict):
            return "a chat choice without a message"
        if "prompt" in req.body and not isinstance(c.get("text"), str):
            return "a completion choice without text"
        if req.logprobs and c.get("logprobs") is None:
            return "logprobs asked for, none returned"
    used = ((rep.doc or {}).get("usage") or {}).get("completion_tokens")
    if isinstance(used, int) and used > req.n * req.max_tokens:
        return f"usage.completion_tokens {used} > n * max_tokens {req.n * req.max_tokens}"
    return None


# ---------------------------------------------------------------------------------------------
# Bad requests


@dataclass
class Bad:
    name: str
    path: str
    body: bytes
    pattern: str  # the error message must match (case-insensitive)
    clamp_limit: int | None = None  # a 200 with at most this many completion tokens also passes


def bad_cases(model: str, vocab: int, max_len: int) -> list[Bad]:
    def j(obj: dict) -> bytes:
        return json.dumps(obj).encode()

    comp, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hello"}]
    return [
        Bad("invalid_json", comp, b'{"model": "' + model.encode() + b'", "prompt": [1, 2',
            r"json|decod|pars|expect"),
        Bad("wrong_type_max_tokens", comp, j({"model": model, "prompt": "hi", "max_tokens": "ten"}),
            r"max_tokens|integer"),
        Bad("wrong_type_messages", chat, j({"model": model, "messages": "hello"}),
            r"messages|list|valid"),
        Bad("negative_max_tokens", comp, j({"model": model, "prompt": [1, 2], "max_tokens": -5}),
            r"max_tokens"),
        Bad("huge_max_tokens", comp,
            j({"model": model, "prompt": [1] * (max_len - 8), "max_tokens": 10**12}),
            r"max_tokens|context|maximum", clamp_limit=8),
        Bad("prompt_too_long", comp,
            j({"model": model, "prompt": [1] * (max_len + 16), "max_tokens": 4}),
            r"maximum|context length|longer|too long"),
        Bad("unknown_model", comp, j({"model": model + "-nope", "prompt": "hi", "max_tokens": 2}),
            r"model"),
        Bad("token_id_out_of_vocab", comp, j({"model": model, "prompt": [1, vocab], "max_tokens": 2}),
            r"vocab|token"),
        Bad("token_id_negative", comp, j({"model": model, "prompt": [1, -3], "max_tokens": 2}),
            r"greater than or equal|token|prompt"),
        Bad("invalid_utf8", comp,
            b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe\xc3", "max_tokens": 2}',
            r"utf|decod|pars|json|unicode|body"),
        Bad("invalid_utf8_chat", chat,
            b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
            b'"content": "\xc3\x28"}]}', r"utf|decod|pars|json|unicode|body"),
        Bad("empty_prompt", comp, j({"model": model, "prompt": "", "max_tokens": 2}), r"empty"),
        Bad("empty_token_list", comp, j({"model": model, "prompt": [], "max_tokens": 2}), r"empty"),
        Bad("too_many_logprobs", chat,
            j({"model": model, "messages": msgs, "logprobs": True, "top_logprobs": 10**4}),
            r"logprobs"),
    ]  # fmt: skip


def judge_bad(case: Bad, rep: Reply) -> tuple[bool, str]:
    """(passed, how): a 4xx whose message matches the case, or for a clamp case a 200 whose
    completion stayed within the clamp."""
    if 400 <= rep.status < 500:
        if not rep.message.strip():
            return False, "4xx without a message"
        if not re.search(case.pattern, rep.message, re.I):
            return False, f"4xx, message does not match /{case.pattern}/"
        return True, "4xx"
    if rep.status == 200 and case.clamp_limit is not None:
        used = ((rep.doc or {}).get("usage") or {}).get("completion_tokens")
        if isinstance(used, int) and used <= case.clamp_limit:
            return True, f"200, clamped to {used} tokens"
        return False, f"200 with completion_tokens {used!r} > {case.clamp_limit}"
    return False, f"status {rep.status}"


# ---------------------------------------------------------------------------------------------
# Server state after the storm


def _get(url: str, timeout: float = 10.0) -> bytes:
    return urllib.request.urlopen(url, timeout=timeout).read()


def served_model_info(url: str) -> dict:
    """The first model of /v1/models (its id and max_model_len)."""
    return json.loads(_get(url.rstrip("/") + "/v1/models"))["data"][0]


def read_metrics(text: str) -> dict[str, float | None]:
    """running, waiting (summed over label sets) and KV-cache usage (max) from /metrics text;
    None for a metric the server did not report."""
    vals = metric_samples(text)

    def pick(*names: str, how=sum) -> float | None:
        for nm in names:
            if nm in vals:
                return how(vals[nm])
        return None

    return {
        "running": pick("vllm:num_requests_running"),
        "waiting": pick("vllm:num_requests_waiting"),
        "kv_usage": pick("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", how=max),
    }


def settle(url: str, timeout: float) -> dict:
    """Poll /metrics until running, waiting and KV usage are all 0, or `timeout` passes."""
    end = time.monotonic() + timeout
    while True:
        try:
            m = read_metrics(_get(url.rstrip("/") + "/metrics").decode())
        except OSError as e:
            m = {"running": None, "waiting": None, "kv_usage": None, "error": str(e)[:200]}
        if (m["running"], m["waiting"], m["kv_usage"]) == (0, 0, 0) or time.monotonic() > end:
            return m
        time.sleep(1.0)


def compile_events(log_text: str) -> tuple[bool, list[dict]]:
    """(healthy marker found, compile lines after the last one), each {kind, line}."""
    lines = log_text.splitlines()
    last = max((i for i, ln in enumerate(lines) if HEALTHY in ln), default=None)
    if last is None:
        return False, []
    return True, compile_lines(lines[last + 1 :])


# ---------------------------------------------------------------------------------------------
# The run


def _pct(xs: list[float]) -> dict:
    return {p: soak._pct(xs, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))}


def table(res: dict) -> str:
    """The record as readable text: the checks, then one row per bad-request case."""
    rows = [("check", "value", "ok")]
    for name, (value, ok) in res["verdict"]["checks"].items():
        rows.append((name, json.dumps(value), "yes" if ok else "NO"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out = [f"storm {res['date']}  {res['device']}  commit {res['commit']}",
           f"{res['clients']} clients, {res['duration_s']} s, {res['requests']} requests "
           f"({res['streamed']} streamed, {res['aborted']} aborted), "
           f"{res['bad_requests_sent']} bad requests", ""]  # fmt: skip
    out += [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    out += ["", "bad request | sent | statuses | ok | message"]
    for name, b in res["bad_requests"].items():
        out.append(f"{name} | {b['sent']} | {json.dumps(b['statuses'])} | "
                   f"{'yes' if b['ok'] else 'NO'} | {(b['messages'] or [''])[0][:100]}")  # fmt: skip
    return "\n".join(out) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--vocab", type=int, required=True, help="the model's vocab_size")
    ap.add_argument("--max-model-len", type=int, default=0, help="default: from /v1/models")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request (s)")
    ap.add_argument("--prompt-lens", default="4,64,512,2000,max")
    ap.add_argument("--output-lens", default="1,16,64,256,1024,max")
    ap.add_argument("--n-prob", type=float, default=0.1, help="share of requests with n > 1")
    ap.add_argument("--logprobs-prob", type=float, default=0.2)
    ap.add_argument("--stop-prob", type=float, default=0.2)
    ap.add_argument("--abort-prob", type=float, default=0.25, help="share of streams aborted")
    ap.add_argument("--min-abort-fraction", type=float, default=0.10)
    ap.add_argument("--bad-interval", type=float, default=1.0, help="s between bad requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-pid", type=int, default=0, help="GPU memory of this process tree")
    ap.add_argument("--server-log", default="", help="scanned for compiles after healthy")
    ap.add_argument("--cache-dir", action="append", default=[], help="a JIT disk cache")
    ap.add_argument("--prompt-tokens-details", action="store_true", help="see soak.py")
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--settle-timeout", type=float, default=60.0)
    ap.add_argument("--sample-interval", type=float, default=30.0)
    ap.add_argument("--memory-warmup-s", type=float, default=60.0)
    ap.add_argument("--memory-tolerance-mib", type=int, default=64)
    ap.add_argument(
        "--require-memory",
        action="store_true",
        help="fail when GPU memory could not be measured (default: recorded as null)",
    )
    ap.add_argument("--out", default="storm.json")
    ap.add_argument("--table", default="", help="default: --out with .md")
    a = ap.parse_args(argv)
    out = Path(a.out)
    table_path = Path(a.table) if a.table else out.with_suffix(".md")
    info = served_model_info(a.url)
    max_len = a.max_model_len or int(info.get("max_model_len") or 0)
    if max_len < 128:
        raise SystemExit(f"storm.py: max_model_len {max_len}: pass --max-model-len (>= 128)")

    def say(msg: str) -> None:
        print(f"{datetime.datetime.now().strftime('%H:%M:%S')} storm: {msg}", flush=True)

    errors: list[str] = []
    probe = soak.GreedyProbe(a.url, a.model, random.Random(a.seed), a.vocab, a.timeout,
                             a.prompt_tokens_details, errors)  # fmt: skip

    def memory():
        return soak.server_memory_mib(a.server_pid) if a.server_pid else soak.gpu_memory_mib()

    probe.run("before")
    probe.run("repeat")
    caches = {d: startup.snapshot(Path(d)) for d in a.cache_dir}
    mem_before = memory()
    lock = threading.Lock()
    c = Counter()
    lat: list[float] = []
    samples_5xx: list[str] = []
    samples_other: list[str] = []
    active: set = set()
    cutting = threading.Event()
    stop_at = time.monotonic() + a.duration
    say(f"{a.clients} clients for {a.duration:.0f} s, max_model_len {max_len}, vocab {a.vocab}")

    def record(kind: str, msg: str) -> None:
        with lock:
            c[kind] += 1
            bucket = samples_5xx if kind == "errors_5xx" else samples_other
            if len(bucket) < 20:
                bucket.append(msg[:300])

    def client(cid: int) -> None:
        r = random.Random(a.seed * 1000 + cid + 1)
        while time.monotonic() < stop_at:
            req = make_request(r, a, max_len)
            t0 = time.perf_counter()
            try:
                rep = post(a.url, req.path, json.dumps(req.body).encode(), a.timeout, active,
                           req.stream, req.abort_after)  # fmt: skip
            except Exception as e:
                if cutting.is_set():
                    with lock:
                        c["cut_at_drain"] += 1
                else:
                    record("errors_other", f"{req.path}: {type(e).__name__}: {e}")
                continue
            with lock:
                c["requests"] += 1
                c["streamed"] += req.stream
                c["chat" if "messages" in req.body else "completions"] += 1
                c["n_gt_1"] += req.n > 1
                c["logprobs"] += req.logprobs
                c["stop_strings"] += "stop" in req.body
            if rep.aborted:
                with lock:
                    c["aborted"] += 1
                continue
            if rep.status >= 500:
                record("errors_5xx", f"{req.path} HTTP {rep.status}: {rep.message}")
            elif rep.status != 200:
                record("errors_other", f"{req.path} HTTP {rep.status}: {rep.message}")
            elif (why := invalid_answer(req, rep)) is not None:
                record("errors_other", f"{req.path} malformed answer: {why}")
            else:
                with lock:
                    c["completed"] += 1
                    lat.append(time.perf_counter() - t0)

    cases = bad_cases(a.model, a.vocab, max_len)
    bad = {b.name: {"sent": 0, "statuses": Counter(), "ok": True, "how": Counter(),
                    "messages": []} for b in cases}  # fmt: skip

    def bad_client() -> None:
        i = 0
        while time.monotonic() < stop_at:
            case = cases[i % len(cases)]
            i += 1
            try:
                rep = post(a.url, case.path, case.body, a.timeout, active)
            except Exception as e:
                rep = Reply(message=f"{type(e).__name__}: {e}")
            passed, how = judge_bad(case, rep)
            with lock:
                b = bad[case.name]
                b["sent"] += 1
                b["statuses"][str(rep.status)] += 1
                b["how"][how] += 1
                b["ok"] = b["ok"] and passed
                if rep.message and rep.message not in b["messages"] and len(b["messages"]) < 3:
                    b["messages"].append(rep.message)
            if rep.status >= 500:
                record("errors_5xx", f"bad request {case.name} HTTP {rep.status}: {rep.message}")
            time.sleep(a.bad_interval)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
    threads.append(threading.Thread(target=bad_client, daemon=True))
    for t in threads:
        t.start()
    samples: list = []
    hard_stop = stop_at + a.drain_timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < hard_stop:
        mem = memory()
        samples.append((round(time.monotonic() - t0, 1), mem))
        with lock:
            say(f"t={time.monotonic() - t0:.0f}s requests={c['requests']} "
                f"completed={c['completed']} aborted={c['aborted']} "
                f"bad={sum(b['sent'] for b in bad.values())} 5xx={c['errors_5xx']} "
                f"other_errors={c['errors_other']} open={len(active)} mem_mib={mem}")  # fmt: skip
        tick = min(time.monotonic() + a.sample_interval, hard_stop)
        for t in threads:
            t.join(max(0.0, tick - time.monotonic()))
    if any(t.is_alive() for t in threads):
        cutting.set()
        soak.cut_sockets(active)
        t_cut = time.monotonic() + 5
        for t in threads:
            t.join(max(0.0, t_cut - time.monotonic()))
    wall = time.monotonic() - t0
    time.sleep(2.0)  # the server aborts what was cut
    say(f"load done after {wall:.0f} s; greedy check, then /metrics")
    probe.run("after")
    metrics = settle(a.url, a.settle_timeout)
    mem_after = memory()
    warm, growth = soak.memory_growth(samples, mem_before, mem_after, a.memory_warmup_s)
    healthy_seen, compiles = None, []
    if a.server_log:
        healthy_seen, compiles = compile_events(Path(a.server_log).read_text(errors="replace"))
    for d, before in caches.items():
        compiles += [{"kind": "cache", "line": f"{d}/{f}"}
                     for f in startup.changed(before, startup.snapshot(Path(d)))]  # fmt: skip
    leaked = (
        None
        if metrics["running"] is None or metrics["waiting"] is None
        else int(metrics["running"] + metrics["waiting"])
    )
    greedy = probe.check()
    o = probe.outputs
    bad_out = {
        n: {**b, "statuses": dict(b["statuses"]), "how": dict(b["how"])} for n, b in bad.items()
    }
    abort_fraction = c["aborted"] / c["streamed"] if c["streamed"] else 0.0
    checks = {
        "errors_5xx": (c["errors_5xx"], c["errors_5xx"] == 0),
        "errors_other": (c["errors_other"] + len(errors), c["errors_other"] + len(errors) == 0),
        "requests": (c["requests"], c["completed"] > 0),
        "abort_fraction": (round(abort_fraction, 3), abort_fraction >= a.min_abort_fraction),
        "bad_requests_rejected": (
            f"{sum(bool(b['ok'] and b['sent']) for b in bad_out.values())}/{len(bad_out)} cases",
            all(b["ok"] and b["sent"] for b in bad_out.values()),
        ),
        "leaked_requests": (leaked, leaked == 0),
        "kv_usage_end": (metrics["kv_usage"], metrics["kv_usage"] == 0),
        "mem_growth_mib": (
            growth,
            growth <= a.memory_tolerance_mib if growth is not None else not a.require_memory,
        ),
        "compiles_after_healthy": (
            len(compiles),
            not compiles and (not a.server_log or bool(healthy_seen)),
        ),
        "greedy_identical": (
            o.get("before") is not None and o.get("before") == o.get("after"),
            greedy["greedy_ok"],
        ),  # fmt: skip
    }
    failures = [k for k, (_, ok) in checks.items() if not ok]
    res = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": startup._device(),
        "commit": startup._commit(),
        "url": a.url,
        "model": a.model,
        "max_model_len": max_len,
        "clients": a.clients,
        "duration_s": round(wall, 1),
        "requests": c["requests"],
        "completed": c["completed"],
        "streamed": c["streamed"],
        "aborted": c["aborted"],
        "abort_fraction": round(abort_fraction, 4),
        "cut_at_drain": c["cut_at_drain"],
        "mix": {k: c[k] for k in ("chat", "completions", "n_gt_1", "logprobs", "stop_strings")},
        "errors_5xx": c["errors_5xx"],
        "errors_5xx_samples": samples_5xx,
        "errors_other": c["errors_other"] + len(errors),
        "errors_other_samples": samples_other + errors,
        "latency_s": _pct(lat),
        "bad_requests_sent": sum(b["sent"] for b in bad_out.values()),
        "bad_requests": bad_out,
        "metrics_end": metrics,
        "leaked_requests": leaked,
        "kv_usage_end": metrics["kv_usage"],
        "gpu_memory_scope": f"process tree of pid {a.server_pid}"
        if a.server_pid
        else "whole GPU (nvidia-smi memory.used)",
        "gpu_memory_samples": samples,
        "gpu_memory_mib_before": mem_before,
        "gpu_memory_mib_after_warmup": warm,
        "gpu_memory_mib_after": mem_after,
        "mem_growth_mib": growth,
        "server_log": a.server_log or None,
        "healthy_marker_found": healthy_seen,
        "cache_dirs": a.cache_dir,
        "compiles_after_healthy": len(compiles),
        "compile_events": compiles[:50],
        "greedy_identical": checks["greedy_identical"][0],
        "greedy_outputs": o,
        "greedy_cached_tokens": probe.cached,
        **greedy,
        "verdict": {
            "ok": not failures,
            "failed": failures,
            "checks": {k: list(v) for k, v in checks.items()},
        },  # fmt: skip
    }
    _write(out, json.dumps(res, indent=1) + "\n")
    text = table(res)
    _write(table_path, text)
    print(text, flush=True)
    say(f"{'PASS' if not failures else 'FAIL: ' + ', '.join(failures)} -> {out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
