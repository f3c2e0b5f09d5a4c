#!/usr/bin/env python3
"""Greedy outputs through a running vLLM server vs through `LLM.generate` on the same prompts.

    python bench/greedy_parity.py server --base-url http://127.0.0.1:8001 --model flash \
        [--prompts 8] [--prompt-len 256] [--max-tokens 64] [--seed 0] --out server.json
    python bench/greedy_parity.py offline --server server.json --out parity.json \
        [--compare NAME=JSON ...] -- CKPT [the server's `vllm serve` flags...]

`server`: PROMPTS prompts of PROMPT_LEN random token ids (seeded), sent one at a time (the server
runs each alone: batch 1, as `offline` does), greedy, `ignore_eos`, MAX_TOKENS new tokens each,
the generated token ids read from the response (`return_token_ids`), with each position's two
most likely tokens' logprobs; then the same prompts a second time (does the server repeat
itself?). Needs only the server.

`offline`: the same prompts through `vllm.LLM` built from the server's own flags (parsed by vLLM's
`EngineArgs` parser; flags only the API server knows are listed in the JSON as `ignored_flags`),
one prompt per `generate` call, the same sampling; then a load (LOAD_PROMPTS prompts of LOAD_LEN
random ids in one batch, as a server's earlier traffic) and the prompts again (does it repeat
itself, after the load as the server ran them?); then, per prompt, whether the server's and the
first offline token lists are equal, the first position where they differ and, there, the gap between the two most
likely tokens' logprobs on each side (a gap near 0 is a near tie that a last-bit difference in the
logits flips; a large gap is a different computation). Needs the GPU the server had (stop the
server first). Each `--compare NAME=JSON` (repeatable) also compares this process's first pass
with another run on the same prompts, under NAME in `compared`: a `server` JSON (e.g. taken from
a server that had served nothing yet) or an earlier `offline` JSON (another fresh process: two
processes that differ point at the process, not at the server). Writes the
command, date, device, versions, every prompt's result, whether each side repeated itself, and the
verdict; exits 0 when every prompt agrees, 1 when one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request

PROMPT_TOKEN_RANGE = (10, 1000)  # ids every tokenizer of the generated checkpoints has


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(length)] for _ in range(n)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (their common length when one is a prefix of the
    other and they differ in length), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(top: dict | None) -> float | None:
    """The logprob gap between a position's two most likely tokens (None: fewer than two given)."""
    vals = sorted((float(v) for v in (top or {}).values()), reverse=True)
    return round(vals[0] - vals[1], 5) if len(vals) >= 2 else None


def compare(
    server: list[list[int]],
    offline: list[list[int]],
    server_gaps: list[list[float | None]] | None = None,
    offline_gaps: list[list[float | None]] | None = None,
) -> dict:
    """Per prompt: equal, first_diff, lengths and, where they differ and the gaps are given, each
    side's top-2 logprob gap at the first difference; and the counts."""
    if len(server) != len(offline):
        raise ValueError(f"{len(server)} server outputs vs {len(offline)} offline outputs")
    rows = []
    for i, (s, o) in enumerate(zip(server, offline)):
        d = first_difference(s, o)
        row = {"prompt": i, "equal": d is None, "first_diff": d,
               "server_tokens": len(s), "offline_tokens": len(o)}  # fmt: skip
        for side, gaps in (("server", server_gaps), ("offline", offline_gaps)):
            if d is not None and gaps is not None and d < len(gaps[i]):
                row[f"{side}_gap_at_diff"] = gaps[i][d]
        rows.append(row)
    n_eq = sum(r["equal"] for r in rows)
    return {"prompts": len(rows), "equal": n_eq, "differ": len(rows) - n_eq, "rows": rows}


