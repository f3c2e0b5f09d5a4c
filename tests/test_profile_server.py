"""bench/profile_server.py: the chrome-trace parser on a synthetic torch-profiler trace (kernels by
name and category, CUDA-graph kernels attributed through the launch's correlation id, per-step
numbers from the worker's step annotations), the vLLM 0.21.0 server flags, and the `run` workload
against a stub server that writes a trace at /stop_profile like the engine does."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from stub_stream import serve, stream_tokens

_spec = importlib.util.spec_from_file_location(
    "profile_server", Path(__file__).parents[1] / "bench" / "profile_server.py"
)
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)

OURS = "kernel_cutlass_kernel_cutedslkernelsgemm_sm90Sm90Nvfp4W4A16GemmKernel_object_at_0x7f_0"
MLA = "void flash_fwd_splitkv_mla_kernel<cutlass::bfloat16_t, 64>(Flash_fwd_mla_params)"
ELEM = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)"
MARLIN = "void marlin::Marlin<(vllm::ScalarTypeId)3, 256, 1, 8, 4, 8, false>(int4 const*)"
MOE = "fused_moe_kernel"
CUBLAS = "nvjet_tst_192x128_64x4_2x1_v_bz_coopB_TNT"
SORT = "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<int, long>(int*)"


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None, **kw) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": dur}
    args = dict(kw)
    if corr is not None:
        args["correlation"] = corr
    if args:
        ev["args"] = args
    return ev


def _trace(jitter: float = 0.0) -> list[dict]:
    """One prefill step (1000) and two decode steps of batch 4 (2000, 3000); a third decode
    step of batch 2 at 4000. Each decode step: one graph launch with two kernels, plus eager
    work. `jitter` shifts everything (a second file)."""
    j = jitter
    ann = "user_annotation"
    return [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}},
        _x(ann, "execute_context_2(2048)_generation_0(0)", 1000 + j, 500),
        _x(ann, "execute_context_0(0)_generation_4(4)", 2000 + j, 300),
        _x(ann, "execute_context_0(0)_generation_4(4)", 3000 + j, 300),
        _x(ann, "execute_context_0(0)_generation_2(2)", 4000 + j, 300),
        _x(ann, "gpu_model_runner: forward", 2001 + j, 100),  # not a step
        # prefill: one cuBLAS GEMM and one eager MoE GEMM
        _x("cuda_runtime", "cudaLaunchKernel", 1010 + j, 5, corr=5),
        _x("kernel", CUBLAS, 1100 + j, 100, corr=5),
        _x("cuda_runtime", "cudaLaunchKernel", 1020 + j, 5, corr=50),
        _x("kernel", MOE, 1200 + j, 40, corr=50),
        # decode step 1: graph (ours 10 + mla 5), eager fill 2 launched in the same window
        # (after the annotation ended: sample_tokens), a memcpy 1
        _x("cuda_runtime", "cudaGraphLaunch", 2010 + j, 20, corr=1),
        _x("kernel", OURS, 2100 + j, 10, corr=1),
        _x("kernel", MLA, 2115 + j, 5, corr=1),
        _x("cuda_runtime", "cudaLaunchKernel", 2400 + j, 5, corr=2),
        _x("kernel", ELEM, 2420 + j, 2, corr=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 2450 + j, 5, corr=6),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2460 + j, 1, corr=6),
        # decode step 2: graph (ours 12 + mla 5) launched through the driver API, a marlin
        # kernel whose launch record is missing (attributed by its own start time)
        _x("cuda_driver", "cuGraphLaunch", 3010 + j, 20, corr=3),
        _x("kernel", OURS, 3100 + j, 12, corr=3),
        _x("kernel", MLA, 3120 + j, 5, corr=3),
        _x("kernel", MARLIN, 3500 + j, 7, corr=99),
        _x("cuda_runtime", "cudaStreamSynchronize", 3200 + j, 250),  # the host waits
        # decode step 3 (batch 2): a sort and a memset
        _x("cuda_runtime", "cudaLaunchKernel", 4010 + j, 5, corr=7),
        _x("kernel", SORT, 4100 + j, 4, corr=7),
        _x("cuda_runtime", "cudaMemsetAsync", 4020 + j, 5, corr=8),
        _x("gpu_memset", "Memset (Device)", 4110 + j, 1, corr=8),
        # flow events and instant events are ignored
        {"ph": "s", "cat": "ac2g", "id": 1, "ts": 2010 + j, "pid": 1, "tid": 2},
        {"ph": "i", "name": "marker", "ts": 2500 + j, "pid": 1, "tid": 2},
    ]


def test_classifier() -> None:
    c = ps.Classifier()
    expect = {
        OURS: "cutedsl_w4a16_gemm",
        MLA: "attention/indexer",
        "void deep_gemm::sm90_fp8_paged_mqa_logits<64>(int)": "attention/indexer",
        "void deep_gemm::sm90_fp8_gemm_1d2d_impl<128, 128>(float*)": "gemm_deepgemm",
        MARLIN: "gemm_marlin",
        MOE: "moe_gemm_triton",
        "_matmul_ogs_NNT_bf16xbf16xmxfp4_128x256x128x1_swiglu": "moe_gemm_triton",
        "void vllm::moe::topkGatingSoftmax<8, 256>(float const*)": "moe_routing/topk/combine",
        SORT: "moe_routing/topk/combine",
        CUBLAS: "gemm_cublas/cutlass",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm_cublas/cutlass",
        "mhc_pre_big_fuse_tilelang_kernel": "mhc",
        "void vllm::rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*)": "norm/elementwise",
        "triton_poi_fused__to_copy_add_mul_0": "norm/elementwise",
        ELEM: "norm/elementwise",
        "some_kernel_nobody_knows": "other",
    }
    got = {n: c(n) for n in expect}
    assert got == expect
    extra = ps.Classifier([("mine", r"nobody")])
    assert extra("some_kernel_nobody_knows") == "mine" and extra(OURS) == "cutedsl_w4a16_gemm"


def test_parse_synthetic_trace(tmp_path: Path) -> None:
    p = tmp_path / "rank0.123.pt.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": _trace()}, f)
    res = ps.parse_traces([str(p)])
    t = res["totals"]
    kernel_us = 100 + 40 + 10 + 5 + 2 + 1 + 12 + 5 + 7 + 4 + 1
    assert t["gpu_events"] == 11 and t["kernel_us"] == kernel_us
    assert t["graph_launches"] == 2 and t["kernels_under_graph_launches"] == 4
    assert t["kernels_without_launch_record"] == 1  # the marlin kernel
    assert t["kernels_outside_steps"] == 0
    assert t["steps"] == 4 and t["decode_steps"] == 3
    assert t["decode_batch"] == 4 and t["decode_steps_at_batch"] == 2
    # busy = union of kernel intervals (none overlap here); span = first start .. last end
    assert t["gpu_busy_us"] == kernel_us and t["gpu_span_us"] == 4111 - 1100
    kern = {k["name"]: k for k in res["kernels"]}
    assert kern[OURS]["calls"] == 2 and kern[OURS]["total_us"] == 22
    assert kern[OURS]["us_per_decode_step"] == 11.0  # (10 + 12) / 2 steps at batch 4
    assert kern[CUBLAS]["us_per_decode_step"] == 0.0  # prefill only
    assert kern[MARLIN]["us_per_decode_step"] == 3.5
    cats = {c["category"]: c for c in res["categories"]}
    assert cats["cutedsl_w4a16_gemm"]["total_us"] == 22
    assert cats["attention/indexer"]["us_per_decode_step"] == 5.0
    assert cats["memcpy/memset"]["calls"] == 2 and cats["memcpy/memset"]["total_us"] == 2
    assert cats["memcpy/memset"]["us_per_decode_step"] == 0.5  # the memcpy in step 1 only
    assert cats["moe_routing/topk/combine"]["us_per_decode_step"] == 0.0  # batch-2 step only
    assert cats["cutedsl_w4a16_gemm"]["calls_per_decode_step"] == 1.0
    assert abs(sum(c["pct"] for c in res["categories"]) - 100) < 0.05
    steps = {s["batch"]: s for s in res["steps"]}
    # step 1: 10 + 5 + 2 + 1 = 18, span 2100..2461; step 2: 12 + 5 + 7 = 24, span 3100..3507
    assert steps[4]["steps"] == 2 and steps[4]["median_kernel_us"] == 21.0
    assert steps[4]["median_gpu_span_us"] == (361 + 407) / 2
    assert steps[4]["median_cpu_period_us"] == 1000 and steps[4]["median_kernels"] == 3.5
    assert steps[2]["steps"] == 1 and steps[2]["median_kernel_us"] == 5.0
    assert res["warnings"] == []
    # idle at batch 4: step 1: ours 2100..2110, gap 5 in the graph, mla ..2120, gap 300 to the
    # eager fill (different launches), ..2422, gap 38 to the memcpy; step 2: ours 3100..3112,
    # gap 8 in the graph, mla ..3125, gap 375 to marlin (no launch record: not in the graph)
    idle = res["idle"]
    assert idle["in_graph_us_per_step"] == (5 + 8) / 2
    assert idle["outside_graph_us_per_step"] == (300 + 38 + 375) / 2
    top = {(g["after"], g["before"], g["in_graph"]): g for g in idle["top"]}
    assert top[(MLA, MARLIN, False)]["us_per_step"] == 187.5
    assert (
        top[(OURS, MLA, True)]["us_per_step"] == 6.5
        and top[(OURS, MLA, True)]["gaps_per_step"] == 1
    )
    assert top[(OURS, MLA, True)]["median_us"] == 6.5 and top[(OURS, MLA, True)]["max_us"] == 8
    assert top[(MLA, MARLIN, False)]["median_us"] == top[(MLA, MARLIN, False)]["max_us"] == 375
    assert idle["top"][0]["before"] == MARLIN  # the largest first
    # host annotations inside the batch-4 steps: one "forward" of 100 us in step 1; the
    # blocking runtime calls: a synchronize of 250 us in step 2, a memcpy of 5 us in step 1
    assert res["host"] == [
        {"name": "[cuda] cudaStreamSynchronize", "us_per_step": 125.0, "calls_per_step": 0.5},
        {"name": "gpu_model_runner: forward", "us_per_step": 50.0, "calls_per_step": 0.5},
        {"name": "[cuda] cudaMemcpyAsync", "us_per_step": 2.5, "calls_per_step": 0.5},
    ]
    md = ps.markdown({**res, "label": "x", "command": "c", "date": "d"})
    assert "| cutedsl_w4a16_gemm | 2 | 0.02 |" in md and "| 4 | 2 | 21.0 |" in md
    assert "6.5 us per step inside CUDA graphs, 356.5 us outside them" in md
    assert "| `gpu_model_runner: forward` | 50.0 | 0.50 |" in md


def test_kernel_rows_per_launch_grid(tmp_path: Path) -> None:
    """One compiled kernel launched with two grids (two GEMM shapes) is two kernel rows, each
    with its grid; kernels without a grid (copies) keep one row with none."""
    ev = _trace()
    grids = iter([[256, 1, 1], [64, 1, 4]])
    for e in ev:
        if e.get("name") == OURS:
            e["args"]["grid"] = next(grids)
    p = tmp_path / "rank0.1.pt.trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    res = ps.parse_traces([str(p)])
    ours = {k["grid"]: k for k in res["kernels"] if k["name"] == OURS}
    assert set(ours) == {"256,1,1", "64,1,4"}
    assert ours["256,1,1"]["calls"] == 1 and ours["256,1,1"]["total_us"] == 10
    assert ours["256,1,1"]["us_per_decode_step"] == 5.0  # 10 us in one of 2 steps at batch 4
    assert ours["64,1,4"]["us_per_decode_step"] == 6.0
    cats = {c["category"]: c for c in res["categories"]}
    assert cats["cutedsl_w4a16_gemm"]["total_us"] == 22  # the category sums both rows
    memcpy = [k for k in res["kernels"] if k["name"].startswith("Memcpy")]
    assert len(memcpy) == 1 and memcpy[0]["grid"] is None
    md = ps.markdown({**res, "label": "x", "command": "c", "date": "d"})
    assert "| 256,1,1 | cutedsl_w4a16_gemm | 1 |" in md and "| - | memcpy/memset |" in md


def test_two_files_and_missing_graph_kernels(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt.trace.json", tmp_path / "b.pt.trace.json"
    a.write_text(json.dumps({"traceEvents": _trace()}))
    # b: the same, but the graph kernels were not recorded
    ev = [e for e in _trace(10000) if not (e.get("args", {}).get("correlation") in (1, 3)
                                            and e.get("cat") == "kernel")]  # fmt: skip
    b.write_text(json.dumps(ev))  # a bare list of events is accepted too
    res = ps.parse_traces([str(a), str(b)])
    assert res["totals"]["gpu_events"] == 11 + 7 and res["totals"]["graph_launches"] == 4
    assert res["totals"]["kernels_under_graph_launches"] == 4 and res["totals"]["steps"] == 8
    only_b = ps.parse_traces([str(b)])
    assert any("graph-replayed kernels are missing" in w for w in only_b["warnings"])
    empty = ps.parse_traces([])
    assert empty["totals"]["gpu_events"] == 0 and len(empty["warnings"]) == 2


def test_idle_counts_short_gaps_and_overlap() -> None:
    """Per step: gaps under MIN_GAP_US summed apart from the idle table, and kernel time that ran
    beside an earlier kernel (another stream) as overlap."""
    steps = [
        {"k": [(0.0, 10.0, "a", 1), (12.0, 20.0, "b", 1), (15.0, 25.0, "c", 2),
               (24.0, 26.0, "d", 1), (40.0, 41.0, "e", 1)]},
        {"k": [(0.0, 5.0, "a", 1), (6.5, 7.0, "b", 1)]},
    ]  # fmt: skip
    idle = ps._idle(steps)
    # step 1: gap 2 (a->b), c overlaps b by 5, d overlaps c by 1, gap 14 (d..26 -> e at 40)
    # step 2: gap 1.5
    assert idle["short_gaps_us_per_step"] == (2 + 1.5) / 2
    assert idle["overlap_us_per_step"] == (5 + 1) / 2
    assert idle["in_graph_us_per_step"] == 14 / 2


def test_union() -> None:
    rng = random.Random(1)
    iv = [(s, s + rng.randint(1, 30)) for s in (rng.randint(0, 200) for _ in range(50))]
    covered = {t for s, e in iv for t in range(s, e)}  # unit cells, independent of the merge
    assert ps._union_us([(float(s), float(e)) for s, e in iv]) == len(covered)


def test_server_args_parse_with_vllm() -> None:
    args = ps.server_args("/tmp/prof_x")
    cfg = json.loads(args[1])
    assert args[0] == "--profiler-config" and cfg["profiler"] == "torch"
    assert cfg["torch_profiler_dir"] == "/tmp/prof_x" and cfg["ignore_frontend"] is True
    pytest.importorskip("vllm", reason="vllm not installed in this environment")
    from vllm.config import ProfilerConfig

    pc = ProfilerConfig(**cfg)  # the pinned vLLM accepts every key
    assert pc.torch_profiler_with_stack is False and pc.torch_profiler_dump_cuda_time_total is False


def test_compare(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_trace()))
    r1 = {**ps.parse_traces([str(p)]), "label": "ours", "date": "d"}
    r2 = json.loads(json.dumps(r1))
    r2["label"] = "base"
    for c in r2["categories"]:
        if c["us_per_decode_step"]:
            c["us_per_decode_step"] *= 2
    text, doc = ps.compare_markdown([r1, r2])
    row = next(r for r in doc["categories"] if r["category"] == "cutedsl_w4a16_gemm")
    assert row["us_per_decode_step"] == {"ours": 11.0, "base": 22.0}
    assert row["ratio_over_baseline"] == {"ours": 0.5}
    assert "| **sum** | 21.0 | 42.0 | 0.50 |" in text


def _stub(tmp_path: Path, profile_ok: bool = True):
    """Streams a token every 5 ms until the client goes away; /stop_profile writes a trace
    file (after a delay, in two writes: the poller must wait for a stable size)."""
    state = {"start": 0, "stop": 0, "streams": 0, "bodies": []}
    trace_dir = tmp_path / "traces"

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _empty(self, code: int) -> None:
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path in ("/start_profile", "/stop_profile"):
                if not profile_ok:
                    return self._empty(404)
                state[self.path[1:].split("_")[0]] += 1
                if self.path == "/stop_profile":

                    def write():
                        time.sleep(0.3)
                        raw = gzip.compress(json.dumps({"traceEvents": _trace()}).encode())
                        out = trace_dir / "dp0_rank0.1.pt.trace.json.gz"
                        with open(out, "wb") as f:
                            f.write(raw[: len(raw) // 2])
                            f.flush()
                            time.sleep(1.2)
                            f.write(raw[len(raw) // 2 :])

                    threading.Thread(target=write, daemon=True).start()
                return self._empty(200)
            state["streams"] += 1
            state["bodies"].append(body)
            stream_tokens(self, body["max_tokens"], 0.005)

    srv, url = serve(H)
    os.makedirs(trace_dir, exist_ok=True)
    (trace_dir / "old.pt.trace.json").write_text("{}")  # from an earlier profile: not parsed
    return srv, url, state, trace_dir


def test_run_against_stub(tmp_path: Path) -> None:
    srv, url, state, trace_dir = _stub(tmp_path)
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    try:
        rc = ps.main(["run", "--base-url", url, "--model", "m", "--trace-dir", str(trace_dir),
                      "--label", "stub", "--concurrency", "4", "--prompt-len", "16",
                      "--max-tokens", "100000", "--profile-s", "0.5", "--trace-timeout", "20",
                      "--out", str(out), "--md", str(md)])  # fmt: skip
    finally:
        srv.shutdown()
    res = json.loads(out.read_text())
    assert rc == 0, res["errors"]
    assert state["start"] == 1 and state["stop"] == 1 and state["streams"] == 4
    b = state["bodies"][0]
    assert b["ignore_eos"] is True and b["temperature"] == 0 and len(b["prompt"]) == 16
    assert all(10 <= t < 1000 for body in state["bodies"] for t in body["prompt"])
    assert [os.path.basename(f) for f in res["trace_files"]] == ["dp0_rank0.1.pt.trace.json.gz"]
    assert res["totals"]["gpu_events"] == 11 and res["errors"] == []
    w = res["workload"]
    assert w["concurrency"] == 4 and w["tokens_in_window"] > 4 * 20  # ~100 tokens/s per stream
    assert "GPU profile: stub" in md.read_text()


def test_run_without_profiler_fails(tmp_path: Path) -> None:
    srv, url, state, trace_dir = _stub(tmp_path, profile_ok=False)
    out = tmp_path / "p.json"
    try:
        rc = ps.main(["run", "--base-url", url, "--model", "m", "--trace-dir", str(trace_dir),
                      "--concurrency", "2", "--prompt-len", "4", "--max-tokens", "100000",
                      "--profile-s", "0.2", "--out", str(out)])  # fmt: skip
    finally:
        srv.shutdown()
    res = json.loads(out.read_text())
    assert rc == 1 and "HTTP 404" in res["errors"][0] and "--profiler-config" in res["errors"][0]


def test_refuses_non_loopback() -> None:
    with pytest.raises(SystemExit, match="non-loopback"):
        ps.post("http://10.0.0.1:8000", "/start_profile", 1.0)
