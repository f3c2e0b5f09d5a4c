"""bench/storm.py against a stub OpenAI-compatible server on loopback that answers like vLLM
0.21.0 (its validation messages, /metrics gauges, SSE streams): a clean storm passes, and a 5xx,
a leaked request, a compile after healthy or an accepted bad request each make it fail."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("storm", _BENCH / "storm.py")
storm = importlib.util.module_from_spec(_spec)
sys.modules["storm"] = storm  # dataclasses look their module up there
_spec.loader.exec_module(storm)

MAX_LEN, VOCAB, MODEL = 512, 1024, "m"  # the greedy probe sends 300 tokens


def _err(h: BaseHTTPRequestHandler, code: int, msg: str) -> None:
    body = json.dumps({"error": {"message": msg, "type": "BadRequestError", "code": code}})
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body.encode())


def _validate(raw: bytes, chat: bool, accept_negative: bool) -> tuple[int, str] | dict:
    """vLLM 0.21.0's answers to a bad body (status, message), else the parsed body."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return 400, "There was an error parsing the body"
    try:
        body = json.loads(text)
    except ValueError:
        return 400, "[{'type': 'json_invalid', 'msg': 'JSON decode error'}]"
    if body.get("model") != MODEL:
        return 404, f"The model `{body.get('model')}` does not exist."
    mt = body.get("max_tokens", 16)
    if not isinstance(mt, int):
        return 400, "max_tokens: Input should be a valid integer"
    if mt < 1 and not accept_negative:
        return 400, f"max_tokens must be at least 1, got {mt}."
    if chat:
        if not isinstance(body.get("messages"), list):
            return 400, "messages: Input should be a valid list"
        if body.get("top_logprobs", 0) > 20:
            return 400, f"Requested sample logprobs of {body['top_logprobs']}, max allowed: 20"
        plen = sum(len(m["content"]) for m in body["messages"]) + 10
    else:
        p = body.get("prompt")
        if p == "" or p is None:
            return 400, "Either prompt or prompt_embeds must be provided and non-empty."
        if isinstance(p, list):
            if not p:
                return 400, "The decoder prompt cannot be empty"
            if min(p) < 0:
                return 400, "prompt.1: Input should be greater than or equal to 0"
            if max(p) >= VOCAB:
                return 400, f"Token id {max(p)} is out of vocabulary"
        plen = len(p)
    if plen > MAX_LEN:
        return 400, f"The decoder prompt (length {plen}) is longer than the maximum model length"
    body["max_tokens"] = max(1, min(mt, MAX_LEN - plen))  # vLLM's get_max_tokens clamps
    body["_plen"] = plen
    return body


