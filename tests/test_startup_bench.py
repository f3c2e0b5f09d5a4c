"""bench/startup.py against a stub OpenAI server (CPU): time to healthy, first-token times per
batch size, a lazy compile after healthy counted from the cache folders, cold empties the
caches and warm keeps them, records replaced per (impl, checkpoint, cache)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("startup", REPO / "bench" / "startup.py")
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)

STUB = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
time.sleep(float(sys.argv[1]))  # "loading"
tri = Path(os.environ["TRITON_CACHE_DIR"])
ours = Path(os.environ["CUTEDSL_CACHE_DIR"])
ours.mkdir(parents=True, exist_ok=True)
(ours / "kernel.o").write_bytes(b"compiled before healthy")
print("Model loading took 1.5 GiB memory and 12.250000 seconds", flush=True)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body, ctype="application/json"):
        self.send_response(200); self.send_header("Content-Type", ctype); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health": self._send(b"")
        elif self.path == "/v1/models": self._send(json.dumps({"data": [{"id": "stub"}]}).encode())
        else: self.send_error(404)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["model"] == "stub" and req["stream"] and len(req["prompt"]) == 16
        if sys.argv[2] == "lazy" and not (tri / "lazy.bin").exists():
            tri.mkdir(parents=True, exist_ok=True)
            (tri / "lazy.bin").write_bytes(b"a lazy compile")
            time.sleep(0.5)
        self._send(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n', "text/event-stream")
ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, cache: str, mode: str, impl: str = "ours") -> dict:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    out = tmp_path / "startup.json"
    argv = ["--impl", impl, "--checkpoint", "tiny", "--cache", cache,
            "--root", str(tmp_path / f"root-{impl}"), "--port", str(_port()), "--out", str(out),
            "--batch", "1", "4", "--prompt-len", "16", "--settle", "0.2",
            "--", sys.executable, str(stub), "0.5", mode]  # fmt: skip
    assert startup.main(argv) == 0
    doc = json.loads(out.read_text())
    return next(r for r in doc["records"] if (r["impl"], r["cache"]) == (impl, cache))


def test_cold_then_warm_and_a_lazy_compile(tmp_path: Path) -> None:
    cold = _run(tmp_path, "cold", "lazy")
    assert cold["to_healthy_s"] >= 0.5 and set(cold["first_token_s"]) == {"1", "4"}
    assert cold["first_token_s"]["1"] >= 0.5  # the stall of the lazy compile
    assert cold["compiles_after_healthy"] == 1 and cold["new_cache_files"] == ["triton/lazy.bin"]
    assert cold["log_times"] == {"model_loading_s": 12.25}
    for k in ("command", "date", "device", "commit"):
        assert cold[k]
    warm = _run(tmp_path, "warm", "lazy")  # the lazy kernel is on disk now: nothing new
    assert warm["compiles_after_healthy"] == 0
    again = _run(tmp_path, "cold", "lazy")  # cold empties the caches: the compile comes back
    assert again["compiles_after_healthy"] == 1
    doc = json.loads((tmp_path / "startup.json").read_text())
    assert [(r["impl"], r["cache"]) for r in doc["records"]] == [("ours", "cold"), ("ours", "warm")]


def test_no_compile_after_healthy(tmp_path: Path) -> None:
    rec = _run(tmp_path, "cold", "eager", impl="upstream")
    assert rec["compiles_after_healthy"] == 0 and rec["new_cache_files"] == []


def test_commit_outside_a_git_checkout_is_the_callers(tmp_path, monkeypatch):
    """A copy of the tree without .git names the commit the caller gives in $COMMIT."""

    def no_git(cmd, **kw):
        raise subprocess.CalledProcessError(128, cmd)

    monkeypatch.setattr(startup.subprocess, "run", no_git)
    monkeypatch.setenv("COMMIT", "abc1234")
    assert startup._commit() == "abc1234"
    monkeypatch.delenv("COMMIT")
    assert startup._commit() == "unknown"
