"""CPU tests of the kernel benchmarks (cutedsl/bench/): the SM90 GEMM bench's shape tables,
routing, tactic candidates, writers and CLI, the DeepGEMM wrapper's no-raise contract, the table
tools (merge_gemm, tune_sm90), the committed tuned table, and the `python -m cutedsl.bench` runner.
No timing here (that needs a Hopper GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from cutedsl.bench import gemm_sm90 as B
from cutedsl.sm90 import tactics
from cutedsl.sm90.tactics import GpuSpec, StreamTactic, Tactic
from cutedsl.tools import tiny_model

ANCHORS = "/work/shared/research/anchors.md"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = GpuSpec("NVIDIA H200", 132)


def _by_name(shapes):
    return {s.name.split("(")[0]: s for s in shapes}


def test_flash_shapes_match_tiny_model_flash_layers_preset():
    cfg = tiny_model.make_config("flash-layers", "native")
    assert B.shapes_from_config(cfg) == B.SHAPES["flash"]
    s = _by_name(B.SHAPES["flash"])
    # independent, hand-written values (vllm021_dsv4.md §1.2: fused_wqa_wkv [1536,4096],
    # wq_b [32768,1024], wo_a [8192,4096] = 8 x [1024, 4096], wo_b [4096,8192])
    assert (s["fused_wqa_wkv"].n, s["fused_wqa_wkv"].k) == (1536, 4096)
    assert (s["wq_b"].n, s["wq_b"].k) == (32768, 1024)
    assert (s["wo_a"].kind, s["wo_a"].groups, s["wo_a"].n, s["wo_a"].k) == (
        "grouped",
        8,
        1024,
        4096,
    )
    assert (s["wo_b"].n, s["wo_b"].k) == (4096, 8192)
    assert (s["shared_w13"].n, s["shared_w13"].k, s["shared_w2"].n, s["shared_w2"].k) == (
        4096,
        4096,
        4096,
        2048,
    )
    r13, r2 = s["routed_w13"], s["routed_w2"]
    assert (r13.kind, r13.groups, r13.topk, r13.n, r13.k) == ("moe", 256, 6, 4096, 4096)
    assert (r2.kind, r2.groups, r2.topk, r2.n, r2.k) == ("moe", 256, 6, 4096, 2048)


def _anchors_table() -> dict[str, tuple[str, str]]:
    """anchors.md §3.1 rows: field -> (Flash, Pro)."""
    if not os.path.exists(ANCHORS):
        pytest.skip(f"{ANCHORS} not present on this machine (the research notes)")
    rows = {}
    txt = open(ANCHORS).read()
    sec = txt[txt.index("### 3.1 Sizes") :]
    for line in sec.splitlines()[1:]:
        if line.startswith("###"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", s)]


@pytest.mark.parametrize("col,model", [(0, "flash"), (1, "pro")])
def test_configs_match_research_notes(col, model):
    t = _anchors_table()
    cfg = B.CONFIGS[model]
    assert _ints(t["hidden_size"][col]) == [cfg["hidden_size"]]
    assert _ints(t["q_lora_rank"][col]) == [cfg["q_lora_rank"]]
    assert _ints(t["moe_intermediate_size"][col]) == [cfg["moe_intermediate_size"]]
    assert _ints(t["o_groups / o_lora_rank"][col]) == [cfg["o_groups"], cfg["o_lora_rank"]]
    assert _ints(t["n_routed_experts / n_shared / top-k"][col]) == [
        cfg["n_routed_experts"],
        cfg["n_shared_experts"],
        cfg["num_experts_per_tok"],
    ]
    heads = _ints(t["num_attention_heads / kv heads / head_dim / rope dim"][col])
    assert (heads[0], heads[2]) == (cfg["num_attention_heads"], cfg["head_dim"])


def test_pro_shapes_and_param_counts():
    s = _by_name(B.SHAPES["pro"])
    assert (s["fused_wqa_wkv"].n, s["fused_wqa_wkv"].k) == (1536 + 512, 7168)
    assert (s["wq_b"].n, s["wq_b"].k) == (65536, 1536)
    assert (s["wo_a"].groups, s["wo_a"].n, s["wo_a"].k) == (16, 1024, 4096)
    assert s["wo_a"].name == "wo_a(G=16)"
    assert (s["wo_b"].n, s["wo_b"].k) == (7168, 16384)
    assert (s["shared_w13"].n, s["shared_w13"].k) == (6144, 7168)
    assert (s["shared_w2"].n, s["shared_w2"].k) == (7168, 3072)
    assert (s["routed_w13"].groups, s["routed_w13"].topk, s["routed_w13"].n) == (384, 6, 6144)
    assert (s["routed_w2"].n, s["routed_w2"].k) == (7168, 3072)

    # anchors.md §3.2 derived per-layer counts: Pro wq_b 100.7M, wo_a 67.1M, wo_b 117.4M,
    # and wq_a 11.0M + wkv 3.7M (= fused_wqa_wkv)
    def mp(sh):
        return round(sh.groups * sh.n * sh.k / 1e6, 1)

    assert (mp(s["wq_b"]), mp(s["wo_a"]), mp(s["wo_b"])) == (100.7, 67.1, 117.4)
    assert round(1536 * 7168 / 1e6, 1) + round(512 * 7168 / 1e6, 1) == mp(s["fused_wqa_wkv"])


@pytest.mark.parametrize("m,e,topk", [(1, 256, 6), (7, 384, 6), (1024, 256, 6), (16384, 384, 6)])
def test_routing_offsets_sum_to_m_topk(m, e, topk):
    ids = B.routing(m, e, topk, seed=3)
    assert ids.shape == (m, topk) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < e
    # distinct experts per token
    assert bool((ids.sort(dim=1).values.diff(dim=1) != 0).all())
    counts = B.expert_counts(ids, e)
    offs = B.expert_offsets(counts)
    assert offs.dtype == torch.int32 and offs.shape == (e + 1,)
    assert int(offs[0]) == 0 and int(offs[-1]) == m * topk
    assert bool((offs.diff() >= 0).all())
    # independent count: a python loop
    ref = [0] * e
    for x in ids.reshape(-1).tolist():
        ref[x] += 1
    assert offs.diff().tolist() == ref
    assert max(ref) <= m  # an expert gets each token at most once


def test_routing_is_seeded_and_skewed():
    a, b = B.routing(512, 256, 6, seed=0), B.routing(512, 256, 6, seed=0)
    assert torch.equal(a, b)
    assert not torch.equal(a, B.routing(512, 256, 6, seed=1))
    c = B.expert_counts(B.routing(16384, 256, 6, seed=0), 256).float()
    assert c.max() > 2 * c.mean()  # load imbalance exists (popularity skew)


def test_contiguous_m_indices_padding():
    counts = torch.tensor([3, 0, 130, 128])
    idx = B.contiguous_m_indices(counts, 128)
    assert idx.dtype == torch.int32 and idx.numel() == 128 + 256 + 128
    assert idx[:3].tolist() == [0, 0, 0] and bool((idx[3:128] == -1).all())
    assert bool((idx[128:258] == 2).all()) and bool((idx[258:384] == -1).all())
    assert bool((idx[384:] == 3).all())


def _synthetic_rows():
    rows = []
    for mdl, s in [
        ("flash", B.SHAPES["flash"][0]),
        ("pro", B.SHAPES["pro"][2]),
        ("pro", B.SHAPES["pro"][6]),
    ]:
        for m in (1, 16384):
            r = B.new_row(mdl, s, m)
            r.update(
                us=10.0 * m,
                cublas_us=8.0 * m,
                marlin_us=None,
                deepgemm_us=5.0 * m,
                deepgemm_quant_us=1.0,
                copy_us=4.0 if m <= 32 else None,
                tactic=[64, 16, 4],
            )
            if s.kind == "moe":
                r["active_experts"] = 6.0
                r["deepgemm_error"] = None
            if s.kind != "dense":
                r["marlin_error"] = "n/a: Marlin column covers dense linears only"
            rows.append(B.finalize_row(r, copy_bw=4000.0))
    rows[1]["deepgemm_us"] = None
    rows[1]["deepgemm_error"] = "error: RuntimeError: JIT failed | bad"
    B.finalize_row(rows[1], 4000.0)
    return rows


def test_finalize_row_columns():
    rows = _synthetic_rows()
    r = rows[0]  # flash fused_wqa_wkv M=1: 1536 x 4096
    wb = 1536 * 4096 * 0.5625
    assert r["weight_GBps"] == round(wb / 10.0 / 1e3)
    assert r["pct_copy_bw"] == round(100 * wb / 10.0 / 1e3 / 4000.0, 1)
    assert r["tflops"] == round(2 * 1536 * 4096 / 10.0 / 1e6, 1)
    assert (r["x_cublas"], r["x_deepgemm"]) == (0.8, 0.5)  # t_X / t_ours
    assert r["deepgemm_total_us"] == 6.0 and r["x_deepgemm_total"] == 0.6
    assert r["x_marlin"] is None
    assert r["pct_copy_time"] == 40.0  # copy_us 4.0 / ours 10.0
    assert rows[1]["pct_copy_time"] is None  # no copy time (M > 32 in the bench)
    g = rows[2]  # pro wo_a, G=16: flops and bytes count all groups
    assert g["tflops"] == round(2 * 16 * 1024 * 4096 / 10.0 / 1e6, 1)
    moe = rows[4]  # pro routed_w13, M=1: rows = 6, bytes of the 6 active experts
    assert moe["rows"] == 6
    assert moe["weight_GBps"] == round(6 * 6144 * 7168 * 0.5625 / 10.0 / 1e3)
    assert moe["tflops"] == round(2 * 6 * 6144 * 7168 / 10.0 / 1e6, 1)


def test_swiglu_columns_and_table(tmp_path):
    """The swiglu impl's rows: sep / fused in the JSON, its own table in the MD (routed w13
    rows only; the other rows' "n/a" is not a note)."""
    rows = _synthetic_rows()
    moe = rows[4]  # pro routed_w13, M=1
    moe.update(swiglu_sep_us=12.0, swiglu_fused_us=9.6)
    B.finalize_row(moe, 4000.0)
    assert moe["x_swiglu_fused"] == 1.25
    rows[0]["swiglu_error"] = "n/a: routed w13 only"
    B.finalize_row(rows[0], 4000.0)
    assert rows[0]["x_swiglu_fused"] is None
    meta = dict(command="c", date="d", device="fake", versions=B.versions(), header=[])
    md = tmp_path / "r.md"
    B.write_outputs("", str(md), meta, rows)
    text = md.read_text()
    assert "| pro.routed_w13(E=384) | 1 | 6 | 64x16x4 | 12.0 | 9.6 | 1.25 |" in text
    assert "n/a: routed w13" not in text


