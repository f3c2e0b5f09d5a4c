"""Start-up benchmark: time from launch to a healthy vLLM server, then the time to first token of
the first request at several batch sizes, and every compile after the server said healthy.

    python bench/startup.py --impl ours --checkpoint tiny --cache cold --root DIR \\
        --port 8001 --out OUT/startup.json -- bash scripts/serve.sh CKPT [vllm args...]

One run = one record (impl, checkpoint, cache) in --out (a record of the same triple is
replaced; the others are kept):
- caches: every JIT cache the server may write lives under --root (CUTEDSL_CACHE_DIR,
  TILELANG_CACHE_DIR, VLLM_CACHE_ROOT, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
  CUTE_DSL_CACHE_DIR, DG_JIT_CACHE_DIR, XDG_CACHE_HOME). `--cache cold` empties --root first;
  `--cache warm` keeps what the previous start left there.
- to_healthy_s: from starting the command to the first 200 from GET /health.
- first_token_s: for each --batch size B in order, B concurrent streamed completions (a fixed
  --prompt-len token-id prompt, distinct per request, --max-tokens tokens) sent at once; the
  slowest request's time to its first token (a compile in the step stalls every request in it).
  Each size is the server's first request of that size.
- compiles_after_healthy: files created or changed under --root after /health first answered
  (compiled kernels of any JIT: ours, TileLang, Triton, inductor, DeepGEMM), counted once the
  requests are done; `new_cache_files` lists them (first 40).
- log_times: the phases the server log reports (mHC prewarm, weight loading, torch.compile,
  engine init, CUDA-graph capture), as logged.
The server runs in its own process group and is stopped (SIGTERM, then SIGKILL) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CACHE_VARS = {
    "CUTEDSL_CACHE_DIR": "cutedsl",
    "TILELANG_CACHE_DIR": "tilelang",
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUTE_DSL_CACHE_DIR": "cute_dsl",
    "DG_JIT_CACHE_DIR": "deep_gemm",
    "XDG_CACHE_HOME": "xdg",
}
# Files a JIT writes that are not compiled code (locks, temporaries, logs).
_NOT_KERNELS = re.compile(r"(\.lock|\.tmp|\.log|/tmp/.*|\.staging/.*)$")
LOG_TIMES = {
    "mhc_prewarm_s": r"prewarm_mhc: .*?ready in ([\d.]+) s",
    "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) second",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) sec",
}


def cache_env(root: Path) -> dict[str, str]:
    """The environment that puts every JIT cache under `root`."""
    return {var: str(root / sub) for var, sub in CACHE_VARS.items()}


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    """Relative path -> (size, mtime) of every kernel-like file under `root`."""
    out = {}
    if not root.exists():
        return out
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not _NOT_KERNELS.search(rel):
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime)
    return out


def changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k, v in after.items() if before.get(k) != v)


def log_times(text: str) -> dict[str, float]:
    out = {}
    for name, pattern in LOG_TIMES.items():
        found = re.findall(pattern, text)
        if found:
            out[name] = float(found[-1])
    if re.search(r"prewarm_mhc: nothing to do", text):
        out["mhc_prewarm_s"] = 0.0
    return out


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def _ttft(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> float:
    """Seconds from sending a streamed completion to its first streamed token."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "temperature": 0.0, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                doc = json.loads(line[5:])
                if doc.get("choices") and doc["choices"][0].get("text") is not None:
                    return time.monotonic() - t0
    raise RuntimeError("stream ended without a token")


def first_tokens(
    base: str, model: str, batches: list[int], prompt_len: int, max_tokens: int, timeout: float
) -> dict[str, float]:
    """{batch size: the slowest first-token time of that batch} (module docstring)."""
    out = {}
    n = 0
    for b in batches:
        times: list[float] = []
        errors: list[str] = []

        def one(i: int, times=times, errors=errors) -> None:
            # distinct prompts: no prefix-cache hit between requests
            prompt = [(17 * i + 3 * j) % 200 + 10 for j in range(prompt_len)]
            try:
                times.append(_ttft(f"{base}/v1/completions", model, prompt, max_tokens, timeout))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(n + i,)) for i in range(b)]
        n += b
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"batch {b}: {len(errors)} requests failed: {errors[0]}")
        out[str(b)] = round(max(times), 3)
    return out


