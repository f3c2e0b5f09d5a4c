"""A stub of vLLM's streamed /v1/completions for the profiler tests: one token per `delay` seconds
(with its id, as `return_token_ids` gives it) until max_tokens or the client goes away."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def stream_tokens(handler: BaseHTTPRequestHandler, max_tokens: int, delay: float) -> None:
    """Answer `handler`'s request with a server-sent-event token stream, then [DONE]."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    try:
        for i in range(max_tokens):
            msg = {"choices": [{"text": "a", "token_ids": [i]}]}
            handler.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
            handler.wfile.flush()
            time.sleep(delay)
        handler.wfile.write(b"data: [DONE]\n\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    handler.close_connection = True


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """`handler` on a loopback port in a daemon thread: (server, base URL)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"
