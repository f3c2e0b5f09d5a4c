"""bench/soak.py against a stub OpenAI-compatible server on loopback: it counts requests, streams,
records errors, compares greedy outputs before/after, and refuses non-loopback targets."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "soak", Path(__file__).parents[1] / "bench" / "soak.py"
)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _server(fail_every: int = 0, drift: bool = False):
    state = {"n": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
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