def test_stream_columns_and_candidates(tmp_path):
    """The stream impl's columns: ours / stream and copy / stream for a decode row, "n/a" (not a
    note) past M = 32; its candidates hold M (MoE: an expert's rows at decode), fit shared
    memory and cover both row blocks."""
    from cutedsl.sm90.kernels.stream import Sm90Nvfp4StreamGemmKernel

    rows = _synthetic_rows()
    r = rows[0]  # flash fused_wqa_wkv M=1, ours 10 us, copy 4 us
    r.update(stream_us=5.0, stream_tactic="s16x8w8d4", stream_sweep_us={"s16x8w8d4": 5.0})
    B.finalize_row(r, 4000.0)
    assert (r["x_stream"], r["pct_copy_time_stream"]) == (2.0, 80.0)
    for other in rows[1:]:
        other["stream_error"] = "n/a: M <= 32"
        B.finalize_row(other, 4000.0)
        assert other["x_stream"] is None
    md = tmp_path / "r.md"
    meta = dict(command="c", date="d", device="fake", versions=B.versions(), header=[])
    B.write_outputs("", str(md), meta, rows)
    text = md.read_text()
    assert "| 5.0 | s16x8w8d4 | 80.0 | 2.00 |" in text
    assert "n/a: M <= 32" not in text
    for m, tokens, moe in ((1, 8, False), (8, 8, False), (9, 16, False), (32, 32, False),
                           (32, 8, True)):  # fmt: skip
        cands = B.stream_candidates(m, moe)
        assert cands and {t.tokens for t in cands} == {tokens}
        assert {t.rows for t in cands} == {16, 32}
        assert all(
            Sm90Nvfp4StreamGemmKernel.config_error(t.rows, t.tokens, t.warps, t.depth) is None
            for t in cands
        )
        assert not any(t.ctas for t in cands)
        # with the SM count, dense / grouped rows also time the persistent grid (1 and 2 per SM)
        more = B.stream_candidates(m, moe, sms=132)
        grid = [t for t in more if t.ctas]
        assert set(cands) <= set(more)
        assert {t.ctas for t in grid} == ({8, 32} if moe else {132, 264})
        # with K, each persistent configuration also with one resident slot per K tile of a warp
        res = [t for t in B.stream_candidates(m, moe, 132, 1, 1024) if t.res]
        assert res and all(t.ctas and t.res == -(-16 // t.warps) for t in res)
        # a grouped launch of 8 groups (wo_a): the same CTAs in all, split over the groups
        assert moe or {t.ctas for t in B.stream_candidates(m, moe, 132, 8) if t.ctas} == {16, 33}
        assert all(
            Sm90Nvfp4StreamGemmKernel.config_error(t.rows, t.tokens, t.warps, t.depth, t.ctas)
            is None
            for t in grid
        )


def test_json_and_md_writers(tmp_path):
    rows = _synthetic_rows()
    meta = dict(
        command="python -m cutedsl.bench.gemm_sm90 --model all",
        date="2026-12-03",
        device="fake",
        versions=B.versions(),
        header=["h1", "h2"],
        stopped_early="time budget 60s reached before x",
    )
    jp, mp = tmp_path / "r.json", tmp_path / "r.md"
    B.write_outputs(str(jp), str(mp), meta, rows)
    j = json.loads(jp.read_text())
    for key in ("command", "date", "device", "versions", "rows", "summary"):
        assert key in j
    assert set(j["versions"]) >= {"torch", "cutlass_dsl", "vllm"}
    assert len(j["rows"]) == len(rows) and j["rows"][0]["shape"] == "flash.fused_wqa_wkv"
    for key in (
        "us",
        "cublas_us",
        "marlin_us",
        "deepgemm_us",
        "deepgemm_quant_us",
        "x_cublas",
        "x_marlin",
        "x_deepgemm",
        "pct_copy_bw",
        "deepgemm_error",
    ):
        assert key in j["rows"][0]
    md = mp.read_text().splitlines()
    table = [ln for ln in md if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    for col in ("cuBLAS/ours", "Marlin/ours", "DG/ours", "% copy BW (M<=32)", "DG act-quant us"):
        assert col in head
    assert len(table) == 2 + len(rows)
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]
    assert all(len(c) == len(head) for c in cells)  # the "|" in an error got escaped
    pct = head.index("% copy BW (M<=32)")
    assert cells[0][pct] != "" and cells[1][pct] == ""  # M=1 shown, M=16384 blank
    same = head.index("copy us / ours (%)")
    assert cells[0][same] == "40.0" and cells[1][same] == ""
    assert j["summary"]["decode_pct_copy_time_min"] == 40.0
    assert cells[0][head.index("cuBLAS/ours")] == "0.80"
    assert "JIT failed" in cells[1][head.index("notes")]
    assert cells[2][head.index("Marlin us")] == "n/a"
    assert any("stopped early" in ln for ln in md)


def test_help_runs():
    r = subprocess.run(
        [sys.executable, "-m", "cutedsl.bench.gemm_sm90", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for opt in ("--model", "--time-budget", "--ms", "--json", "--md", "Examples:"):
        assert opt in r.stdout
    assert "{flash,pro,all,both}" in r.stdout


@pytest.mark.parametrize(
    "name", ["gemm_sm90", "swiglu", "merge_gemm", "tune_sm90", "quack_anchor", "__main__"]
)
def test_every_module_has_help_with_examples(name, capsys):
    import importlib

    mod = importlib.import_module(f"cutedsl.bench.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    prog = "cutedsl.bench" if name == "__main__" else f"cutedsl.bench.{name}"
    assert out.startswith(f"usage: python -m {prog} ")
    examples = out[out.index("Examples:") :].splitlines()[1:]
    assert examples and all(ln.strip().startswith("python -m cutedsl.bench") for ln in examples)


def test_bad_arguments_are_refused_before_running(capsys):
    for argv in (["--ms", "1,x"], ["--shapes", "wq_b,nope"], ["--impls", "ours,cutlass"]):
        with pytest.raises(SystemExit) as e:
            B.parse_args(argv)
        assert e.value.code == 2
    assert "nope" in capsys.readouterr().err
    a = B.parse_args(["--shapes", "wq_b,wo_a(G=8)", "--impls", "ours,copy"])
    assert (a.shapes, a.impls) == (["wq_b", "wo_a(G=8)"], ["ours", "copy"])


def test_default_ms_and_list_shapes(capsys):
    assert B.parse_args([]).ms == [1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
    assert B.parse_args(["--ms", "1,16"]).ms == [1, 16]
    assert B.main(["--model", "pro", "--list-shapes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and all(ln.startswith("pro.") for ln in out)
    assert len(B.selected_shapes(B.parse_args(["--model", "all"]))) == 16


def test_budget_stops():
    b = B.Budget(5.0)  # less than the 10 s reserve: nothing may start
    assert not b.fits("x") and "time budget" in b.stopped
    assert B.Budget(None).fits("x")


def test_deepgemm_wrapper_returns_error_rows_without_gpu():
    assert not torch.cuda.is_available()
    dg = B.load_deepgemm()  # must not raise here
    assert dg.mod is None and dg.note
    for s in (B.SHAPES["pro"][0], B.SHAPES["pro"][2], B.SHAPES["pro"][6]):
        rows_by_m = {m: B.new_row("pro", s, m) for m in (1, 16)}
        B.bench_deepgemm(s, [1, 16], rows_by_m, B.Budget(None), dg)
        for r in rows_by_m.values():
            assert r["deepgemm_us"] is None
            assert r["deepgemm_error"].startswith("n/a")


def test_deepgemm_failure_is_recorded_not_raised():
    class Broken:
        def get_mk_alignment_for_contiguous_layout(self):
            return [128, 128]

        def __getattr__(self, name):
            raise RuntimeError(f"DeepGEMM JIT unavailable ({name})")

    dg = B.DeepGemm(Broken(), None, False, "fake")
    s = B.SHAPES["flash"][0]
    rows_by_m = {1: B.new_row("flash", s, 1)}
    B.bench_deepgemm(s, [1], rows_by_m, B.Budget(None), dg)  # CPU: tensor alloc on cuda fails
    assert rows_by_m[1]["deepgemm_error"].startswith("error: ")
    assert rows_by_m[1]["deepgemm_us"] is None


def test_deepgemm_applies():
    assert B.deepgemm_applies(B.Shape("x", "dense", 96, 4096)) is not None
    assert B.deepgemm_applies(B.Shape("x", "dense", 64, 4096)) is None
    assert all(B.deepgemm_applies(s) is None for m in B.MODELS for s in B.SHAPES[m])


def test_candidate_tactics_are_valid_and_start_with_the_launch_tactic():
    from cutedsl.sm90.kernels.gemm import Sm90Nvfp4W4A16GemmKernel as Kern

    for m, n, k, g, moe in [(1, 1536, 4096, 1, False), (300, 4096, 8192, 1, False),
                            (16384, 32768, 1024, 1, False), (4, 1024, 4096, 8, False),
                            (96, 4096, 4096, 256, True)]:  # fmt: skip
        c = B.candidate_tactics(m, n, k, g, moe, spec=H200)
        assert c[0] == tactics.launch_tactic(m, n, k, g, moe, H200) and len(c) == len(set(c)) >= 2
        for t in c:
            assert isinstance(t, Tactic)
            assert (
                Kern.can_implement(n, k, t.tile_n, t.split_k)
                and t.tile_m in tactics.TILE_M_VERIFIED
            )
            assert not moe or t.split_k == 1
    # the launch tactic depends on the GPU (a smaller one splits K less): the spec is honoured
    small = GpuSpec("small", 16)
    c = B.candidate_tactics(1, 1536, 4096, 1, False, spec=small)
    assert c[0] == tactics.launch_tactic(1, 1536, 4096, 1, False, small)


def test_rows_record_tactics_as_lists_and_sweep_keys_as_str():
    from cutedsl.bench import tune_sm90 as T

    t = Tactic(128, 16, 2)
    assert B.tactic_list(t) == [128, 16, 2] and Tactic(*B.tactic_list(t)) == t
    assert str(t) == "128x16x2"  # the sweep_us key tune_sm90 parses back
    s = StreamTactic(32, 8, 16, 2)
    assert B.tactic_list(s) == str(s) == "s32x8w16d2"  # by name, a stream_sweep_us key
    assert tactics.parse_tactic(str(s)) == s and tactics.parse_tactic(str(t)) == t
    assert tactics.tactic_entry(s) == {"kernel": "stream", "tactic": [32, 8, 16, 2]}
    assert tactics.table_tactic(tactics.tactic_entry(t), 16) == t
    p = StreamTactic(32, 8, 16, 2, 264)  # the persistent grid: its bound in the name and entry
    assert str(p) == "s32x8w16d2p264" and tactics.parse_tactic(str(p)) == p
    assert tactics.tactic_entry(p) == {"kernel": "stream", "tactic": [32, 8, 16, 2, 264]}
    assert tactics.table_tactic(tactics.tactic_entry(p), 8) == p
    q = StreamTactic(32, 16, 8, 2, 132, 2)  # and resident activations: a sixth field
    assert str(q) == "s32x16w8d2p132r2" and tactics.parse_tactic(str(q)) == q
    assert tactics.tactic_entry(q) == {"kernel": "stream", "tactic": [32, 16, 8, 2, 132, 2]}
    assert tactics.table_tactic(tactics.tactic_entry(q), 16) == q
    assert T.row_candidates({"tactic": "s32x8w16d2", "us": 3.0, "sweep_us": {"64x16x1": 4.0}}) == {
        "64x16x1": 4.0,
        "s32x8w16d2": 3.0,
    }


def test_candidates_of_a_streaming_decode_row_include_the_tiled_kernel():
    """Where the tuned table names the streaming kernel (H100, Flash wo_b, M = 1), a sweep times
    it and the tiled kernel's own choice and neighbours."""
    h100 = GpuSpec("NVIDIA H100 80GB HBM3", 132)
    c = B.candidate_tactics(1, 4096, 8192, 1, False, spec=h100)
    assert (
        c[0] == StreamTactic(32, 8, 16, 2) == tactics.launch_tactic(1, 4096, 8192, 1, False, h100)
    )
    assert (
        c[1]
        == tactics.choose_tactic(1, 4096, 8192, 1, spec=h100, stream=False)
        == Tactic(64, 16, 4)
    )
    assert len(c) >= 4 and all(isinstance(t, Tactic) for t in c[1:])


def test_bench_runner_gives_each_benchmark_its_own_output_files() -> None:
    from cutedsl.bench.__main__ import per_bench_outputs

    argv = ["--model", "all", "--json", "r/x.json", "--md=r/x.md", "--ms", "1"]
    assert per_bench_outputs(argv, "swiglu") == [
        "--model", "all", "--json", "r/x.swiglu.json", "--md=r/x.swiglu.md", "--ms", "1",
    ]  # fmt: skip
    assert per_bench_outputs(["--json", "a.d/out"], "gemm_sm90") == ["--json", "a.d/out.gemm_sm90"]


def test_bench_runner_lists_selects_and_forwards(capsys, monkeypatch):
    import importlib

    from cutedsl.bench import __main__ as R

    assert R.BENCHMARKS == ("gemm_sm90", "swiglu")
    assert R.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == list(R.BENCHMARKS)
    # a table tool or an unknown name is no benchmark; a benchmark refuses options it lacks
    for argv in (["--only", "nope"], ["--only", "tune_sm90"], ["--", "--model", "flash"]):
        with pytest.raises(SystemExit) as e:
            R.main(argv)
        assert e.value.code == 2
    assert "unrecognized arguments: --model flash" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(R, "gpu_problem", lambda: None)
    for name in R.BENCHMARKS:
        mod = importlib.import_module(f"cutedsl.bench.{name}")
        monkeypatch.setattr(mod, "main", lambda argv, name=name: calls.append((name, argv)) or 0)
    assert R.main(["--json", "r/x.json", "--md", "r/x.md"]) == 0
    assert calls == [
        ("gemm_sm90", ["--json", "r/x.gemm_sm90.json", "--md", "r/x.gemm_sm90.md"]),
        ("swiglu", ["--json", "r/x.swiglu.json", "--md", "r/x.swiglu.md"]),
    ]
    calls.clear()
    assert R.main(["--only", "gemm_sm90", "--json", "g.json", "--", "--model", "flash"]) == 0
    assert calls == [("gemm_sm90", ["--json", "g.json", "--model", "flash"])]
    calls.clear()
    monkeypatch.setattr(B, "main", lambda argv: calls.append(("gemm_sm90", argv)) or 1)
    assert R.main([]) == 1  # a failed benchmark fails the run, after the others ran
    assert [c[0] for c in calls] == ["gemm_sm90", "swiglu"]
    assert "failed: gemm_sm90" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module", ["cutedsl.bench", "cutedsl.bench.gemm_sm90", "cutedsl.bench.swiglu"]
)
def test_benchmarks_without_a_gpu_fail_with_one_line(module):
    assert not torch.cuda.is_available()
    r = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Hopper" in r.stderr and "Traceback" not in r.stderr


def test_grid_sweep_candidates_are_valid_and_broad():
    from cutedsl.sm90.kernels.gemm import Sm90Nvfp4W4A16GemmKernel as Kern

    for m in (1, 16, 64, 300, 4096):
        cands = B.candidate_tactics(m, 1536, 4096, 1, False, spec=H200, grid=True)
        assert cands[0] == tactics.launch_tactic(m, 1536, 4096, 1, False, H200)  # launch first
        assert len(cands) == len(set(cands)) >= 6
        for t in cands:
            Kern(tile_n=t.tile_n, tile_m=t.tile_m, split_k=t.split_k)  # the kernel takes it
            assert Kern.can_implement(1536, 4096, t.tile_n, t.split_k)
    grid = B.candidate_tactics(64, 1536, 4096, 1, False, spec=H200, grid=True)
    assert {t.split_k for t in grid} == {1, 2, 4, 8}


def _sweeps():
    def row(shape, kind, n, k, g, m, sweep):
        return dict(shape=shape, kind=kind, N=n, K=k, G=g, M=m, sweep_us=sweep)

    first = dict(command="c1", date="d1", device="Fake GPU", sms=7, cutlass_dsl="4.4.2", rows=[
        row("flash.x", "dense", 1536, 4096, None, 16, {"64x16x8": 5.0, "128x16x8": 6.0}),
        row("flash.x", "dense", 1536, 4096, None, 64, {"128x64x8": 7.0, "64x64x8": 7.1}),
        row("flash.r", "moe", 4096, 4096, 256, 16, {"128x16x1": 1.0, "64x16x1": 2.0}),
        row("flash.y", "dense", 4096, 2048, None, 16, {"64x16x4": 3.0}),  # no sweep: skipped
    ])  # fmt: skip
    second = dict(first, command="c2", rows=[
        row("flash.x", "dense", 1536, 4096, None, 64, {"64x64x8": 6.5, "128x64x8": 7.0}),
    ])  # fmt: skip
    return first, second


def _write(tmp_path, docs, prefix="s"):
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"{prefix}{i}.json")
        paths[-1].write_text(json.dumps(doc))
    return [str(p) for p in paths]


def test_tune_table_from_a_grid_sweep(tmp_path, monkeypatch):
    """The tuner keeps the fastest tactic per (N, K, G) and M (later files win), skips the MoE and
    un-swept rows, records the device and its SM count, writes readable JSON atomically to the
    device's table by default, and sm90's loader reads the result on that GPU only."""
    from cutedsl.bench import tune_sm90 as T

    monkeypatch.setattr(tactics, "TUNED_DIR", tmp_path)
    spec = GpuSpec("Fake GPU", 7)
    assert spec.table_file == tmp_path / "Fake_GPU.json"
    assert T.main(_write(tmp_path, _sweeps())) == 0  # no -o: the sweeps' device's table
    text = spec.table_file.read_text()
    table = json.loads(text)
    assert T.format_table(table) == text  # one line per entry, as written
    assert (table["meta"]["device"], table["meta"]["num_sms"]) == ("Fake GPU", 7)
    assert "cutedsl.sm90.tactics.choose_tactic" in table["meta"]["what"]
    assert [s["command"] for s in table["meta"]["sources"]] == ["c1", "c2"]
    assert list(table["dense"]) == ["1536,4096,1"]
    x = table["dense"]["1536,4096,1"]
    assert x["16"]["tactic"] == [64, 16, 8] and x["16"]["next_us"] == 6.0
    assert x["64"]["tactic"] == [64, 64, 8]  # the later sweep wins
    assert not list(tmp_path.glob("*.tmp"))
    tactics.tuned_table.cache_clear()
    try:
        assert tactics.tuned_table(spec)[(1536, 4096, 1)] == [
            (16, Tactic(64, 16, 8)),
            (64, Tactic(64, 64, 8)),
        ]
        assert tactics.choose_tactic(20, 1536, 4096, 1, spec=spec) == Tactic(64, 64, 8)
        assert tactics.tuned_table(GpuSpec("Fake GPU", 8)) == {}  # another SM count: not used
    finally:
        tactics.tuned_table.cache_clear()
    first = _sweeps()[0]
    empty = _write(tmp_path, [dict(first, rows=first["rows"][2:])], "e")
    assert T.main([*empty, "-o", str(tmp_path / "none.json")]) == 1
    assert not (tmp_path / "none.json").exists()


def test_tune_takes_the_streaming_kernel_where_it_was_faster(tmp_path, monkeypatch):
    """A --impls ours,stream run over an existing table (--base): per (shape, M), the fastest of
    the run's streaming configurations and its default launch's tactic, all timed in that run;
    the base keeps its other entries; the loader reads a streaming entry as a StreamTactic for
    the M range of its bucket. MoE rows stay out; a base of another GPU is refused."""
    from cutedsl.bench import tune_sm90 as T

    monkeypatch.setattr(tactics, "TUNED_DIR", tmp_path)
    spec = GpuSpec("Fake GPU", 7)
    base = tmp_path / "base.json"
    assert T.main([*_write(tmp_path, _sweeps()), "-o", str(base)]) == 0

    def row(m, us, stream):
        return dict(shape="flash.x", kind="dense", N=1536, K=4096, G=None, M=m, tactic=[64, 16, 8],
                    us=us, stream_sweep_us=stream)  # fmt: skip

    run = dict(command="c3", date="d3", device="Fake GPU", sms=7, cutlass_dsl="4.4.2", rows=[
        row(1, 5.4, {"s16x8w16d2": 4.9, "s32x8w8d2": 5.2}),
        row(4, 5.5, {"s16x8w16d2": 5.9}),
        dict(shape="flash.r", kind="moe", N=4096, K=4096, G=256, M=1, tactic=[64, 16, 1], us=9.0,
             stream_sweep_us={"s32x8w4d2": 8.0}),
    ])  # fmt: skip
    assert T.main(["--base", str(base), *_write(tmp_path, [run], "r")]) == 0
    table = json.loads(spec.table_file.read_text())
    assert list(table["dense"]) == ["1536,4096,1"]
    x = table["dense"]["1536,4096,1"]
    assert x["1"] == {"kernel": "stream", "tactic": [16, 8, 16, 2], "us": 4.9,
                      "next": "s32x8w8d2", "next_us": 5.2, "shape": "flash.x"}  # fmt: skip
    assert x["4"]["tactic"] == [64, 16, 8] and "kernel" not in x["4"]
    assert x["4"]["next"] == "s16x8w16d2"
    assert x["16"]["tactic"] == [64, 16, 8] and x["64"]["tactic"] == [64, 64, 8]  # the base's
    assert [s["command"] for s in table["meta"]["sources"]] == ["c1", "c2", "c3"]
    tactics.tuned_table.cache_clear()
    try:
        assert tactics.choose_tactic(1, 1536, 4096, 1, spec=spec) == StreamTactic(16, 8, 16, 2)
        assert tactics.choose_tactic(2, 1536, 4096, 1, spec=spec) == Tactic(64, 16, 8)
        got = tactics.reachable_tactics(1536, 4096, 1, False, 64, spec)
        assert {StreamTactic(16, 8, 16, 2), Tactic(64, 16, 8), Tactic(64, 64, 8)} <= got
    finally:
        tactics.tuned_table.cache_clear()
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(table, meta=dict(table["meta"], num_sms=8))))
    out = tmp_path / "o.json"
    assert T.main(["--base", str(other), *_write(tmp_path, [run], "q"), "-o", str(out)]) == 2
    assert not out.exists()


def test_tune_refuses_mixed_or_unknown_devices(tmp_path, capsys):
    from cutedsl.bench import tune_sm90 as T

    first, second = _sweeps()
    out = str(tmp_path / "t.json")
    for docs in ([first, dict(second, device="Other GPU")], [first, dict(second, sms=8)],
                 [dict(first, device=None)]):  # fmt: skip
        assert T.main([*_write(tmp_path, docs), "-o", out]) == 2
    assert "one named device" in capsys.readouterr().err
    # a sweep without its SM count: --num-sms is required, and must agree with the others
    no_sms = {k: v for k, v in second.items() if k != "sms"}
    paths = _write(tmp_path, [first, no_sms])
    assert T.main([*paths, "-o", out]) == 2
    assert "--num-sms" in capsys.readouterr().err
    assert T.main([*paths, "-o", out, "--num-sms", "8"]) == 2
    assert not os.path.exists(out)
    assert T.main([*paths, "-o", out, "--num-sms", "7"]) == 0
    assert json.loads(open(out).read())["meta"]["num_sms"] == 7


@pytest.mark.parametrize(
    "spec", [H200, GpuSpec("NVIDIA H100 80GB HBM3", 132)], ids=lambda s: s.name
)
def test_committed_tuned_table_is_well_formed(spec):
    from cutedsl.bench import tune_sm90 as T

    text = spec.table_file.read_text()
    table = json.loads(text)
    assert spec.table_file.name == spec.name.replace(" ", "_") + ".json"
    assert (table["meta"]["device"], table["meta"]["num_sms"]) == (spec.name, spec.num_sms)
    assert all(s["device"] == spec.name for s in table["meta"]["sources"])
    assert T.format_table(table) == text  # the tuner's line-per-entry format
    for key, per_m in table["dense"].items():
        assert len(key.split(",")) == 3 and per_m
        for m, e in per_m.items():
            assert int(m) > 0 and e["us"] <= e["next_us"]
            t = tactics.table_tactic(e, int(m))  # a streaming entry holds its M's tokens
            assert tactics.tactic_entry(t) == {k: e[k] for k in ("kernel", "tactic") if k in e}
    loaded = tactics.tuned_table(spec)
    assert sum(map(len, loaded.values())) == sum(map(len, table["dense"].values()))


def test_merge_fills_missing_fields_and_rows(tmp_path):
    """merge_gemm: a run cut short (row 0 without its copy time, the last row missing) plus a
    re-run that has them gives one table: the first run's values kept, the gaps filled, the
    missing row appended, derived columns recomputed, provenance recorded; other devices refused."""
    from cutedsl.bench import merge_gemm as MG

    full = _synthetic_rows()
    cut = [dict(r) for r in full[:-1]]
    cut[0]["copy_us"] = None
    cut[0] = B.finalize_row(cut[0], copy_bw=4000.0)
    assert cut[0]["pct_copy_time"] is None
    rerun = [dict(full[0], us=99.0, copy_us=5.0), dict(full[-1])]
    meta = dict(command="x", date="d1", device="H200", header=["h"], copy_bw_GBps=4000.0)
    a = dict(meta, rows=cut, stopped_early="time budget reached before y")
    b = dict(meta, command="z", date="d2", rows=rerun, stopped_early="")
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    assert MG.main([str(pa), str(pb), "--json", str(out), "--md", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [(r["shape"], r["M"]) for r in full]
    r0 = rows[0]
    assert r0["us"] == full[0]["us"]  # the first run's time is kept, not the re-run's 99
    assert r0["copy_us"] == 5.0 and r0["pct_copy_time"] == round(100 * 5.0 / r0["us"], 1)
    assert r0["merged_from"] == ["a.json", "b.json: copy_us"]
    assert rows[-1]["merged_from"] == ["b.json"] and rows[-1]["us"] == full[-1]["us"]
    assert "a.json" in md.read_text() and "b.json" in md.read_text()
    pb.write_text(json.dumps(dict(b, device="H100")))
    assert MG.main([str(pa), str(pb)]) == 2
    pb.write_text(json.dumps(dict(b, sms=114)))
    pa.write_text(json.dumps(dict(a, sms=132)))
    assert MG.main([str(pa), str(pb)]) == 2  # same name, another SM count


def test_merge_rerun_replaces_measured_fields(tmp_path):
    """merge_gemm --rerun: a re-run's measured fields replace the full run's in its rows (its
    error cleared, ratios recomputed), its new rows are appended, and the full run keeps the
    header and the row order."""
    from cutedsl.bench import merge_gemm as MG

    full = _synthetic_rows()
    full[3] = dict(full[3], us=None, ours_error="error: old failure")
    extra = B.finalize_row(dict(B.new_row("flash", B.SHAPES["flash"][1], 64), us=2.0), 4000.0)
    rerun = [
        dict(full[3], us=7.0, ours_error=None),
        dict(full[0], us=3.0, tactic=[128, 192, 1], copy_us=None),
        dict(full[1], us=None, ours_error="error: new failure", tactic=[64, 16, 1]),
        extra,
    ]
    meta = dict(command="x", date="d", device="H200", header=["full header"], copy_bw_GBps=4000.0)
    pf, pr = tmp_path / "full.json", tmp_path / "rerun.json"
    pf.write_text(json.dumps(dict(meta, rows=full)))
    pr.write_text(json.dumps(dict(meta, command="y", header=["rerun header"], rows=rerun)))
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    assert MG.main([str(pf), "--rerun", str(pr), "--json", str(out), "--md", str(md)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    keys = [(r["shape"], r["M"]) for r in full] + [(extra["shape"], 64)]
    assert [(r["shape"], r["M"]) for r in rows] == keys
    assert (rows[0]["us"], rows[3]["us"], rows[2]["us"]) == (3.0, 7.0, full[2]["us"])
    assert rows[0]["copy_us"] == full[0]["copy_us"]  # not re-measured: kept
    assert rows[0]["tactic"] == [128, 192, 1] and rows[0]["cublas_us"] == full[0]["cublas_us"]
    assert rows[3]["ours_error"] is None
    # a re-run that failed replaces the old time: no stale time beside the new error and tactic
    assert rows[1]["us"] is None and rows[1]["ours_error"] == "error: new failure"
    assert rows[1]["tactic"] == [64, 16, 1] and rows[1]["x_cublas"] is None
    assert rows[0]["x_cublas"] == round(full[0]["cublas_us"] / 3.0, 2)  # recomputed
    assert rows[0]["merged_from"][0] == "full.json" and "re-run" in rows[0]["merged_from"][1]
    assert rows[2]["merged_from"] == ["full.json"] and rows[-1]["merged_from"] == [
        "rerun.json (re-run)"
    ]
    assert doc["header"][0] == "full header" and "--rerun rerun.json" in doc["command"]
    assert "re-run" in md.read_text()
    pr.write_text(json.dumps(dict(meta, device="H100", rows=rerun)))
    assert MG.main([str(pf), "--rerun", str(pr)]) == 2


# ------------------------------------------------------------------------------ quack column


def _stand_in_quack_env(tmp_path, rows_for) -> str:
    """A bash env file whose python3 is a stand-in worker: it checks that the checkout is on
    PYTHONPATH and writes `rows_for(spec)` as the worker's OUT."""
    import textwrap

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "rows.json").write_text(json.dumps(rows_for))
    stub = bin_dir / "python3"
    stub.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        assert sys.argv[1:3] == ["-m", "cutedsl.bench.quack_anchor"], sys.argv
        assert os.path.isdir(os.path.join(os.environ["PYTHONPATH"].split(":")[0], "cutedsl"))
        spec = json.load(open(sys.argv[3]))
        rows = json.load(open({str(tmp_path / "rows.json")!r}))
        rows = [r for r in rows if r["shape"] in {{s["name"] for s in spec["shapes"]}}]
        json.dump({{"meta": {{"quack": "0.6.5", "budget": sys.argv[5]}}, "rows": rows}},
                  open(sys.argv[4], "w"))
        """)
    )
    stub.chmod(0o755)
    env = tmp_path / "env.sh"
    env.write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return str(env)


def test_quack_column_through_its_own_environment(tmp_path):
    rows_out = [
        {"shape": "flash.wq_b", "M": 1, "us": 10.0, "rel_err": 1e-3, "tactic": [16, 128, 1],
         "error": None},
        {"shape": "flash.wq_b", "M": 16, "us": None, "rel_err": 0.5, "tactic": None,
         "error": "wrong result: max rel err 0.5 > 0.02"},
    ]  # fmt: skip
    env = _stand_in_quack_env(tmp_path, rows_out)
    shapes = {s.name: s for s in B.SHAPES["flash"]}
    wq_b, wo_a = shapes["wq_b"], next(s for s in B.SHAPES["flash"] if s.kind == "grouped")
    res = B.run_quack(env, [("flash.wq_b", wq_b)], [1, 16], B.Budget(100.0))
    assert res["meta"]["quack"] == "0.6.5" and 49 < float(res["meta"]["budget"]) <= 50  # half left
    rows = {m: B.new_row("flash", wq_b, m) for m in (1, 4, 16)}
    for r in rows.values():
        r["us"] = 8.0
    B.fill_quack("flash.wq_b", wq_b, [1, 4, 16], rows, res)
    r1, r4, r16 = (B.finalize_row(rows[m], 3000.0) for m in (1, 4, 16))
    assert r1["quack_us"] == 10.0 and r1["x_quack"] == 1.25 and r1["quack_tactic"] == [16, 128, 1]
    assert r4["quack_us"] is None and r4["quack_error"] == "not measured"
    assert r16["x_quack"] is None and "wrong result" in r16["quack_error"]
    assert B._cell(r16, "notes", "s").startswith("quack: wrong result")
    grouped = {m: B.new_row("flash", wo_a, m) for m in (1,)}
    B.fill_quack(f"flash.{wo_a.name}", wo_a, [1], grouped, res)
    assert (
        B._cell(grouped[1], "quack_us", ".1f") == "n/a" and B._cell(grouped[1], "notes", "s") == ""
    )
    assert B.summarize([r1, r4, r16])["x_quack_geomean"] == 1.25


def test_quack_environment_failure_is_recorded_not_raised(tmp_path):
    wq_b = next(s for s in B.SHAPES["flash"] if s.name == "wq_b")
    res = B.run_quack(str(tmp_path / "missinB.sh"), [("flash.wq_b", wq_b)], [1], B.Budget(None))
    assert res["rows"] == [] and "quack worker exit 3" in res["meta"]["error"], res
    rows = {1: B.new_row("flash", wq_b, 1)}
    B.fill_quack("flash.wq_b", wq_b, [1], rows, res)
    assert "quack worker exit 3" in rows[1]["quack_error"]


def test_quack_is_asked_for_by_name_with_its_environment(capsys, tmp_path):
    assert "quack" not in B.parse_args([]).impls
    assert B.parse_args(["--impls", "ours,quack"]).impls == ["ours", "quack"]
    assert B.main(["--impls", "ours,quack"]) == 2
    assert "--impls quack needs --quack-env FILE" in capsys.readouterr().err


def test_quack_worker_without_quack_says_so(tmp_path):
    from cutedsl.bench import quack_anchor

    out = tmp_path / "out.json"
    assert quack_anchor.run({"shapes": [], "ms": [1]}, str(out), 10.0) == 1
    meta = json.loads(out.read_text())["meta"]
    assert meta["import_error"].startswith("ModuleNotFoundError"), meta
    with pytest.raises(SystemExit) as e:
        quack_anchor.main(["only-one-arg"])
    assert e.value.code == 2


def test_dense_shapes_and_their_fixed_cost_fit(capsys, tmp_path):
    """--dense NxK replaces the models' shapes; the fit recovers a known fixed cost and rate per
    implementation and M from 3 or more shapes (not from 2), and the report shows it."""
    assert B.main(["--dense", "4096x1024,1536x4096", "--list-shapes"]) == 0
    out = capsys.readouterr().out
    assert "custom.4096x1024" in out and "custom.1536x4096" in out and "flash." not in out
    for bad in ("4096x1000", "4096", "0x64", "ax64"):
        with pytest.raises(SystemExit):
            B.main(["--dense", bad, "--list-shapes"])
        assert "--dense" in capsys.readouterr().err
    shapes = [B._dense_shape(t) for t in ("4096x512", "4096x2048", "4096x8192", "32768x1024")]
    rows = []
    for m, fixed, rate in ((4, 2.5, 2500.0), (16, 3.0, 2000.0)):
        for s in shapes:
            r = B.new_row("custom", s, m)
            wb = B.weight_bytes(1, s.n, s.k)
            r["us"] = fixed + wb / (rate * 1e3)
            r["copy_us"] = 1.0 + wb / 3000e3
            r["sweep_us"] = {"64x16x4": 2.0 + wb / 2800e3}
            if s.n == 32768:
                r["sweep_us"]["128x16x1"] = 9.0  # one shape only: no fit
            rows.append(r)
    rows.append({**B.new_row("flash", B.SHAPES["flash"][0], 4), "us": 99.0})  # not custom
    fit = {(f["impl"], f["M"]): f for f in B.fit_cost(rows)}
    assert set(fit) == {(i, m) for i in ("ours", "copy", "ours@64x16x4") for m in (4, 16)}
    assert fit[("ours@64x16x4", 4)]["fixed_us"] == 2.0
    assert fit[("ours@64x16x4", 4)]["rate_GBps"] == 2800
    assert fit[("ours", 4)]["fixed_us"] == 2.5 and fit[("ours", 4)]["rate_GBps"] == 2500
    assert fit[("ours", 16)]["fixed_us"] == 3.0 and fit[("ours", 16)]["rate_GBps"] == 2000
    assert fit[("copy", 4)]["fixed_us"] == 1.0 and fit[("copy", 4)]["rate_GBps"] == 3000
    assert fit[("ours", 4)]["shapes"] == 4 and fit[("ours", 4)]["max_resid_pct"] == 0.0
    assert B.fit_cost([r for r in rows if r["shape"] != "custom.4096x512"
                       and r["shape"] != "custom.4096x2048"]) == []  # fmt: skip
    meta = {"date": "d", "command": "c", "header": [], "stopped_early": ""}
    md_path, json_path = tmp_path / "r.md", tmp_path / "r.json"
    B.write_outputs(str(json_path), str(md_path), meta, [B.finalize_row(r, 3000.0) for r in rows])
    md = md_path.read_text()
    assert "| ours | 4 | 4 | 2.50 | 2500 | 0.0 |" in md
    assert json.loads(json_path.read_text())["fit"][0]["impl"] in ("ours", "copy")