def _server(mode: str = "", cache_dir: Path | None = None):
    """mode: "" (well-behaved), "5xx" (every 25th good request fails with 500), "leak" (an
    aborted stream stays counted as running), "accept_negative" (max_tokens -5 gets a 200),
    "compile" (the first good request writes a file into cache_dir, as a JIT would)."""
    st = {"running": 0, "leaked": 0, "good": 0}
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/v1/models":
                body = json.dumps({"data": [{"id": MODEL, "max_model_len": MAX_LEN}]})
            elif self.path == "/metrics":
                with lock:
                    run = st["running"] + st["leaked"]
                body = (
                    "# HELP vllm:num_requests_running x\n"
                    f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(run)}\n'
                    f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
                    f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {run * 0.01}\n'
                )
            else:
                body = ""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            chat = self.path.endswith("/chat/completions")
            got = _validate(raw, chat, mode == "accept_negative")
            if isinstance(got, tuple):
                return _err(self, *got)
            body = got
            with lock:
                st["good"] += 1
                n_good = st["good"]
            if mode == "5xx" and n_good % 25 == 0:
                return _err(self, 500, "EngineCore encountered an issue")
            if mode == "compile" and n_good == 40 and cache_dir is not None:
                (cache_dir / "kernel_new.so").write_bytes(b"x")
            prompt = body.get("prompt") or [len(m["content"]) for m in body["messages"]]
            base = sum(prompt) if isinstance(prompt, list) else len(prompt)
            n, mt = body.get("n", 1), body["max_tokens"]
            ids = [(base + i) % VOCAB for i in range(mt)]
            lp = body.get("logprobs") is not None and body["logprobs"] is not False  # 0 counts
            with lock:
                st["running"] += 1
            released = True
            try:
                if not body.get("stream"):
                    choices = []
                    for i in range(n):
                        c = {"index": i, "finish_reason": "length",
                             "logprobs": {"token_logprobs": [-1.0] * mt} if lp else None}  # fmt: skip
                        if chat:
                            c["message"] = {"role": "assistant", "content": "x" * mt}
                        else:
                            c.update(text="x" * mt, token_ids=ids)
                        choices.append(c)
                    usage = {"prompt_tokens": body["_plen"], "completion_tokens": n * mt}
                    out = json.dumps({"choices": choices, "usage": usage}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for i in range(n):
                        for k, t in enumerate(ids):
                            c = {"index": i, "text": "x", "token_ids": [t],
                                 "logprobs": {"token_logprobs": [-1.0]} if lp else None,
                                 "finish_reason": "length" if k == mt - 1 else None}  # fmt: skip
                            self.wfile.write(f"data: {json.dumps({'choices': [c]})}\n\n".encode())
                            self.wfile.flush()
                            time.sleep(0.001)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    released = mode != "leak"
                self.close_connection = True
            finally:
                with lock:
                    st["running"] -= 1
                    st["leaked"] += not released

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _run(tmp_path: Path, mode: str = "", log: str | None = None, *extra: str):
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "kernel_old.so").write_bytes(b"old")
    srv, url = _server(mode, cache)
    args = ["--url", url, "--model", MODEL, "--vocab", str(VOCAB), "--clients", "8",
            "--duration", "3", "--output-lens", "1,8,32,max", "--prompt-lens", "4,32,max",
            "--bad-interval", "0.05", "--sample-interval", "1", "--settle-timeout", "3",
            "--drain-timeout", "5", "--cache-dir", str(cache), "--out", str(tmp_path / "s.json"),
            *extra]  # fmt: skip
    if log is not None:
        (tmp_path / "server.log").write_text(log)
        args += ["--server-log", str(tmp_path / "server.log")]
    try:
        rc = storm.main(args)
    finally:
        srv.shutdown()
    return rc, json.loads((tmp_path / "s.json").read_text())


_LOG = (
    "INFO TileLang begins to compile kernel `mhc_pre` with out_idx=None\n"
    "INFO Compiling a graph for compile range (1, 8192) takes 3.10 s\n"
    "INFO:     Application startup complete.\n"
    "INFO:     127.0.0.1 - POST /v1/completions 200 OK\n"
)


def test_clean_storm_passes(tmp_path: Path) -> None:
    """Compiles before the healthy line do not count; every bad case is rejected with a 4xx,
    except huge max_tokens, which vLLM clamps (a 200 of <= 8 tokens)."""
    rc, res = _run(tmp_path, log=_LOG)
    assert res["verdict"] == {**res["verdict"], "ok": True, "failed": []}, res["verdict"]
    assert rc == 0
    for k in ("duration_s", "clients", "requests", "errors_5xx", "aborted", "bad_requests",
              "leaked_requests", "kv_usage_end", "mem_growth_mib", "compiles_after_healthy",
              "greedy_identical", "command", "date", "device", "commit"):  # fmt: skip
        assert k in res, k
    assert res["errors_5xx"] == 0 and res["leaked_requests"] == 0 and res["kv_usage_end"] == 0
    assert res["compiles_after_healthy"] == 0 and res["healthy_marker_found"] is True
    assert res["greedy_identical"] is True and res["clients"] == 8
    assert res["requests"] > 50 and res["abort_fraction"] >= 0.10 and res["aborted"] > 0
    assert all(v > 0 for v in res["mix"].values()), res["mix"]
    bad = res["bad_requests"]
    assert set(bad) == {b.name for b in storm.bad_cases(MODEL, VOCAB, MAX_LEN)}
    for name, b in bad.items():
        assert b["ok"] and b["sent"] >= 1, (name, b)
        want = (
            {"200"}
            if name == "huge_max_tokens"
            else {"404"}
            if name == "unknown_model"
            else {"400"}
        )
        assert set(b["statuses"]) == want, (name, b["statuses"])
        assert b["messages"] or name == "huge_max_tokens", name
    assert "clamped" in next(iter(bad["huge_max_tokens"]["how"]))
    table = (tmp_path / "s.md").read_text()
    assert "token_id_out_of_vocab" in table and "leaked_requests" in table
    assert res["verdict"]["checks"]["bad_requests_rejected"][0] == f"{len(bad)}/{len(bad)} cases"