def self_equal(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts a second pass answered exactly as the first."""
    return sum(x == y for x, y in zip(a, b))


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:300]!r}") from None


def _write(path: str, doc: dict) -> None:
    """Whole or not at all: a temp file renamed over `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def cmd_server(a: argparse.Namespace) -> int:
    prompts = make_prompts(a.prompts, a.prompt_len, a.seed)
    url = a.base_url.rstrip("/") + "/v1/completions"
    passes: list[tuple[list[list[int]], list[list[float | None]]]] = []
    t0 = time.monotonic()
    for _ in range(2):  # the second pass: does the server repeat itself?
        outputs, gaps = [], []
        for i, p in enumerate(prompts):
            body = {"model": a.model, "prompt": p, "max_tokens": a.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "logprobs": 2,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            try:
                choice = _post(url, body, a.timeout)["choices"][0]
            except (OSError, RuntimeError, ValueError, KeyError, IndexError) as e:
                print(f"greedy_parity: prompt {i}: {type(e).__name__}: {e}", file=sys.stderr)
                return 2
            ids = choice.get("token_ids")
            if ids is None:
                print(f"greedy_parity: {url}: the response to prompt {i} has no token_ids "
                      "(a server without return_token_ids)", file=sys.stderr)  # fmt: skip
                return 2
            outputs.append(list(ids))
            tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
            gaps.append([top2_gap(t) for t in tops])
        passes.append((outputs, gaps))
    (outputs, gaps), (again, _) = passes
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": a.base_url, "model": a.model, "seed": a.seed, "prompt_len": a.prompt_len,
        "max_tokens": a.max_tokens, "wall_s": round(time.monotonic() - t0, 2),
        "prompts": prompts, "outputs": outputs, "top2_gaps": gaps, "outputs_again": again,
        "self_equal": self_equal(outputs, again),
    }  # fmt: skip
    _write(a.out, doc)
    print(f"greedy_parity: {len(prompts)} prompts through {a.base_url}, twice "
          f"({doc['self_equal']}/{len(prompts)} repeated exactly) -> {a.out}")  # fmt: skip
    return 0


def engine_args(flags: list[str]) -> tuple[object, list[str]]:
    """(vLLM EngineArgs, the flags its parser does not take) from `CKPT [vllm serve flags]`."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not flags or flags[0].startswith("-"):
        raise ValueError("offline: give the checkpoint then the server's flags after `--`")
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="greedy_parity offline"))
    ns, ignored = parser.parse_known_args(["--model", flags[0], *flags[1:]])
    return EngineArgs.from_cli_args(ns), ignored


def cmd_offline(a: argparse.Namespace) -> int:
    try:
        with open(a.server) as f:
            srv = json.load(f)
        prompts, outputs = srv["prompts"], srv["outputs"]
    except (OSError, ValueError, KeyError) as e:
        print(f"greedy_parity: {a.server}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    others: dict[str, tuple[str, list[list[int]], list | None]] = {}
    for spec in a.compare:
        name, sep, path = spec.partition("=")
        try:
            if not (sep and name and path) or name in others:
                raise ValueError(f"--compare {spec!r}: want a new NAME=JSON")
            with open(path) as f:
                doc = json.load(f)
            if "offline_outputs" in doc:  # an earlier offline run: its first pass
                outs, gaps_o = doc["offline_outputs"], doc.get("offline_top2_gaps")
            else:  # a server run
                outs, gaps_o = doc["outputs"], doc.get("top2_gaps")
                if doc.get("prompts") != prompts:
                    raise ValueError(f"its prompts are not {a.server}'s")
            if len(outs) != len(prompts):
                raise ValueError(f"{len(outs)} outputs for {len(prompts)} prompts")
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"greedy_parity: --compare {spec}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        others[name] = (path, outs, gaps_o)
    try:
        ea, ignored = engine_args(a.flags)
    except ValueError as e:
        print(f"greedy_parity: {e}", file=sys.stderr)
        return 2
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM.from_engine_args(ea)
    sp = SamplingParams(temperature=0.0, max_tokens=srv["max_tokens"], ignore_eos=True, logprobs=2)
    passes: list[tuple[list[list[int]], list[list[float | None]]]] = []
    load = {"prompts": a.load_prompts, "prompt_len": a.load_len}
    for npass in range(2):  # the second pass after a load: does LLM.generate repeat itself?
        if npass and a.load_prompts:
            t0 = time.monotonic()
            batch = [TokensPrompt(prompt_token_ids=q)
                     for q in make_prompts(a.load_prompts, a.load_len, seed=10**6)]  # fmt: skip
            lsp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            llm.generate(batch, lsp, use_tqdm=False)
            load["wall_s"] = round(time.monotonic() - t0, 2)
        offline, gaps = [], []
        for p in prompts:  # one at a time: batch 1, as the server ran each
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0].outputs[0]
            offline.append(list(o.token_ids))
            gaps.append(
                [top2_gap({k: v.logprob for k, v in (t or {}).items()}) for t in (o.logprobs or [])]
            )
        passes.append((offline, gaps))
    (offline, gaps), (again, _) = passes
    res = compare(outputs, offline, srv.get("top2_gaps"), gaps)
    n = len(prompts)
    compared = {}
    for name, (path, outs, gaps_o) in others.items():
        c = compare(outs, offline, gaps_o, gaps)
        rows = [{k.replace("server_", "other_"): v for k, v in r.items()} for r in c["rows"]]
        compared[name] = {"file": path, "equal": c["equal"], "differ": c["differ"], "rows": rows}
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "server_json": a.server, "server_command": srv.get("command"),
        "engine_args": {k: repr(v) for k, v in vars(ea).items()},
        "ignored_flags": ignored,
        # vLLM keys its torch.compile cache on these (vllm/envs.py compile_factors): with the
        # server's, the offline engine runs the graph the server compiled
        "vllm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
        **res, "offline_outputs": offline, "offline_top2_gaps": gaps, "offline_outputs_again": again,
        "server_self_equal": srv.get("self_equal"), "offline_self_equal": self_equal(offline, again),
        "load_between_offline_passes": load,
        "server_equal_offline_after_load": self_equal(outputs, again),
        "compared": compared,
        "verdict": "pass" if res["differ"] == 0 else "fail",
    }  # fmt: skip
    _write(a.out, doc)
    diffs = [r for r in res["rows"] if not r["equal"]]
    at = [
        (r["first_diff"], r.get("server_gap_at_diff"), r.get("offline_gap_at_diff")) for r in diffs
    ]
    print(f"greedy_parity: {res['equal']}/{res['prompts']} prompts equal; each side repeats itself: "
          f"server {srv.get('self_equal', '?')}/{n}, offline (after a load) "
          f"{doc['offline_self_equal']}/{n}; server vs offline after the load "
          f"{doc['server_equal_offline_after_load']}/{n}"
          + (f"; first differences (position, server gap, offline gap): {at}" if diffs else "")
          + "".join(f"; equal to {k}: {v['equal']}/{n}" for k, v in compared.items())
          + f" -> {a.out}")  # fmt: skip
    return 0 if res["differ"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server", help="greedy outputs of a running server")
    s.add_argument("--base-url", required=True)
    s.add_argument("--model", required=True, help="the served model name")
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=256)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    s.add_argument("--out", required=True)
    o = sub.add_parser("offline", help="the same prompts through LLM.generate, compared")
    o.add_argument("--server", required=True, help="the JSON of `server`")
    o.add_argument("--out", required=True)
    o.add_argument("--load-prompts", type=int, default=64,
                   help="prompts of the load between the two offline passes (0: none)")  # fmt: skip
    o.add_argument("--load-len", type=int, default=1024, help="their length in tokens")
    o.add_argument("--compare", action="append", default=[], metavar="NAME=JSON",
                   help="another run on the same prompts (a server or an offline JSON) to compare "
                        "this process's first pass with (repeatable)")  # fmt: skip
    o.add_argument(
        "flags", nargs=argparse.REMAINDER, help="-- CKPT [the server's vllm serve flags]"
    )
    a = ap.parse_args(argv)
    if a.cmd == "server":
        if a.prompts < 1 or a.prompt_len < 1 or a.max_tokens < 1:
            ap.error("--prompts, --prompt-len and --max-tokens must be >= 1")
        return cmd_server(a)
    if a.load_prompts < 0 or a.load_len < 1:
        ap.error("--load-prompts must be >= 0 and --load-len >= 1")
    a.flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    return cmd_offline(a)


if __name__ == "__main__":
    sys.exit(main())