def _served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _commit() -> str:
    """HEAD of this checkout (+ whether tracked files changed); where the checkout has no git
    metadata (a copy of the tree), $COMMIT as the caller names it, else "unknown"."""
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout  # fmt: skip
        return sha + (" (with local changes)" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("COMMIT") or "unknown"


def save(out: Path, record: dict) -> None:
    """Replace the record of the same (impl, checkpoint, cache) in `out`; write atomically."""
    doc = {"records": []}
    if out.exists():
        doc = json.loads(out.read_text())
    ident = (record["impl"], record["checkpoint"], record["cache"])
    doc["records"] = [
        r for r in doc["records"] if (r["impl"], r["checkpoint"], r["cache"]) != ident
    ]
    doc["records"].append(record)
    doc["records"].sort(key=lambda r: (r["checkpoint"], r["impl"], r["cache"] != "cold"))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)


def run(a: argparse.Namespace) -> dict:
    root = Path(a.root).resolve()
    if a.cache == "cold" and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **cache_env(root), PORT=str(a.port))
    base = f"http://127.0.0.1:{a.port}"
    if _get(f"{base}/health", 2):
        raise SystemExit(f"startup.py: port {a.port} already serves /health; stop that server")
    log = Path(a.log)
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(a.command, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        while _get(f"{base}/health", 2) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before healthy ({log})")
            if time.monotonic() - t0 > a.timeout:
                raise RuntimeError(f"not healthy after {a.timeout:.0f} s ({log})")
            time.sleep(0.2)
        healthy = round(time.monotonic() - t0, 2)
        at_healthy = snapshot(root)
        model = _served_model(base)
        ttft = first_tokens(base, model, a.batch, a.prompt_len, a.max_tokens, a.request_timeout)
        time.sleep(a.settle)  # a compile's cache write may land just after its step
        new = changed(at_healthy, snapshot(root))
    finally:
        stop(proc)
    return {
        "impl": a.impl,
        "checkpoint": a.checkpoint,
        "cache": a.cache,
        "to_healthy_s": healthy,
        "first_token_s": ttft,
        "compiles_after_healthy": len(new),
        "new_cache_files": new[:40],
        "log_times": log_times(log.read_text(errors="replace")),
        "prompt_len": a.prompt_len,
        "command": " ".join(a.command),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": _device(),
        "commit": _commit(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    ap.add_argument("--impl", required=True, help="label: ours | upstream")
    ap.add_argument("--checkpoint", required=True, help="label: tiny | flash-layers")
    ap.add_argument("--cache", required=True, choices=("cold", "warm"))
    ap.add_argument("--root", required=True, help="folder holding every JIT cache of this server")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", required=True, help="JSON file of records (updated in place)")
    ap.add_argument("--log", default="", help="server log (default: beside --out)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to healthy")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    a = ap.parse_args(argv)
    if a.command and a.command[0] == "--":
        a.command = a.command[1:]
    if not a.command:
        ap.error("give the server command after --")
    if any(b < 1 for b in a.batch) or a.prompt_len < 1:
        ap.error("--batch sizes and --prompt-len must be >= 1")
    out = Path(a.out)
    if not out.parent.is_dir():
        ap.error(f"--out {out}: folder {out.parent} does not exist")
    if not a.log:
        a.log = str(out.with_name(f"startup_{a.impl}_{a.checkpoint}_{a.cache}.log"))
    rec = run(a)
    save(out, rec)
    print(json.dumps({k: rec[k] for k in ("impl", "checkpoint", "cache", "to_healthy_s",
                                          "first_token_s", "compiles_after_healthy")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