def test_5xx_fails_the_storm(tmp_path: Path) -> None:
    rc, res = _run(tmp_path, "5xx")
    assert rc == 1 and res["errors_5xx"] > 0 and "errors_5xx" in res["verdict"]["failed"]
    assert "HTTP 500" in res["errors_5xx_samples"][0]


def test_leaked_request_fails_the_storm(tmp_path: Path) -> None:
    """An aborted stream the server never releases stays in vLLM's running gauge (and KV)."""
    rc, res = _run(tmp_path, "leak")
    assert rc == 1 and res["leaked_requests"] > 0 and res["kv_usage_end"] > 0
    assert {"leaked_requests", "kv_usage_end"} <= set(res["verdict"]["failed"])


def test_compile_after_healthy_fails_the_storm(tmp_path: Path) -> None:
    log = _LOG + "WARNING Triton kernel JIT compilation during inference: _fwd_kernel.\n"
    rc, res = _run(tmp_path, "compile", log)
    kinds = sorted(e["kind"] for e in res["compile_events"])
    assert rc == 1 and res["compiles_after_healthy"] == 2 and kinds == ["cache", "triton"]
    assert res["compile_events"][1]["line"].endswith("kernel_new.so")


def test_missing_healthy_marker_fails_the_scan(tmp_path: Path) -> None:
    """A log without the healthy line cannot show there was no compile after it."""
    rc, res = _run(tmp_path, log="INFO starting\n")
    assert rc == 1 and res["healthy_marker_found"] is False
    assert res["verdict"]["failed"] == ["compiles_after_healthy"]


def test_accepted_bad_request_fails_the_storm(tmp_path: Path) -> None:
    rc, res = _run(tmp_path, "accept_negative")
    b = res["bad_requests"]["negative_max_tokens"]
    assert rc == 1 and not b["ok"] and set(b["statuses"]) == {"200"}
    assert res["verdict"]["failed"] == ["bad_requests_rejected"]


def test_metrics_and_judging() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
        'vllm:num_requests_waiting{engine="0"} 0.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
    )
    assert storm.read_metrics(text) == {"running": 3.0, "waiting": 0.0, "kv_usage": 0.25}
    assert storm.read_metrics("")["running"] is None
    case = storm.Bad("x", "/v1/completions", b"", r"vocab", clamp_limit=None)
    assert storm.judge_bad(
        case, storm.Reply(status=400, message="Token id 9 is out of vocabulary")
    )[0]
    assert not storm.judge_bad(case, storm.Reply(status=400, message="bad"))[0]
    assert not storm.judge_bad(case, storm.Reply(status=400, message=""))[0]
    assert not storm.judge_bad(case, storm.Reply(status=500, message="vocab"))[0]
    clamp = storm.Bad("h", "/v1/completions", b"", r"max_tokens", clamp_limit=8)
    ok = storm.Reply(status=200, doc={"usage": {"completion_tokens": 8}})
    over = storm.Reply(status=200, doc={"usage": {"completion_tokens": 9}})
    assert storm.judge_bad(clamp, ok)[0] and not storm.judge_bad(clamp, over)[0]
    assert storm.error_message(b'{"detail": "There was an error parsing the body"}').startswith(
        "There was"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_fit_the_context(seed: int) -> None:
    import argparse
    import random

    a = argparse.Namespace(model=MODEL, vocab=VOCAB, prompt_lens="4,64,max",
                           output_lens="1,16,max", n_prob=0.3, logprobs_prob=0.3,
                           stop_prob=0.3, abort_prob=0.5)  # fmt: skip
    r = random.Random(seed)
    for _ in range(300):
        req = storm.make_request(r, a, MAX_LEN)
        if "prompt" in req.body:
            assert len(req.body["prompt"]) + req.max_tokens <= MAX_LEN
            assert max(req.body["prompt"]) < VOCAB
        else:
            assert len(req.body["messages"][0]["content"]) + req.max_tokens + 64 <= MAX_LEN
        assert req.abort_after is None or (req.stream and req.abort_after <= req.n * req.max_tokens)
