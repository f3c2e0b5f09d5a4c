"""bench/host_profile.py: the clean-window CPU accounting of a server's process group (threads by name,
child processes, foreign load) on real processes, py-spy's raw output parsed per thread, the
py-spy invocation through a stand-in binary, and the decode workload against a stub server."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from stub_stream import serve, stream_tokens

_spec = importlib.util.spec_from_file_location(
    "host_profile", Path(__file__).parents[1] / "bench" / "host_profile.py"
)
hp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hp)

# A stand-in server: a process group leader with a spinning thread named "spinner" and an idle child.
_BUSY = textwrap.dedent(
    """
    import ctypes, subprocess, sys, threading, time
    def spin():
        ctypes.CDLL(None).prctl(15, b"spinner", 0, 0, 0)  # PR_SET_NAME: the thread's comm
        x = 0
        while True:
            x += 1
    threading.Thread(target=spin, daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def busy_group():
    proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    child = int(proc.stdout.readline())
    try:
        yield proc.pid, child
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_measure_cpu_finds_the_group_threads(busy_group) -> None:
    pid, child = busy_group
    assert hp.group_pids(pid) == sorted([pid, child])
    res = hp.measure_cpu(pid, 1.5)
    spin = [r for r in res["threads"] if r["thread"] == "spinner"]
    assert len(spin) == 1 and spin[0]["pid"] == pid and spin[0]["cpu_pct"] > 20, res["threads"]
    procs = {r["pid"]: r for r in res["processes"]}
    assert set(procs) == {pid, child}
    assert procs[pid]["cpu_pct"] >= spin[0]["cpu_pct"] and procs[pid]["threads"] >= 2
    assert procs[child]["cpu_pct"] < 5 and "time.sleep(120)" in procs[child]["process"]
    assert not {pid, child, os.getpid()} & {r["pid"] for r in res["foreign"]}
    assert 0 < res["host"]["busy_pct"] <= 100 and res["host"]["cpus"] == os.cpu_count()


def test_foreign_load_is_named(busy_group) -> None:
    """A busy process outside the measured group shows in `foreign`, not in the server's rows."""
    pid, _ = busy_group
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        res = hp.measure_cpu(idle.pid, 1.5)
    finally:
        idle.kill()
        idle.wait()
    assert [r["pid"] for r in res["processes"]] == [idle.pid]
    foreign = {r["pid"]: r["cpu_pct"] for r in res["foreign"]}
    assert foreign.get(pid, 0) > 20, res["foreign"]


def test_parse_raw() -> None:
    raw = "\n".join([
        "thread (11): MainThread;step (core.py:10);schedule (sched.py:5);alloc (kv.py:7) 30",
        "thread (11): MainThread;step (core.py:10);build (meta.py:3) 50",
        "thread (11): MainThread;f (r.py:1);f (r.py:1) 20",  # recursion counts once
        "thread (12): worker;loop (w.py:2) 5",
        "garbage line",
    ])  # fmt: skip
    threads = hp.parse_raw(raw)
    assert [t["thread"] for t in threads] == ["thread (11): MainThread", "thread (12): worker"]
    main = threads[0]
    assert main["samples"] == 100
    inc = {r["function"]: r["pct"] for r in main["inclusive"]}
    assert inc == {"step (core.py:10)": 80.0, "build (meta.py:3)": 50.0, "schedule (sched.py:5)": 30.0,
                   "alloc (kv.py:7)": 30.0, "f (r.py:1)": 20.0}  # fmt: skip
    assert main["self"][0] == {"function": "build (meta.py:3)", "pct": 50.0}
    assert sum(r["pct"] for r in main["self"]) == 100.0


def test_parse_raw_by_function() -> None:
    """A function whose time is spread over its lines is one row per function, each sample
    counted once per function however many of its lines are on the stack."""
    raw = "\n".join([
        "thread (11): Main;step (core.py:10);build (meta.py:3) 30",
        "thread (11): Main;step (core.py:10);build (meta.py:4) 25",
        "thread (11): Main;step (core.py:12);build (meta.py:5);build (meta.py:9) 5",
        "thread (11): Main;step (core.py:12);copy (utils.py:7) 40",
    ])  # fmt: skip
    main = hp.parse_raw(raw)[0]
    assert main["samples"] == 100
    assert max(r["pct"] for r in main["self"]) == 40.0  # per line, copy leads
    inc = {r["function"]: r["pct"] for r in main["inclusive_by_function"]}
    assert inc == {"step (core.py)": 100.0, "build (meta.py)": 60.0, "copy (utils.py)": 40.0}
    assert main["self_by_function"][0] == {"function": "build (meta.py)", "pct": 60.0}
    assert hp.function_of("f (a/b.py:12)") == "f (a/b.py)"
    assert hp.function_of("<module> (<string>:1)") == "<module> (<string>)"
    md = hp.markdown({
        "label": "x", "command": "c", "date": "d", "errors": [],
        "workload": {"concurrency": 1, "tok_per_s": 1.0, "window_s": 1.0, "step_ms": 1.0},
        "host": {"cpus": 1, "busy_pct": 1.0}, "processes": [], "threads": [], "foreign": [],
        "py_spy": {"11": {"samples": 100, "errors": 0, "error": None, "threads": [main]}},
    })  # fmt: skip
    assert "per function (all its lines)" in md and "| 60.0 | `build (meta.py)` |" in md


def _fake_py_spy(tmp_path: Path, fail: bool = False) -> Path:
    """Writes one raw stack for the pid it is given; logs its arguments."""
    p = tmp_path / "py-spy"
    p.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        a = sys.argv[1:]
        open({str(tmp_path / "args.jsonl")!r}, "a").write(json.dumps(a) + "\\n")
        if {fail!r}:
            print("Permission Denied: ptrace"); sys.exit(1)
        pid = a[a.index("--pid") + 1]
        open(a[a.index("--output") + 1], "w").write(f"thread (1): MainThread;busy{{pid}} (x.py:1) 7\\n")
        print("py-spy> Wrote raw flamegraph data. Samples: 7 Errors: 0")
        """))  # fmt: skip
    p.chmod(0o755)
    return p


def test_py_spy_invocation(tmp_path: Path) -> None:
    res = hp.py_spy(str(_fake_py_spy(tmp_path)), [101, 202], 1.0, 50)
    assert set(res) == {101, 202}
    for pid, r in res.items():
        assert r["error"] is None and r["samples"] == 7 and r["errors"] == 0
        assert r["threads"][0]["self"] == [{"function": f"busy{pid} (x.py:1)", "pct": 100.0}]
    args = [json.loads(x) for x in (tmp_path / "args.jsonl").read_text().splitlines()]
    for a in args:
        assert a[0] == "record" and {"--nonblocking", "--threads"} <= set(a)
        assert a[a.index("--format") + 1] == "raw" and a[a.index("--rate") + 1] == "50"


def test_py_spy_failure_is_reported(tmp_path: Path) -> None:
    r = hp.py_spy(str(_fake_py_spy(tmp_path, fail=True)), [7], 1.0, 50)[7]
    assert (
        "exited with 1" in r["error"] and "Permission Denied" in r["error"] and r["threads"] == []
    )


def _stub_server():
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            stream_tokens(self, body["max_tokens"], 0.01)

    return serve(H)


def test_main_against_stub(tmp_path: Path, busy_group) -> None:
    pid, _ = busy_group
    srv, url = _stub_server()
    out, md = tmp_path / "h.json", tmp_path / "h.md"
    try:
        rc = hp.main(["--base-url", url, "--model", "m", "--pid", str(pid), "--label", "stub",
                      "--concurrency", "3", "--prompt-len", "8", "--max-tokens", "100000",
                      "--window-s", "1.0", "--py-spy", str(_fake_py_spy(tmp_path)), "--py-spy-s", "1",
                      "--py-spy-procs", "1", "--out", str(out), "--md", str(md)])  # fmt: skip
    finally:
        srv.shutdown()
    res = json.loads(out.read_text())
    assert rc == 0, res["errors"]
    w = res["workload"]
    assert w["concurrency"] == 3 and w["tokens_in_window"] > 3 * 40  # ~100 tokens/s per stream
    assert 10 < w["step_ms"] < 40
    assert list(res["py_spy"]) == [str(pid)]  # the busiest process of the group
    text = md.read_text()
    assert "Host profile: stub" in text and "spinner" in text and f"busy{pid}" in text


def test_bad_arguments(tmp_path: Path) -> None:
    assert hp.main(["--base-url", "http://127.0.0.1:1", "--model", "m", "--pid", "999999999"]) == 2
    assert hp.main(["--base-url", "http://127.0.0.1:1", "--model", "m", "--pid", str(os.getpid()),
                    "--py-spy", str(tmp_path / "nope")]) == 2  # fmt: skip
    assert hp.main(["--base-url", "http://127.0.0.1:1", "--model", "m", "--pid", str(os.getpid()),
                    "--window-s", "0"]) == 2  # fmt: skip
