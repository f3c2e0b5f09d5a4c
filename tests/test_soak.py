"""bench/soak.py against a stub OpenAI-compatible server on loopback: it counts requests, streams,
records errors, compares greedy outputs before/after, and refuses non-loopback targets."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "soak", Path(__file__).parents[1] / "bench" / "soak.py"
)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


class _JsonHandler(BaseHTTPRequestHandler):
    """Stub-server base: quiet, and the POSTed JSON body."""

    def log_message(self, *a):
        pass

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


def _server(fail_every: int = 0, drift: bool = False):
    state = {"n": 0}

    class H(_JsonHandler):
        def do_POST(self):
            body = self.body()
            state["n"] += 1
            if fail_every and state["n"] % fail_every == 0:
                self.send_response(500)
                self.end_headers()
                return
            base = sum(body["prompt"]) + (state["n"] if drift else 0)
            ids = [(base + i) % 1024 for i in range(body["max_tokens"])]
            self.send_response(200)
            self.end_headers()
            if body["stream"]:
                for t in ids:
                    self.wfile.write(
                        f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n".encode()
                    )
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                self.wfile.write(json.dumps({"choices": [{"token_ids": ids}]}).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _run(url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    rc = soak.main(["--url", url, "--model", "m", "--clients", "4", "--duration", "1.5",
                    "--prompt-lens", "3,9", "--output-lens", "1,5", "--out", str(out), *extra])  # fmt: skip
    return rc, json.loads(out.read_text())


def test_clean_run(tmp_path: Path) -> None:
    srv, url = _server()
    try:
        rc, res = _run(url, tmp_path)
    finally:
        srv.shutdown()
    assert rc == 0 and res["errors"] == 0 and res["greedy_identical"]
    assert res["greedy_repeatable_idle"] and len(res["greedy_outputs"]["after"]) == 3
    assert res["requests"] > 10 and 0 < res["streamed"] < res["requests"]
    assert res["latency_s"]["p50"] is not None


def test_errors_and_drift_fail_the_run(tmp_path: Path) -> None:
    srv, url = _server(fail_every=7)
    try:
        rc, res = _run(url, tmp_path)
    finally:
        srv.shutdown()
    assert rc == 1 and res["errors"] > 0 and "HTTP 500" in res["error_samples"][0]
    srv, url = _server(drift=True)
    try:
        rc, res = _run(url, tmp_path)
    finally:
        srv.shutdown()
    assert rc == 1 and not res["greedy_identical"] and not res["greedy_repeatable_idle"]
    assert res["greedy_outputs"]["before"] != res["greedy_outputs"]["after"]


def test_refuses_non_loopback() -> None:
    with pytest.raises(SystemExit, match="non-loopback"):
        soak.complete("http://10.0.0.1:8000", "m", [1], 1, False, 1.0)


def _cache_server(mode: str):
    """A server with a simulated prefix cache (block 256: a prompt seen before has its first
    256 tokens cached) that reports usage.prompt_tokens_details like vLLM does (only when > 0).
    mode "prefix": a cached prefill gives another answer (numerics) but the same one every time;
    "leak": also, once the load has run (> 40 requests), every answer shifts;
    "flaky": a prompt's answer alternates between calls even with nothing cached."""
    seen: dict[tuple, int] = {}
    state = {"n": 0}
    lock = threading.Lock()

    class H(_JsonHandler):
        def do_POST(self):
            body = self.body()
            key = tuple(body["prompt"])
            with lock:
                state["n"] += 1
                times = seen.get(key, 0)
                seen[key] = times + 1
                n = state["n"]
            hit = 256 if times and len(key) > 256 else 0
            base = sum(key) + (7 if hit else 0)
            if mode == "leak" and n > 40:
                base += 1
            if mode == "flaky" and len(key) < 10:
                base += times % 2
            ids = [(base + i) % 1024 for i in range(body["max_tokens"])]
            self.send_response(200)
            self.end_headers()
            if body["stream"]:
                for t in ids:
                    msg = {"choices": [{"token_ids": [t]}]}
                    self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                usage = {"prompt_tokens": len(key)}
                if hit:
                    usage["prompt_tokens_details"] = {"cached_tokens": hit}
                self.wfile.write(
                    json.dumps({"choices": [{"token_ids": ids}], "usage": usage}).encode()
                )

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize(
    "mode,rc,verdict",
    [
        ("prefix", 0, "prefix_cache_effect"),
        ("leak", 1, "state_leak"),
        ("flaky", 1, "nondeterministic_idle"),
    ],  # fmt: skip
)
def test_greedy_pairs_tell_cache_from_leak(
    tmp_path: Path, mode: str, rc: int, verdict: str
) -> None:
    srv, url = _cache_server(mode)
    try:
        got_rc, res = _run(url, tmp_path, "--prompt-tokens-details")
    finally:
        srv.shutdown()
    assert res["greedy_prompt_lens"] == [5, 40, 300] and res["requests"] > 40
    assert res["greedy_cached_tokens"] == {"before": [0, 0, 0], "repeat": [0, 0, 256],
                                           "after": [0, 0, 256]}  # fmt: skip
    assert got_rc == rc and res["greedy_verdict"] == verdict and res["greedy_ok"] == (rc == 0)
    pairs = res["greedy_pairs"]
    if mode == "prefix":
        assert pairs["cold_vs_cached"] == [True, True, False]
        assert pairs["cached_vs_after"] == [True, True, True]
        assert pairs["cold_vs_after"] == [True, True, False] and not res["greedy_identical"]
        assert res["greedy_verdicts"] == ["identical", "identical", "prefix_cache_effect"]
    elif mode == "leak":
        assert pairs["cached_vs_after"] == [False, False, False]
    else:
        assert pairs["cold_vs_cached"] == [False, True, False]
        assert res["greedy_verdicts"][0] == "nondeterministic_idle"


