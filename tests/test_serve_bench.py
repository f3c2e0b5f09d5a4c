"""bench/serve_bench.py runs the real `vllm bench serve` CLI of the pinned vLLM against a stub
OpenAI completions server (streaming, usage, /v1/models with max_model_len) and parses what that
CLI saves; bench/plot_serve.py turns result files into one markdown table (and a PNG)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cutedsl.tools.tiny_tokenizer import tokenizer_files

ROOT = Path(__file__).parents[1]
VOCAB = 4096  # the flash-layers preset's vocab_size


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


serve_bench = _load("serve_bench")
plot_serve = _load("plot_serve")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    for fn, obj in tokenizer_files(VOCAB).items():
        (d / fn).write_text(json.dumps(obj))
    return d


def _stub(tok_dir: Path, model: str, max_model_len: int):
    """Stub vLLM server; counts prompt tokens with the tiny tokenizer; logs every request."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    seen: list[dict] = []
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _json(self, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/v1/models":
                self.send_error(404)
                return
            self._json({"object": "list", "data": [
                {"id": model, "object": "model", "max_model_len": max_model_len}]})  # fmt: skip

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("model") != model:
                self.send_error(404)
                return
            n_prompt = len(tok.encode(body["prompt"], add_special_tokens=False))
            with lock:
                seen.append({**body, "n_prompt": n_prompt})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(body["max_tokens"]):
                time.sleep(0.002)
                ch = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def test_helpers() -> None:
    assert serve_bench.parse_shapes("1024x1024, 8192X1024") == [(1024, 1024), (8192, 1024)]
    for bad in ("1024", "0x8", "ax8"):
        with pytest.raises(ValueError, match="--shapes"):
            serve_bench.parse_shapes(bad)
    fit = serve_bench.fit_shape
    assert fit(1024, 1024, 4096, 16) == (1024, 1024)
    assert fit(8192, 1024, None, 16) == (8192, 1024)
    a, b = fit(8192, 1024, 4096, 16)  # 4080 / 9216
    assert (a, b) == (math.floor(8192 * 4080 / 9216), math.floor(1024 * 4080 / 9216))
    assert a + b <= 4080
    with pytest.raises(ValueError, match="cannot fit"):
        fit(100, 100, 10, 9)
    skip = serve_bench.should_skip
    assert not skip(None, 100.0) and not skip(10.0, None) and not skip(10.0, 9.0)
    assert skip(10.0, 11.0) and skip(0.0, None)
    assert skip(10.0, None, 20.0) and not skip(30.0, None, 20.0) and skip(30.0, 31.0, 20.0)


def test_end_to_end_real_cli(tok_dir: Path, tmp_path: Path) -> None:
    srv, url, seen = _stub(tok_dir, str(tok_dir), max_model_len=64)
    out = tmp_path / "ours.json"
    try:
        # 16x8 fits; 64x32 (96 > 64 - 4) is scaled by 60/96 to 40x20.
        rc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--base-url", url,
             "--model", str(tok_dir), "--label", "stub", "--shapes", "16x8,64x32",
             "--concurrency", "1,2", "--prompts-per-concurrency", "2", "--fit-margin", "4",
             "--seed", "3", "--out", str(out), "--log-dir", str(tmp_path / "logs"),
             "--run-timeout", "240"],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        srv.shutdown()
    assert rc.returncode == 0, rc.stdout + rc.stderr
    assert rc.stdout.count("stub_") == 4, rc.stdout  # one progress line per run
    doc = json.loads(out.read_text())
    h = doc["header"]
    assert h["vllm_version"] == importlib.metadata.version("vllm") == "0.21.0"
    assert h["max_model_len"] == 64 and h["label"] == "stub" and "serve_bench.py" in h["command"]
    assert h["date"].endswith("+00:00") and h["device"]
    runs = doc["runs"]
    want = [("16x8", "16x8", 1), ("16x8", "16x8", 2), ("64x32", "40x20", 1), ("64x32", "40x20", 2)]
    assert [(r["requested_shape"], r["shape"], r["concurrency"]) for r in runs] == want
    for r in runs:
        n, inp, outl = 2 * r["concurrency"], r["input_len"], r["output_len"]
        assert r["status"] == "ok", r
        assert (r["num_prompts"], r["completed"], r["failed"]) == (n, n, 0)
        assert r["total_input_tokens"] == n * inp and r["total_output_tokens"] == n * outl
        cmd = r["command"].split()
        assert cmd[cmd.index("--max-concurrency") + 1] == str(r["concurrency"])
        assert cmd[cmd.index("--random-input-len") + 1] == str(inp)
        assert cmd[cmd.index("--random-output-len") + 1] == str(outl)
        assert cmd[cmd.index("--num-prompts") + 1] == str(n)
        assert math.isclose(r["output_throughput"], n * outl / r["duration"], rel_tol=1e-9)
        assert math.isclose(r["request_throughput"], n / r["duration"], rel_tol=1e-9)
        tot = n * (inp + outl) / r["duration"]
        assert math.isclose(r["total_token_throughput"], tot, rel_tol=1e-9)
        for m in ("ttft", "tpot", "itl", "e2el"):
            vals = [r[f"{s}_{m}_ms"] for s in ("mean", "median", "p90", "p99")]
            assert all(v is not None and math.isfinite(v) and v > 0 for v in vals), (m, vals)
            assert r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"]
        # The stub sleeps 2 ms before every token, so TPOT/ITL cannot be below that.
        assert r["median_tpot_ms"] >= 2.0 and r["median_itl_ms"] >= 2.0
        # one entry per request: its start after the first, its TTFT (the median is one of them)
        reqs = r["requests"]
        assert len(reqs) == n and min(q["start_s"] for q in reqs) == 0.0
        assert all(q["start_s"] >= 0 and q["ttft_ms"] > 0 for q in reqs), reqs
        ttfts = sorted(q["ttft_ms"] for q in reqs)
        assert ttfts[0] <= r["median_ttft_ms"] + 0.01 and r["median_ttft_ms"] <= ttfts[-1] + 0.01
    # What the server saw: exactly the benchmark's requests (no warmup / ready probe), random
    # prompts of exactly IN tokens, OUT max tokens, ignore_eos, greedy, streaming with usage.
    assert len(seen) == sum(2 * r["concurrency"] for r in runs)
    shapes_seen = sorted((s["n_prompt"], s["max_tokens"]) for s in seen)
    assert shapes_seen == sorted([(16, 8)] * 6 + [(40, 20)] * 6)
    assert all(s["ignore_eos"] and s["stream"] and s["temperature"] == 0.0 for s in seen)
    assert all(s["stream_options"] == {"include_usage": True} for s in seen)
    assert len({s["prompt"] for s in seen}) > 1  # random prompts, not one repeated string
    assert all(r["server"] is None for r in runs)  # the stub has no /metrics


