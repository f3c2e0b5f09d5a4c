#!/usr/bin/env python3
"""OpenAI-client checks of a running server: completions and chat, streaming and not.

    python bench/openai_smoke.py --url http://127.0.0.1:8000 [--model NAME] [--out smoke.json]

Uses the official `openai` client (a vLLM dependency) the way users do. Each check sends one
request and verifies what a client relies on: a non-empty answer, the finish reason, usage
counts that match the requested lengths (ignore_eos makes the length exact), streamed chunks
that concatenate to the same number of tokens, and greedy determinism (the same request twice
gives the same text). Writes one JSON (command, date, server models, one record per check) and
exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable


def _checks(client, model: str, max_tokens: int) -> dict[str, Callable[[], dict]]:
    greedy = {"temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello in three languages."},
    ]

    def completion() -> dict:
        r = client.completions.create(model=model, prompt="The capital of France is", **greedy)
        c = r.choices[0]
        again = client.completions.create(model=model, prompt="The capital of France is", **greedy)
        return {
            "text": c.text,
            "finish_reason": c.finish_reason,
            "usage": r.usage.model_dump(),
            "ok": bool(c.text)
            and c.finish_reason == "length"
            and r.usage.completion_tokens == max_tokens
            and again.choices[0].text == c.text,
            "deterministic": again.choices[0].text == c.text,
        }

    def drain(stream, piece: Callable) -> dict:
        """Read a stream with usage: chunk count, concatenated `piece(choice)`, finish, usage;
        ok if it came in >= 2 chunks, finished by length with max_tokens completion tokens."""
        chunks, text, finish, usage = 0, "", None, None
        for ev in stream:
            if ev.usage is not None:
                usage = ev.usage.model_dump()
            for c in ev.choices:
                chunks += 1
                text += piece(c)
                finish = c.finish_reason or finish
        ok = (
            chunks >= 2
            and finish == "length"
            and (usage or {}).get("completion_tokens") == max_tokens
        )
        return {"chunks": chunks, "text": text, "finish_reason": finish, "usage": usage, "ok": ok}

    stream_kw = {"stream": True, "stream_options": {"include_usage": True}, **greedy}

    def completion_stream() -> dict:
        r = drain(
            client.completions.create(model=model, prompt="Once upon a time", **stream_kw),
            lambda c: c.text,
        )
        r["ok"] = r["ok"] and bool(r["text"])
        return r

    def token_ids_prompt() -> dict:
        r = client.completions.create(model=model, prompt=[5, 17, 99, 240, 3], **greedy)
        return {
            "text": r.choices[0].text,
            "usage": r.usage.model_dump(),
            "ok": r.usage.prompt_tokens == 5 and r.usage.completion_tokens == max_tokens,
        }

    def chat() -> dict:
        r = client.chat.completions.create(model=model, messages=messages, **greedy)
        m = r.choices[0].message
        return {
            "role": m.role,
            "content": m.content,
            "reasoning": getattr(m, "reasoning_content", None),
            "finish_reason": r.choices[0].finish_reason,
            "usage": r.usage.model_dump(),
            "ok": m.role == "assistant"
            and r.choices[0].finish_reason == "length"
            and r.usage.completion_tokens == max_tokens
            and r.usage.prompt_tokens > 0,
        }

    def chat_stream() -> dict:
        return drain(
            client.chat.completions.create(model=model, messages=messages, **stream_kw),
            lambda c: (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or ""),
        )

    return {
        "completion": completion,
        "completion_stream": completion_stream,
        "token_ids_prompt": token_ids_prompt,
        "chat": chat,
        "chat_stream": chat_stream,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the first listed)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=a.url.rstrip("/") + "/v1", api_key="EMPTY", timeout=a.timeout)
    models = [m.id for m in client.models.list().data]
    model = a.model or models[0]
    res: dict = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": a.url,
        "models": models,
        "model": model,
        "checks": {},
    }
    for name, fn in _checks(client, model, a.max_tokens).items():
        t0 = time.perf_counter()
        try:
            rec = fn()
        except Exception as e:  # record and go on: one failing check must not hide the others
            rec = {
                "ok": False,
                "error": repr(e)[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        res["checks"][name] = rec
        print(f"[smoke] {name}: ok={rec['ok']} {rec.get('error', '')}", flush=True)
    res["ok"] = all(r["ok"] for r in res["checks"].values())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