def test_greedy_check_reference_by_cache_state() -> None:
    a, b = [[1]], [[2]]
    # after was a cold prefill again (its blocks evicted during the load): judged against cold
    r = soak.greedy_check(a, b, a, {"before": [0], "repeat": [256], "after": [0]})
    assert r["greedy_verdict"] == "prefix_cache_effect" and r["greedy_ok"]
    r = soak.greedy_check(a, b, b, {"before": [0], "repeat": [256], "after": [0]})
    assert r["greedy_verdict"] == "state_leak" and not r["greedy_ok"]
    # unknown cache state: either idle answer is accepted
    r = soak.greedy_check(a, b, b, {"before": None, "repeat": None, "after": None})
    assert r["greedy_verdict"] == "prefix_cache_effect"
    r = soak.greedy_check(a, b, [[3]], {})
    assert r["greedy_verdict"] == "state_leak"
    assert soak.greedy_check(a, None, a, {})["greedy_verdict"] == "missing_run"


def test_drain_timeout_cuts_long_requests(tmp_path: Path) -> None:
    """Streams that outlast --duration + --drain-timeout are cut (not errors), and the run ends
    on time with the greedy check done on an idle server."""
    open_streams = {"n": 0, "max_after_cut": 0}
    lock = threading.Lock()

    class H(_JsonHandler):
        def do_POST(self):
            body = self.body()
            base = sum(body["prompt"])
            self.send_response(200)
            self.end_headers()
            if not body["stream"]:
                ids = [(base + i) % 1024 for i in range(body["max_tokens"])]
                if len(body["prompt"]) in (5, 40, 300):  # the greedy check's prompts
                    with lock:  # how many streams are still open now
                        open_streams["max_after_cut"] = max(open_streams["max_after_cut"],
                                                            open_streams["n"])  # fmt: skip
                self.wfile.write(json.dumps({"choices": [{"token_ids": ids}]}).encode())
                return
            with lock:
                open_streams["n"] += 1
            try:
                for i in range(body["max_tokens"] * 50):  # ~20 s a stream
                    msg = {"choices": [{"token_ids": [i % 1024]}]}
                    self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.02)
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with lock:
                    open_streams["n"] -= 1

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    out = tmp_path / "soak.json"
    t0 = time.monotonic()
    try:
        rc = soak.main(["--url", url, "--model", "m", "--clients", "4", "--duration", "1",
                        "--prompt-lens", "3", "--output-lens", "20", "--drain-timeout", "1",
                        "--memory-warmup-s", "0", "--out", str(out)])  # fmt: skip
    finally:
        srv.shutdown()
    res = json.loads(out.read_text())
    assert time.monotonic() - t0 < 15
    assert res["cut_at_drain"] > 0 and res["errors"] == 0, res["error_samples"]
    assert res["greedy_verdict"] == "identical" and rc == 0
    assert open_streams["max_after_cut"] == 0  # no stream was open during a greedy request