def test_budget_timeout_and_skip(tok_dir: Path, tmp_path: Path) -> None:
    """A 2 s budget kills the first run (the CLI alone imports vLLM for ~15 s), keeps its record
    as "timeout", and skips the rest; the JSON is complete and the exit status is 1."""
    out = tmp_path / "b.json"
    t0 = time.monotonic()
    rc = serve_bench.main(["--base-url", "http://127.0.0.1:9", "--model", str(tok_dir),
                           "--label", "b", "--shapes", "16x8", "--concurrency", "1,2,4",
                           "--no-fit", "--time-budget", "2", "--out", str(out),
                           "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert rc == 1
    runs = json.loads(out.read_text())["runs"]
    assert [r["status"] for r in runs] == ["timeout", "skipped", "skipped"]
    assert runs[0]["wall_s"] < 10 and "bench serve" in runs[0]["command"]
    assert "time budget" in runs[1]["error"]


def test_bad_args(tmp_path: Path) -> None:
    base = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
            "--out", str(tmp_path / "x.json"), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert serve_bench.main([*base, "--shapes", "16"]) == 2
    assert serve_bench.main([*base, "--concurrency", "0"]) == 2
    assert serve_bench.main([*base, "--shapes", "100x100", "--max-model-len", "10"]) == 2
    assert not (tmp_path / "x.json").exists()


def _synthetic(path: Path, label: str, tput: dict, skipped: tuple = ()) -> Path:
    runs = []
    for (shape, conc), v in tput.items():
        runs.append(
            {
                "label": label,
                "requested_shape": shape,
                "shape": shape,
                "concurrency": conc,
                "num_prompts": 2 * conc,
                "status": "ok",
                "completed": 2 * conc,
                "failed": 0,
                "output_throughput": v,
                "median_ttft_ms": v / 10,
                "median_tpot_ms": 1000 / v,
                "duration": 1.0,
            }
        )
    for shape, conc in skipped:
        runs.append(
            {
                "label": label,
                "requested_shape": shape,
                "shape": shape,
                "concurrency": conc,
                "num_prompts": 2 * conc,
                "status": "skipped",
            }
        )
    hdr = {
        "command": f"python bench/serve_bench.py --label {label}",
        "label": label,
        "date": "2026-12-03T10:00:00+00:00",
        "device": "NVIDIA H200",
        "vllm_version": "0.21.0",
    }
    path.write_text(json.dumps({"header": hdr, "runs": runs}))
    return path


def test_plot_md(tmp_path: Path) -> None:
    ours = _synthetic(tmp_path / "o.json", "ours",
                      {("16x8", 1): 100.0, ("16x8", 8): 640.0, ("32x8", 1): 90.0},
                      skipped=(("32x8", 8),))  # fmt: skip
    base = _synthetic(tmp_path / "u.json", "up",
                      {("16x8", 1): 50.0, ("16x8", 8): 800.0, ("32x8", 8): 300.0})  # fmt: skip
    md = tmp_path / "t.md"
    assert plot_serve.main([str(ours), str(base), "--md", str(md)]) == 0
    text = md.read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in ("16x8", "32x8"):
            rows[(cells[0], int(cells[1]))] = cells[2:]
    # columns: ours tok/s, TTFT, TPOT, up tok/s, TTFT, TPOT, ours/up
    assert rows[("16x8", 1)] == ["100.0", "10.0", "10.00", "50.0", "5.0", "20.00", "2.00"]
    assert rows[("16x8", 8)] == ["640.0", "64.0", "1.56", "800.0", "80.0", "1.25", "0.80"]
    assert rows[("32x8", 1)] == ["90.0", "9.0", "11.11", "—", "—", "—", "—"]
    assert rows[("32x8", 8)] == ["skipped", "skipped", "skipped", "300.0", "30.0", "3.33", "—"]
    assert len(rows) == 4
    assert "ours/up" in text and "python bench/serve_bench.py --label ours" in text
    assert "2026-12-03T10:00:00+00:00" in text and "NVIDIA H200" in text
    # --baseline swaps the ratio's direction.
    assert plot_serve.main([str(ours), str(base), "--md", str(md), "--baseline", "ours"]) == 0
    ratios = {}
    for line in md.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in ("16x8", "32x8"):
            ratios[(cells[0], int(cells[1]))] = cells[8]
        elif cells[0] == "shape":
            assert cells[8] == "up/ours out tok/s"
    want = {("16x8", 1): "0.50", ("16x8", 8): "1.25", ("32x8", 1): "—", ("32x8", 8): "—"}
    assert ratios == want
    assert plot_serve.main([str(ours), "--md", str(md), "--baseline", "nope"]) == 2
    js = tmp_path / "t.json"
    assert plot_serve.main([str(ours), str(base), "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    assert doc["baseline"] == "up" and doc["labels"] == ["ours", "up"]
    got = {(r["shape"], r["concurrency"]): r for r in doc["rows"]}
    assert got[("16x8", 8)]["ratio"] == {"ours": 0.8}
    assert got[("16x8", 8)]["ours"]["output_throughput"] == 640.0
    assert got[("32x8", 1)]["up"] is None and got[("32x8", 1)]["ratio"] == {"ours": None}
    assert got[("32x8", 8)]["ours"]["status"] == "skipped"
    assert [s["label"] for s in doc["sources"]] == ["ours", "up"]


def test_plot_png_without_matplotlib(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here: the missing-matplotlib path cannot be tested")
    f = _synthetic(tmp_path / "o.json", "ours", {("16x8", 1): 100.0})
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plot_serve.py"), str(f),
         "--md", str(tmp_path / "t.md"), "--png", str(tmp_path / "t.png")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "matplotlib" in r.stderr and "--png" in r.stderr
    assert not (tmp_path / "t.png").exists()


def test_sigterm_kills_the_cli_and_keeps_the_row(tok_dir: Path, tmp_path: Path) -> None:
    """A driver's `timeout` sends SIGTERM: the CLI (own process group) must die with it, and the
    interrupted run must be in the JSON."""
    out, logs = tmp_path / "s.json", tmp_path / "logs"
    label = f"sigterm{time.monotonic_ns()}"
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--base-url",
         "http://127.0.0.1:9", "--model", str(tok_dir), "--label", label, "--shapes", "16x8",
         "--concurrency", "1,2", "--no-fit", "--out", str(out), "--log-dir", str(logs)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (logs / f"{label}_16x8_c1.log").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)

    def cli_pids() -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            try:
                cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if d.name.isdigit() and "bench\0serve" in cmdline and label in cmdline:
                pids.append(int(d.name))
        return pids

    assert cli_pids(), "the benchmark CLI did not start"
    p.terminate()
    stdout, _ = p.communicate(timeout=30)
    assert p.returncode == 143, stdout
    time.sleep(0.2)
    assert cli_pids() == []
    runs = json.loads(out.read_text())["runs"]
    assert [r["status"] for r in runs] == ["interrupted"]
    assert "SIGTERM" in runs[0]["error"] and "--max-concurrency 1" in runs[0]["command"]


def test_plot_png(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed here (it is on the GPU machine)")
    f = _synthetic(tmp_path / "o.json", "ours", {("16x8", 1): 100.0, ("16x8", 8): 640.0})
    g = _synthetic(tmp_path / "u.json", "up", {("16x8", 1): 50.0, ("32x8", 8): 800.0})
    png = tmp_path / "t.png"
    assert plot_serve.main([str(f), str(g), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


_FAKE_CLI = """\
import json, os, sys
a = sys.argv
def arg(k):
    return a[a.index(k) + 1]
n, c = int(arg("--num-prompts")), int(arg("--max-concurrency"))
if str(c) in os.environ.get("FAKE_FAIL_CONC", "").split(","):
    sys.exit(1)
if os.environ.get("FAKE_SERVER_LOG") and str(c) in os.environ.get("FAKE_COMPILE_CONC", ""):
    with open(os.environ["FAKE_SERVER_LOG"], "a") as f:  # the server compiles during this run
        f.write("(EngineCore pid=7) INFO TileLang begins to compile kernel `mhc_pre_big_fuse`\\n"
                "(EngineCore pid=7) INFO cutedsl.jit: compiling cutedsl.sm90.gemm._build(128, 16)\\n"
                "(APIServer pid=6) INFO 200 OK\\n")
cache = os.environ.get("FAKE_CACHE_DIR")
if cache and str(c) in os.environ.get("FAKE_CACHE_CONC", "").split(","):
    # the server compiles a kernel into its cache during the first FAKE_CACHE_TIMES runs at c
    runs = [f for f in os.listdir(cache) if f.startswith(f"c{c}_")]
    if len(runs) < int(os.environ.get("FAKE_CACHE_TIMES", "1")):
        os.makedirs(os.path.join(cache, "k"), exist_ok=True)
        open(os.path.join(cache, f"c{c}_{len(runs)}"), "w").close()
        open(os.path.join(cache, "k", f"kernel{c}_{len(runs)}.cubin"), "w").close()
res = {"completed": n, "failed": 0, "duration": 1.0, "output_throughput": 10.0 * c,
       "median_ttft_ms": 5.0, "median_tpot_ms": 1.0}
with open(os.path.join(arg("--result-dir"), arg("--result-filename")), "w") as f:
    json.dump(res, f)
"""


def _warmup_stub(log: Path | None = None):
    """A /v1/completions stub; with `log`, every request appends a compile line to it (a server
    whose first use of a batch shape compiles a graph)."""
    seen: list[dict] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if log is not None:
                with open(log, "a") as f:
                    f.write("INFO Compiling a graph for dynamic shape\n")
            data = json.dumps({"choices": [{"text": "x"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def _fake_cli(tmp_path: Path) -> Path:
    """An interpreter stand-in that runs _FAKE_CLI whatever module it is asked for."""
    fake = tmp_path / "fake_cli.py"
    fake.write_text(_FAKE_CLI)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
    launcher.chmod(0o755)
    return launcher


def test_resume_warmup_and_min_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver calls serve_bench once per point over several invocations: --resume keeps the ok
    runs, re-runs the failed one in place, and warms each shape up once (token-id prompts of the
    shape's length, short outputs, before its first run)."""
    srv, url, seen = _warmup_stub()
    launcher, out = _fake_cli(tmp_path), tmp_path / "r.json"
    base = ["--base-url", url, "--model", "m", "--label", "x", "--no-fit", "--out", str(out),
            "--log-dir", str(tmp_path / "logs"), "--python", str(launcher)]  # fmt: skip
    try:
        monkeypatch.setenv("FAKE_FAIL_CONC", "2")
        rc = serve_bench.main([*base, "--shapes", "16x8", "--concurrency", "1,2",
                               "--warmup-requests", "3", "--warmup-max-tokens", "2"])  # fmt: skip
        assert rc == 1
        doc = json.loads(out.read_text())
        assert [r["status"] for r in doc["runs"]] == ["ok", "failed"]
        assert [(w["shape"], w["n"], w["errors"]) for w in doc["header"]["warmups"]] == [
            ("16x8", 3, [])
        ]
        assert len(seen) == 3 and all(len(b["prompt"]) == 16 for b in seen)
        assert all(b["max_tokens"] == 2 and b["temperature"] == 0 and b["ignore_eos"] for b in seen)
        assert all(isinstance(t, int) for b in seen for t in b["prompt"])

        monkeypatch.setenv("FAKE_FAIL_CONC", "")
        rc = serve_bench.main([*base, "--shapes", "16x8", "--concurrency", "1,2", "--resume",
                               "--warmup-requests", "3"])  # fmt: skip
        assert rc == 0
        doc = json.loads(out.read_text())
        assert [(r["concurrency"], r["status"]) for r in doc["runs"]] == [(1, "ok"), (2, "ok")]
        assert len(seen) == 3  # 16x8 was warmed up already
        assert len(doc["header"]["resumed"]) == 1

        # too little budget left for --min-run-s: recorded as skipped, no warm-up, rc 0
        rc = serve_bench.main([*base, "--shapes", "32x8", "--concurrency", "1", "--resume",
                               "--warmup-requests", "3", "--time-budget", "5",
                               "--min-run-s", "10"])  # fmt: skip
        assert rc == 0 and len(seen) == 3
        doc = json.loads(out.read_text())
        assert [(r["shape"], r["status"]) for r in doc["runs"]][-1] == ("32x8", "skipped")
        assert "--min-run-s 10" in doc["runs"][-1]["error"] and len(doc["runs"]) == 3
    finally:
        srv.shutdown()


def test_warmup_per_concurrency(tmp_path: Path) -> None:
    """--warmup-per-concurrency: one wave of `concurrency` requests before each (shape,
    concurrency) point's first run, none before its repeats or a resumed invocation's."""
    srv, url, seen = _warmup_stub()
    launcher, out = _fake_cli(tmp_path), tmp_path / "r.json"
    args = ["--base-url", url, "--model", "m", "--label", "x", "--no-fit", "--out", str(out),
            "--log-dir", str(tmp_path / "logs"), "--python", str(launcher), "--shapes", "16x8",
            "--concurrency", "1,3", "--repeats", "2", "--warmup-per-concurrency",
            "--warmup-max-tokens", "2", "--resume"]  # fmt: skip
    try:
        assert serve_bench.main(args) == 0
        doc = json.loads(out.read_text())
        assert [(r["concurrency"], r["repeat"]) for r in doc["runs"]] == [
            (1, 0),
            (3, 0),
            (1, 1),
            (3, 1),
        ]
        warm = [(w["key"], w["n"], w["concurrency"], w["errors"]) for w in doc["header"]["warmups"]]
        assert warm == [("16x8@c1", 1, 1, []), ("16x8@c3", 3, 3, [])]
        assert len(seen) == 4 and all(len(b["prompt"]) == 16 and b["max_tokens"] == 2 for b in seen)
        assert serve_bench.main([*args, "--concurrency", "1,3,2"]) == 0  # only c2 is new
        assert len(seen) == 6
        assert json.loads(out.read_text())["header"]["warmups"][-1]["key"] == "16x8@c2"
    finally:
        srv.shutdown()


def test_compiles_the_server_logs_during_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--server-log: each run records the compile lines the server logged while it ran (kinds
    and the first lines), each warm-up those during the warm-up; what was logged before is not
    counted; a missing log gives a record of none."""
    log = tmp_path / "server.log"
    log.write_text(
        "INFO TileLang begins to compile kernel `old`\nINFO Application startup complete\n"
    )
    srv, url, seen = _warmup_stub(log)
    launcher, out = _fake_cli(tmp_path), tmp_path / "r.json"
    monkeypatch.setenv("FAKE_SERVER_LOG", str(log))
    monkeypatch.setenv("FAKE_COMPILE_CONC", "2")
    try:
        assert serve_bench.main(["--base-url", url, "--model", "m", "--label", "x", "--no-fit",
                                 "--out", str(out), "--log-dir", str(tmp_path / "logs"),
                                 "--python", str(launcher), "--shapes", "16x8",
                                 "--concurrency", "1,2", "--warmup-per-concurrency",
                                 "--server-log", str(log),
                                 "--watch-cache", f"triton={tmp_path / 'none'}"]) == 0  # fmt: skip
    finally:
        srv.shutdown()
    doc = json.loads(out.read_text())
    c1, c2 = doc["runs"]
    assert c1["compiles"] == {
        "n": 0, "kinds": {}, "lines": [], "cache_files": {}, "new_cache_files": [], "kernels": {}
    }  # fmt: skip
    assert c2["compiles"]["n"] == 2 and c2["compiles"]["kinds"] == {"tilelang": 1, "cutedsl": 1}
    assert "mhc_pre_big_fuse" in c2["compiles"]["lines"][0]
    assert [
        (w["n"], w["compiles"]["n"], w["compiles"]["kinds"]) for w in doc["header"]["warmups"]
    ] == [
        (1, 1, {"torch.compile": 1}),
        (2, 2, {"torch.compile": 2}),
    ]
    assert len(seen) == 3
    assert serve_bench.compiles_since(tmp_path / "nope.log", 0) is None
    assert serve_bench.compiles_since(None, None) is None
    assert serve_bench.compiles_since(log, 10**9)["n"] == 6  # a log that shrank: read whole


@pytest.mark.parametrize("times", [1, 3])
def test_a_run_that_compiled_is_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, times: int
) -> None:
    """--watch-cache: the files a JIT cache gains during a run are its compiles (no log needed:
    vLLM logs a Triton kernel's compile once per name). --retry-on-compile 2: that point runs
    again with a new seed, its earlier attempts kept as `discarded`; a point that compiles every
    time keeps its last attempt, marked by its compiles; a point that did not compile runs once."""
    cache = tmp_path / "triton"
    cache.mkdir()
    (cache / "old.cubin").write_text("x")  # in the cache before: not this run's
    launcher, out = _fake_cli(tmp_path), tmp_path / "r.json"
    monkeypatch.setenv("FAKE_CACHE_DIR", str(cache))
    monkeypatch.setenv("FAKE_CACHE_CONC", "2")
    monkeypatch.setenv("FAKE_CACHE_TIMES", str(times))
    args = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x", "--no-fit",
            "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--python", str(launcher),
            "--shapes", "16x8", "--concurrency", "1,2", "--seed-per-run",
            "--watch-cache", f"triton={cache}", "--watch-cache", f"tilelang={tmp_path / 'tl'}",
            "--retry-on-compile", "2"]  # fmt: skip
    assert serve_bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["header"]["watched_caches"] == {
        "triton": str(cache),
        "tilelang": str(tmp_path / "tl"),
    }
    c1, c2 = doc["runs"]
    assert c1["compiles"]["cache_files"] == {} and "discarded" not in c1
    assert c2["status"] == "ok" and c2["concurrency"] == 2
    seeds = [d["seed"] for d in c2["discarded"]] + [c2["seed"]]
    assert len(set(seeds + [c1["seed"]])) == len(seeds) + 1  # every attempt its own prompts
    new = {"triton": 1, "triton/k": 1}  # a file in the cache's folder, one in its subfolder k
    assert sorted(c2["discarded"][0]["compiles"]["new_cache_files"]) == [
        "triton/c2_0",
        "triton/k/kernel2_0.cubin",
    ]
    if times == 1:
        assert [d["compiles"]["cache_files"] for d in c2["discarded"]] == [new]
        assert c2["compiles"]["cache_files"] == {} and c2["compiles"]["new_cache_files"] == []
    else:  # compiled in all three attempts: the last one is kept, and says so
        assert len(c2["discarded"]) == 2 and c2["compiles"]["cache_files"] == new
        assert serve_bench.compiled(c2)
    assert all(d["output_throughput"] == 20.0 and d["status"] == "ok" for d in c2["discarded"])
    assert serve_bench.main([*args, "--watch-cache", "nodir"]) == 2


def test_default_caches_follow_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caches watched by default are where the server's environment puts them: vLLM's root
    (which holds torch.compile's, Triton's once torch.compile ran, and DeepGEMM's), Triton's,
    TileLang's, ours; DeepGEMM's own only when DG_JIT_CACHE_DIR moves it out of vLLM's."""
    for k in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "CUTEDSL_CACHE_DIR",
              "DG_JIT_CACHE_DIR"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    got = serve_bench.default_caches()
    assert got == {
        "vllm": tmp_path / "xdg" / "vllm",
        "triton": tmp_path / "home" / ".triton" / "cache",
        "tilelang": tmp_path / "home" / ".tilelang" / "cache",
        "cutedsl": tmp_path / "home" / ".cache" / "cutedsl",
    }
    for k, d in (("VLLM_CACHE_ROOT", "v"), ("TRITON_CACHE_DIR", "t"), ("TILELANG_CACHE_DIR", "l"),
                 ("CUTEDSL_CACHE_DIR", "c"), ("DG_JIT_CACHE_DIR", "g")):  # fmt: skip
        monkeypatch.setenv(k, str(tmp_path / d))
    got = serve_bench.default_caches()
    assert {k: v.name for k, v in got.items()} == {
        "vllm": "v", "triton": "t", "tilelang": "l", "cutedsl": "c", "deepgemm": "g"
    }  # fmt: skip
    (tmp_path / "t" / "a" / "b").mkdir(parents=True)
    (tmp_path / "t" / "old.json").write_text("x")
    before = serve_bench.cache_snapshot(got)
    (tmp_path / "t" / "a" / "b" / "k.cubin").write_text("x")
    (tmp_path / "t" / "k.json").write_text("x")
    (tmp_path / "t" / "a" / "k.lock").write_text("x")  # a lock is not a compiled kernel
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "kernel.so").write_text("x")
    counts, paths = serve_bench.cache_changes(before, serve_bench.cache_snapshot(got))
    assert counts == {"triton/a": 1, "triton": 1, "deepgemm": 1}
    assert sorted(paths) == ["deepgemm/kernel.so", "triton/a/b/k.cubin", "triton/k.json"]
    assert serve_bench.compiled_kernels(paths) == {"deepgemm: deepgemm library": 1, "triton: k": 1}


def test_compiled_kernels_names_each_binary() -> None:
    """One entry per compiled binary, named as its JIT names it; sources, IR and records skipped."""
    tc = "vllm/torch_compile_cache/torch_aot_compile/d600/inductor_cache/triton/0"
    paths = [
        f"{tc}/H52R/_compute_prefill_metadata_kernel.cubin",
        f"{tc}/H52R/_compute_prefill_metadata_kernel.ptx",
        f"{tc}/H52R/__grp___compute_prefill_metadata_kernel.json",
        f"{tc}/DPXX/_compute_prefill_metadata_kernel.cubin",
        f"{tc}/ITO3/__triton_launcher.cpython-312-x86_64-linux-gnu.so",
        "vllm/deep_gemm/cache/kernel.sm90_tf32_hc_prenorm_gemm.3d24/kernel.cu",
        "vllm/deep_gemm/cache/kernel.sm90_tf32_hc_prenorm_gemm.3d24/kernel.cubin",
        "cutedsl/sm_90a/0123abcd-89ab.o",
        "cutedsl/sm_90a/0123abcd.json",
        "tilelang/ab12/executable.so",
    ]
    assert serve_bench.compiled_kernels(paths) == {
        "cutedsl: cutedsl kernel": 1,
        "tilelang: ab12 library": 1,
        "vllm: _compute_prefill_metadata_kernel": 2,
        "vllm: sm90_tf32_hc_prenorm_gemm": 1,
        "vllm: triton launcher": 1,
    }


def test_server_counters_over_a_run() -> None:
    """The server's own counters: parsed from Prometheus text (summed over label sets), read
    before and after a run, their change recorded; a server without /metrics gives None."""
    text = "\n".join([
        "# HELP vllm:num_preemptions_total preemptions",
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
        'vllm:num_preemptions_total{engine="1",model_name="m b}"} 2.0',
        'vllm:iteration_tokens_total_count{engine="0"} 120',
        'vllm:request_queue_time_seconds_sum{engine="0"} 1.5',
        "vllm:kv_cache_usage_perc 0.25",
    ])  # fmt: skip
    got = serve_bench.parse_series(text)
    assert got["vllm:num_preemptions_total"] == 5.0 and got["vllm:kv_cache_usage_perc"] == 0.25
    steps = [100]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path != "/metrics":
                self.send_error(404)
                return
            steps[0] += 37
            body = (f'vllm:iteration_tokens_total_count{{engine="0"}} {steps[0]}\n'
                    f"vllm:num_preemptions_total 2\n").encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        before, after = serve_bench.server_counters(url), serve_bench.server_counters(url)
    finally:
        srv.shutdown()
        srv.server_close()
    assert before["engine_steps"] == 137 and before["queue_s"] is None
    d = serve_bench.counter_delta(before, after)
    assert d == {"preemptions": 0.0, "queue_s": None, "engine_steps": 37.0,
                 "prefix_cache_hit_tokens": None}  # fmt: skip
    assert serve_bench.server_counters(url, timeout=1.0) is None  # server gone
    assert serve_bench.counter_delta(None, after) is None
