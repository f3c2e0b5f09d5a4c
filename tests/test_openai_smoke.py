"""bench/openai_smoke.py with the real `openai` client against a stub OpenAI-compatible server:
passes on a well-behaved server, fails (exit 1, the check named) on a wrong usage count or a
non-deterministic answer."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "openai_smoke", Path(__file__).parents[1] / "bench" / "openai_smoke.py"
)
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)


def _server(bad_usage: bool = False, drift: bool = False):
    state = {"n": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["n"] += 1
            n = body["max_tokens"]
            prompt = body.get("prompt", body.get("messages"))
            p_toks = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            words = [f"w{(i + (state['n'] if drift else 0)) % 7}" for i in range(n)]
            usage = {"prompt_tokens": p_toks, "completion_tokens": n - bad_usage,
                     "total_tokens": p_toks + n}  # fmt: skip
            chat = self.path.endswith("/chat/completions")
            base = {"id": "x", "created": 0, "model": "tiny"}
            if not body.get("stream"):
                if chat:
                    choice = {"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant", "content": " ".join(words)}}  # fmt: skip
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "finish_reason": "length", "text": " ".join(words)}
                    obj = "text_completion"
                self._json({**base, "object": obj, "choices": [choice], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, w in enumerate(words):
                fin = "length" if i == n - 1 else None
                if chat:
                    ch = {"index": 0, "delta": {"content": w + " "}, "finish_reason": fin}
                    ev = {**base, "object": "chat.completion.chunk", "choices": [ch]}
                else:
                    ch = {"index": 0, "text": w + " ", "finish_reason": fin}
                    ev = {**base, "object": "text_completion", "choices": [ch]}
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.write(
                f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode()
            )
            self.wfile.write(b"data: [DONE]\n\n")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _run(tmp_path: Path, **kw) -> tuple[int, dict]:
    srv, url = _server(**kw)
    try:
        out = tmp_path / "smoke.json"
        rc = smoke.main(["--url", url, "--max-tokens", "5", "--out", str(out)])
    finally:
        srv.shutdown()
    return rc, json.loads(out.read_text())


def test_all_checks_pass_on_a_conforming_server(tmp_path: Path) -> None:
    rc, res = _run(tmp_path)
    assert rc == 0 and res["ok"] and res["model"] == "tiny"
    assert set(res["checks"]) == {
        "completion", "completion_stream", "token_ids_prompt", "chat", "chat_stream",
    }  # fmt: skip
    assert res["checks"]["completion_stream"]["chunks"] == 5
    assert res["checks"]["chat"]["content"].startswith("w0")


def test_wrong_usage_fails(tmp_path: Path) -> None:
    rc, res = _run(tmp_path, bad_usage=True)
    assert rc == 1 and not res["ok"]
    assert not res["checks"]["completion"]["ok"] and not res["checks"]["chat_stream"]["ok"]


def test_nondeterministic_answer_fails(tmp_path: Path) -> None:
    rc, res = _run(tmp_path, drift=True)
    assert rc == 1 and res["checks"]["completion"]["deterministic"] is False
