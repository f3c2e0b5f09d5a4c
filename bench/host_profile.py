#!/usr/bin/env python3
"""Where a running vLLM server's CPU time goes at steady decode, without the torch profiler.

    python bench/host_profile.py --base-url http://127.0.0.1:8001 --model flash --pid SERVER_PID
        --label cutedsl-nvfp4 --concurrency 4 [--window-s 8] [--py-spy PATH] [--py-spy-s 8]
        --out H.json [--md H.md]

Workload: the one of `profile_server.py run` (C streamed greedy completions of --prompt-len
token-id prompts, ignore_eos, --max-tokens long enough to outlast both windows); measuring starts
once every stream has --warm-tokens tokens, so the server decodes at batch C throughout.

1. Clean window (nothing attached to the server), --window-s seconds:
   - the tokens the clients received: decode tok/s and the step time C / (tok/s), the number the
     torch profiler inflates;
   - the CPU time of every thread of the server's processes: its process group (the drivers
     start servers with setsid, so --pid is the group id, as their `kill -- -PID` assumes), from
     /proc/PID/task/TID/stat, in % of one core;
   - the whole host's busy share (/proc/stat) and the busiest processes outside the server, so
     that a slow run that shares the host with something else says so.
2. With --py-spy (a py-spy binary; nothing when empty): `py-spy record --nonblocking --threads
   --format raw` of the server's busiest processes (--py-spy-procs, by CPU in the clean window),
   all at once, for --py-spy-s seconds; per process and thread: samples, and the functions with
   the largest inclusive and self shares of that thread's samples. py-spy samples running
   threads only (a thread waiting on a lock, the GIL or the GPU is not sampled).

Output JSON: command, date, label, base_url, pid, workload (concurrency, window_s,
tokens_in_window, tok_per_s, step_ms), host (cpus, busy_pct), threads (rows: pid, process, tid,
thread, cpu_pct), processes (rows: pid, process, threads, cpu_pct), foreign (rows: pid, process,
cpu_pct), py_spy (per process: command, samples, errors, threads with inclusive/self rows),
errors. --md: the same as tables. Exit status: 0; 1 when the workload failed (a stream error, no
token in the window) or no process of the group was found; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_server import start_decode  # noqa: E402

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
THREAD_MIN_PCT = 1.0  # threads below this share of one core are summed per process only
FOREIGN_TOP = 8
PY_SPY_TOP = 40  # rows kept per table in the JSON (the Markdown shows fewer)
PY_SPY_MD_TOP = 25
_RAW_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_LINE_NO = re.compile(r":\d+\)$")


# --------------------------------------------------------------------------- /proc


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _cmdline(pid: int, width: int = 100) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    cmd = " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)
    if not cmd:
        try:
            cmd = "[" + (PROC / str(pid) / "comm").read_text().strip() + "]"
        except OSError:
            cmd = "?"
    return cmd if len(cmd) <= width else cmd[: width - 3] + "..."


def group_pids(pgid: int) -> list[int]:
    """Every process of process group `pgid` (a setsid'd server and all it started)."""
    out = []
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        f = _stat_fields(d / "stat")
        # after the name: state, ppid, pgrp (field 5 of stat)
        if f is not None and len(f) > 2 and int(f[2]) == pgid:
            out.append(int(d.name))
    return sorted(out)


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """{(pid, tid): (thread name, utime + stime in clock ticks)} of every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            d = PROC / str(pid) / "task" / str(tid)
            f = _stat_fields(d / "stat")
            if f is None or len(f) < 13:
                continue
            try:
                name = (d / "comm").read_text().strip()
            except OSError:
                name = "?"
            out[(pid, tid)] = (name, int(f[11]) + int(f[12]))  # utime, stime (fields 14, 15)
    return out


def process_ticks() -> dict[int, int]:
    """{pid: utime + stime} of every process on the host (its threads together)."""
    out = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            f = _stat_fields(d / "stat")
            if f is not None and len(f) >= 13:
                out[int(d.name)] = int(f[11]) + int(f[12])
    return out


def host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    vals = [int(x) for x in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def measure_cpu(pgid: int, window_s: float) -> dict:
    """CPU use of process group `pgid`'s threads, of the host and of the busiest foreign processes
    over `window_s` seconds."""
    pids0 = group_pids(pgid)
    t0, p0, h0 = thread_ticks(pids0), process_ticks(), host_jiffies()
    w0 = time.monotonic()
    time.sleep(window_s)
    pids1 = sorted(set(pids0) | set(group_pids(pgid)))
    t1, p1, h1 = thread_ticks(pids1), process_ticks(), host_jiffies()
    wall = time.monotonic() - w0
    pct = 100.0 / (TICKS * wall)
    names = {pid: _cmdline(pid) for pid in pids1}
    threads = []
    for key, (name, ticks) in t1.items():
        d = (ticks - t0.get(key, (name, 0))[1]) * pct
        threads.append({"pid": key[0], "process": names[key[0]], "tid": key[1], "thread": name,
                        "cpu_pct": round(d, 1)})  # fmt: skip
    threads.sort(key=lambda r: -r["cpu_pct"])
    procs = defaultdict(lambda: [0.0, 0])
    for r in threads:
        procs[r["pid"]][0] += r["cpu_pct"]
        procs[r["pid"]][1] += 1
    processes = sorted(
        ({"pid": p, "process": names[p], "threads": n, "cpu_pct": round(c, 1)}
         for p, (c, n) in procs.items()),
        key=lambda r: -r["cpu_pct"],
    )  # fmt: skip
    mine = set(pids1) | {os.getpid()}
    foreign = sorted(
        ({"pid": p, "process": _cmdline(p), "cpu_pct": round((v - p0.get(p, 0)) * pct, 1)}
         for p, v in p1.items() if p not in mine and v - p0.get(p, 0) > 0),
        key=lambda r: -r["cpu_pct"],
    )[:FOREIGN_TOP]  # fmt: skip
    busy, total = h1[0] - h0[0], h1[1] - h0[1]
    return {
        "window_s": round(wall, 2),
        "host": {"cpus": os.cpu_count(), "busy_pct": round(100.0 * busy / max(total, 1), 1)},
        "threads": [r for r in threads if r["cpu_pct"] >= THREAD_MIN_PCT],
        "processes": processes,
        "foreign": foreign,
    }


# --------------------------------------------------------------------------- py-spy


def function_of(frame: str) -> str:
    """A py-spy frame without its line number: `f (file.py:12)` -> `f (file.py)`."""
    return _LINE_NO.sub(")", frame)


def parse_raw(text: str, top: int = PY_SPY_TOP) -> list[dict]:
    """py-spy's raw output with --threads (`thread (TID): NAME;frame;frame... COUNT` per line)
    -> per thread: samples, and the `top` frames by inclusive and by self share, per source line
    (`inclusive`, `self`) and per function, all its lines summed (`inclusive_by_function`,
    `self_by_function`: where a function's time is spread over many lines, as in a metadata
    builder, only these show its share)."""
    per: dict[str, dict] = {}
    for line in text.splitlines():
        m = _RAW_LINE.match(line.strip())
        if not m:
            continue
        frames = m["stack"].split(";")
        n = int(m["count"])
        t = per.setdefault(frames[0], {"samples": 0, "inc": Counter(), "self": Counter(),
                                       "inc_fn": Counter(), "self_fn": Counter()})  # fmt: skip
        t["samples"] += n
        stack = frames[1:]
        for f in set(stack):  # a recursive function counts once per sample
            t["inc"][f] += n
        for f in {function_of(f) for f in stack}:
            t["inc_fn"][f] += n
        if stack:
            t["self"][stack[-1]] += n
            t["self_fn"][function_of(stack[-1])] += n
    out = []
    for name, t in sorted(per.items(), key=lambda kv: -kv[1]["samples"]):
        s = max(t["samples"], 1)

        def rows(c: Counter, s: int = s) -> list[dict]:
            return [{"function": f, "pct": round(100.0 * n / s, 1)} for f, n in c.most_common(top)]

        out.append({
            "thread": name, "samples": t["samples"],
            "inclusive": rows(t["inc"]), "self": rows(t["self"]),
            "inclusive_by_function": rows(t["inc_fn"]), "self_by_function": rows(t["self_fn"]),
        })  # fmt: skip
    return out


def py_spy(binary: str, pids: list[int], seconds: float, rate: int) -> dict[int, dict]:
    """`py-spy record` of each pid at once -> {pid: {command, samples, errors, threads}}."""
    tmp = Path(tempfile.mkdtemp(prefix="host-profile-"))
    runs = {}
    for pid in pids:
        out = tmp / f"{pid}.txt"
        cmd = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
               "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking",
               "--output", str(out)]  # fmt: skip
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)  # fmt: skip
        except OSError as e:
            runs[pid] = (cmd, None, out, f"{type(e).__name__}: {e}")
            continue
        runs[pid] = (cmd, proc, out, None)
    res = {}
    for pid, (cmd, proc, out, err) in runs.items():
        log = ""
        if proc is not None:
            try:
                log = proc.communicate(timeout=seconds + 60)[0].decode(errors="replace")
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0].decode(errors="replace")
                err = f"py-spy did not finish in {seconds + 60:.0f} s"
            if err is None and proc.returncode != 0:
                err = f"py-spy exited with {proc.returncode}: " + " | ".join(
                    log.strip().splitlines()[-3:]
                )
        m = re.search(r"Samples: (\d+) Errors: (\d+)", log)
        text = out.read_text(errors="replace") if out.exists() else ""
        out.unlink(missing_ok=True)
        res[pid] = {"command": shlex.join(cmd), "samples": int(m[1]) if m else None,
                    "errors": int(m[2]) if m else None, "threads": parse_raw(text),
                    "error": err}  # fmt: skip
    tmp.rmdir()
    return res


# --------------------------------------------------------------------------- run


def run(a: argparse.Namespace) -> dict:
    stop = threading.Event()
    streams, _, errors = start_decode(a, stop)
    w0 = time.monotonic()
    cpu = measure_cpu(a.pid, a.window_s)
    w1 = time.monotonic()
    spy = {}
    if a.py_spy:
        spy_pids = [r["pid"] for r in cpu["processes"][: a.py_spy_procs] if r["cpu_pct"] > 0]
        spy = py_spy(a.py_spy, spy_pids, a.py_spy_s, a.py_spy_rate)
        for pid, r in spy.items():
            if r["error"]:
                errors.append(f"py-spy {pid}: {r['error']}")
    stop.set()
    for s in streams:
        s.join(timeout=5)
    errors += [f"stream: {s.error}" for s in streams if s.error]
    finished = sum(s.finished for s in streams)
    if finished:
        errors.append(f"{finished} streams finished inside the workload: raise --max-tokens")
    tokens = sum(sum(w0 <= t <= w1 for t in s.times) for s in streams)
    tok_s = tokens / max(w1 - w0, 1e-9)
    if not tokens:
        errors.append("no token arrived in the clean window")
    if not cpu["processes"]:
        errors.append(f"no process in group {a.pid} (is --pid the server's setsid pid?)")
    workload = {
        "concurrency": a.concurrency, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
        "seed": a.seed, "window_s": cpu.pop("window_s"), "tokens_in_window": tokens,
        "tok_per_s": round(tok_s, 1),
        "step_ms": round(1000.0 * a.concurrency / tok_s, 3) if tokens else None,
    }  # fmt: skip
    return {"workload": workload, **cpu,
            "py_spy": {str(k): v for k, v in spy.items()}, "errors": errors}  # fmt: skip


def markdown(res: dict) -> str:
    w, h = res["workload"], res["host"]
    lines = [
        f"# Host profile: {res['label']}",
        "",
        f"`{res['command']}` ({res['date']})",
        "",
        f"Batch {w['concurrency']}: {w['tok_per_s']} tok/s over {w['window_s']} s, decode step "
        f"{w['step_ms']} ms (no profiler attached). Host: {h['cpus']} CPUs, {h['busy_pct']} % busy.",
        "",
        "## Server processes (% of one core)",
        "",
        "| pid | process | threads | CPU % |",
        "|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r['pid']} | `{r['process']}` | {r['threads']} | {r['cpu_pct']} |"
        for r in res["processes"]
    ]
    lines += ["", f"## Server threads at >= {THREAD_MIN_PCT} % of one core", "",
              "| pid | tid | thread | CPU % |", "|---:|---:|---|---:|"]  # fmt: skip
    lines += [
        f"| {r['pid']} | {r['tid']} | {r['thread']} | {r['cpu_pct']} |" for r in res["threads"]
    ]
    lines += [
        "",
        "## Busiest processes outside the server",
        "",
        "| pid | process | CPU % |",
        "|---:|---|---:|",
    ]
    lines += [f"| {r['pid']} | `{r['process']}` | {r['cpu_pct']} |" for r in res["foreign"]]
    for pid, r in res["py_spy"].items():
        lines += ["", f"## py-spy: pid {pid} ({r['samples']} samples, {r['errors']} errors)", ""]
        if r["error"]:
            lines += [f"Error: {r['error']}", ""]
        for t in r["threads"][:4]:
            lines += [f"### {t['thread']}: {t['samples']} samples", ""]
            for title, inc_key, self_key in (
                ("per function (all its lines)", "inclusive_by_function", "self_by_function"),
                ("per source line", "inclusive", "self"),
            ):
                inc_rows = t.get(inc_key, [])[:PY_SPY_MD_TOP]
                self_rows = t.get(self_key, [])[:PY_SPY_MD_TOP]
                if not inc_rows and not self_rows:
                    continue
                lines += [f"{title}:", "", "| inclusive % | function | self % | function |",
                          "|---:|---|---:|---|"]  # fmt: skip
                blank = {"pct": "", "function": ""}
                for i in range(max(len(inc_rows), len(self_rows))):
                    inc = inc_rows[i] if i < len(inc_rows) else blank
                    slf = self_rows[i] if i < len(self_rows) else blank
                    lines.append(
                        f"| {inc['pct']} | `{inc['function']}` | {slf['pct']} | `{slf['function']}` |"
                    )
                lines.append("")
    if res["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True, help="model id as served")
    ap.add_argument(
        "--pid", type=int, required=True, help="the server's pid (its process group id)"
    )
    ap.add_argument("--label", default="server")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument(
        "--max-tokens", type=int, default=4096, help="long enough to outlast both windows"
    )
    ap.add_argument("--warm-tokens", type=int, default=8, help="tokens per stream before measuring")
    ap.add_argument("--window-s", type=float, default=8.0, help="the clean window")
    ap.add_argument("--py-spy", default="", help="py-spy binary; empty: no sampling")
    ap.add_argument("--py-spy-s", type=float, default=8.0)
    ap.add_argument("--py-spy-rate", type=int, default=200, help="samples per second")
    ap.add_argument(
        "--py-spy-procs", type=int, default=2, help="the busiest server processes sampled"
    )
    ap.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this")
    ap.add_argument("--vocab-lo", type=int, default=10, help="and at or above this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-timeout", type=float, default=120.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="", help="result JSON")
    ap.add_argument("--md", default="", help="markdown tables")
    a = ap.parse_args(argv)
    if min(a.concurrency, a.prompt_len, a.max_tokens, a.warm_tokens, a.py_spy_rate, a.py_spy_procs) < 1 \
            or a.window_s <= 0 or a.py_spy_s <= 0 or a.vocab <= a.vocab_lo:  # fmt: skip
        print(
            "host_profile: sizes and windows must be positive and --vocab > --vocab-lo",
            file=sys.stderr,
        )
        return 2
    if not (PROC / str(a.pid)).exists():
        print(f"host_profile: --pid {a.pid}: no such process", file=sys.stderr)
        return 2
    if a.py_spy and not os.access(a.py_spy, os.X_OK):
        print(f"host_profile: --py-spy {a.py_spy}: not an executable file", file=sys.stderr)
        return 2
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/host_profile.py", *argv])])  # fmt: skip
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res = {"command": command, "date": date, "label": a.label, "base_url": a.base_url,
           "pid": a.pid, **run(a)}  # fmt: skip
    text = markdown(res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(text)
    print(text)
    for e in res["errors"]:
        print(f"host_profile: {e}", file=sys.stderr)
    failed = any(e.startswith(("stream:", "no token", "no process")) or "streams had <" in e
                 for e in res["errors"])  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
