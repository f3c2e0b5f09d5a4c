"""bench/serving.py: the decode step's byte model (checkpoint bytes by role from the safetensors
headers, expected distinct experts, KV bytes) and the report's records and table, on synthetic
checkpoints and synthetic benchmark/profile results."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

_spec = importlib.util.spec_from_file_location(
    "serving", Path(__file__).parents[1] / "bench" / "serving.py"
)
sv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sv)

E, K, LAYERS = 8, 2, 3


def _ckpt(tmp: Path, rng: random.Random) -> tuple[Path, dict]:
    """Two shards with random shapes: dense, embedding, routed experts in layers 1..2, MTP."""
    cfg = {"num_hidden_layers": LAYERS, "n_routed_experts": E, "num_experts_per_tok": K,
           "compress_ratios": [0, 4, 128, 0], "sliding_window": 128, "index_topk": 64}  # fmt: skip
    (tmp / "config.json").write_text(json.dumps(cfg))
    want = {"dense": 0, "experts": {1: 0, 2: 0}, "embed": 0, "mtp": 0}
    shards: list[dict] = [{}, {}]

    def put(name: str, t: torch.Tensor) -> int:
        shards[rng.randrange(2)][name] = t
        return t.numel() * t.element_size()

    vocab, h = rng.randint(50, 90), rng.choice([16, 32])
    want["embed"] = put("embed.weight", torch.randn(vocab, h, dtype=torch.bfloat16))
    want["dense"] += put("head.weight", torch.randn(vocab, h, dtype=torch.bfloat16))
    for layer in range(LAYERS):
        want["dense"] += put(
            f"layers.{layer}.attn.wq_b.weight", torch.zeros(h, 8, dtype=torch.uint8)
        )
        want["dense"] += put(f"layers.{layer}.attn.wq_b.weight_scale",
                             torch.zeros(h, 1, dtype=torch.float8_e4m3fn))  # fmt: skip
        want["dense"] += put(f"layers.{layer}.ffn.shared_experts.w1.weight",
                             torch.zeros(h, h // 2, dtype=torch.uint8))  # fmt: skip
        if layer == 0:
            continue
        for e in range(E):
            for w in ("w1", "w2", "w3"):
                n = rng.randint(1, 5)
                want["experts"][layer] += put(f"layers.{layer}.ffn.experts.{e}.{w}.weight",
                                              torch.zeros(n, h, dtype=torch.uint8))  # fmt: skip
                want["experts"][layer] += put(f"layers.{layer}.ffn.experts.{e}.{w}.scale",
                                              torch.zeros(n, 2, dtype=torch.float32))  # fmt: skip
    want["mtp"] = put("mtp.0.ffn.experts.0.w1.weight", torch.zeros(4, 4, dtype=torch.uint8))
    for i, s in enumerate(shards):
        save_file(s, str(tmp / f"model-{i:05d}.safetensors"))
    return tmp, want | {"vocab": vocab, "h": h}


def test_checkpoint_bytes_by_role(tmp_path: Path) -> None:
    rng = random.Random(1234)
    ckpt, want = _ckpt(tmp_path, rng)
    info = sv.checkpoint_bytes(ckpt)
    files = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert 0 < files - info["total_bytes"] < 64 << 10  # headers only on top
    assert info["dense_bytes"] == want["dense"]
    assert info["embed_row_bytes"] * want["vocab"] == want["embed"]
    assert info["mtp_bytes"] == want["mtp"]
    assert info["experts"] == {1: E, 2: E}
    assert {k: v * E for k, v in info["expert_bytes"].items()} == want["experts"]
    total = want["dense"] + want["embed"] + want["mtp"] + sum(want["experts"].values())
    assert info["total_bytes"] == total


def test_checkpoint_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(sv.InputError, match="config.json"):
        sv.checkpoint_bytes(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 4}))
    with pytest.raises(sv.InputError, match="no .safetensors"):
        sv.checkpoint_bytes(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(sv.InputError, match="a.safetensors"):
        sv.checkpoint_bytes(tmp_path)
    (tmp_path / "a.safetensors").unlink()
    save_file(
        {"layers.0.ffn.experts.0.w1.weight": torch.zeros(2, 2)}, str(tmp_path / "b.safetensors")
    )
    with pytest.raises(sv.InputError, match="1 routed experts, config says 4"):
        sv.checkpoint_bytes(tmp_path)


@pytest.mark.parametrize("batch", [1, 3, 16, 64])
def test_expected_experts_matches_sampling(batch: int) -> None:
    rng = random.Random(batch)
    n_exp, k, trials = 32, 4, 4000
    seen = [
        len({e for _ in range(batch) for e in rng.sample(range(n_exp), k)}) for _ in range(trials)
    ]
    mc = sum(seen) / trials
    assert sv.expected_experts(batch, n_exp, k) == pytest.approx(mc, rel=0.02)
    assert sv.expected_experts(1, n_exp, k) == pytest.approx(k)
    with pytest.raises(sv.InputError):
        sv.expected_experts(1, 4, 5)


def test_kv_read_bytes_by_layer_kind() -> None:
    cfg = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "sliding_window": 128,
           "index_topk": 64}  # fmt: skip
    ctx, b = 1000.0, 3
    swa = 128 * 584
    c4 = 250 * 132 + 64 * 584  # all index keys, top-k compressed entries
    c128 = 1000 / 128 * 584
    assert sv.kv_read_bytes(cfg, b, ctx) == pytest.approx(b * (3 * swa + c4 + c128))
    short = sv.kv_read_bytes(cfg, 1, 40.0)  # context below the window and the top-k
    assert short == pytest.approx(3 * 40 * 584 + 10 * 132 + 10 * 584 + 40 / 128 * 584)


def _serve(impl: str, rng: random.Random) -> dict:
    runs = []
    for shape in ("1024x1024", "8192x1024"):
        for c in (1, 64):
            for rep in (0, 1):
                runs.append({"requested_shape": shape, "shape": shape, "concurrency": c,
                             "repeat": rep, "status": "ok", "num_prompts": c,
                             "output_throughput": rng.uniform(100, 5000),
                             "median_tpot_ms": rng.uniform(2, 20), "p99_tpot_ms": 30.0,
                             "median_ttft_ms": rng.uniform(10, 900), "p99_ttft_ms": 999.0,
                             "duration": rng.uniform(5, 60),
                             "server": None if rep else {
                                 "preemptions": rng.randrange(5), "queue_s": rng.uniform(0, 9),
                                 "engine_steps": rng.randrange(900, 2000),
                                 "prefix_cache_hit_tokens": 0},
                             "compiles": None if rep else {
                                 "n": rng.randrange(1, 4),
                                 "cache_files": {"triton": rng.randrange(1, 9), "tilelang": 1},
                                 "kernels": {"triton: _k": 2, "vllm: hc_gemm": 1}},
                             **({} if rep else {"discarded": [{"seed": 9}] * rng.randrange(1, 3)})})  # fmt: skip
    runs.append({"requested_shape": "1024x1024", "concurrency": 4, "status": "failed"})
    return {"header": {"date": "d", "device": "dev", "vllm_version": "0.21.0"}, "runs": runs}


def test_records_join_bench_profile_and_roofline(tmp_path: Path) -> None:
    rng = random.Random(99)
    ckpt, _ = _ckpt(tmp_path, rng)
    info = sv.checkpoint_bytes(ckpt)
    serves = {"ours": _serve("ours", rng), "upstream": _serve("upstream", rng)}
    step_us = rng.uniform(500, 900)
    prof = {"workload": {"prompt_len": 1024}, "prompt_len": 1024,
            "steps": [{"batch": 64, "steps": 80, "median_kernel_us": step_us}]}  # fmt: skip
    recs = sv.build_records({"ours": info, "upstream": info}, serves, {("ours", 64): prof}, 4000.0)
    assert len(recs) == 2 * 2 * 2  # impls x shapes x concurrencies; the failed run is left out
    for r in recs:
        runs = [x for x in serves[r["impl"]]["runs"] if x.get("status") == "ok"
                and (x["requested_shape"], x["concurrency"]) == (r["shape"], r["concurrency"])]  # fmt: skip
        first = next(x for x in runs if x["repeat"] == 0)
        assert r["output_tok_s"] == round(first["output_throughput"], 1)
        toks = [x["output_throughput"] for x in runs]
        assert r["repeat_spread_pct"] == round(100 * (max(toks) - min(toks)) / min(toks), 1)
        second = next(x for x in runs if x["repeat"] == 1)
        assert [x["output_tok_s"] for x in r["repeats"]] == [round(t, 1) for t in toks]
        assert r["repeats"][0]["engine_steps"] == first["server"]["engine_steps"]
        assert r["repeats"][0]["preemptions"] == first["server"]["preemptions"]
        assert "engine_steps" not in r["repeats"][1]  # no /metrics read in that run
        assert r["repeats"][0]["compiles"] == first["compiles"]["n"]
        assert r["repeats"][1]["compiles"] is None  # no server log read in that run
        assert r["repeats"][0]["cache_files"] == sum(first["compiles"]["cache_files"].values())
        assert r["repeats"][1]["cache_files"] is None  # no cache watched in that run
        assert r["repeats"][0]["discarded"] == len(first["discarded"])
        assert r["repeats"][1]["discarded"] == 0
        assert r["repeats"][1]["tpot_p50_ms"] == round(second["median_tpot_ms"], 3)
        ctx = int(r["shape"].split("x")[0]) + 512
        sb = sv.step_bytes(info, r["concurrency"], ctx)
        assert r["roofline_us"] == round(sb["total"] / 4000.0 / 1e3, 1)
        # every point, profiled or not: TPOT p50 over the roofline (from the unrounded roofline)
        assert r["tpot_roofline_ratio"] == round(
            first["median_tpot_ms"] * 1e3 / (sb["total"] / 4e6), 3
        )
        if (r["impl"], r["shape"], r["concurrency"]) == ("ours", "1024x1024", 64):
            assert r["step_gpu_us"] == round(step_us, 1)
            assert r["roofline_ratio"] == round(step_us / (sb["total"] / 4e6), 3)
            assert r["gpu_busy_pct"] == round(100 * step_us / (first["median_tpot_ms"] * 1e3), 1)
        else:  # no profile at that point (or a profile of another prompt length)
            assert r["step_gpu_us"] is None and r["gpu_busy_pct"] is None
    md = sv.markdown(recs, {"command": "c", "copy": {"gbps": 4000.0}})
    assert md.count("\n| 1024x1024 |") == 2 and md.count("\n| 8192x1024 |") == 2
    assert "ours/upstream tok/s" in md and "| ours TPOT/roofline |" in md
    o = next(
        r for r in recs if (r["impl"], r["shape"], r["concurrency"]) == ("ours", "1024x1024", 64)
    )
    assert (
        f"| {o['roofline_ratio']:.2f} | {o['tpot_roofline_ratio']:.2f} | {o['gpu_busy_pct']:.1f} |"
        in md
    )
    rep0 = o["repeats"][0]
    assert (f"| ours | 1024x1024 | 64 | 0 | {rep0['output_tok_s']:.1f} | {rep0['tpot_p50_ms']:.2f} |"
            in md)  # fmt: skip
    assert (
        f"| {rep0['preemptions']:.0f} | {rep0['queue_s']:.1f} | {rep0['engine_steps']:.0f} "
        f"| {rep0['compiles']} | {rep0['cache_files']} | {rep0['discarded']} "
        "| _k x2, hc_gemm |" in md
    )
    assert rep0["kernels"] == {"triton: _k": 2, "vllm: hc_gemm": 1}
    assert o["repeats"][1]["kernels"] is None and "| 0 | - |" in md  # none recorded
    assert md.count("\n| ours | ") == 8 and md.count("\n| upstream | ") == 8  # 4 points x 2 repeats


def test_report_cli(tmp_path: Path) -> None:
    rng = random.Random(5)
    (tmp_path / "c").mkdir()
    ckpt, _ = _ckpt(tmp_path / "c", rng)
    (tmp_path / "s.json").write_text(json.dumps(_serve("ours", rng)))
    (tmp_path / "copy.json").write_text(json.dumps({"gbps": 4100.0}))
    rc = sv.main(["report", "--ckpt", f"ours={ckpt}", "--serve", f"ours={tmp_path / 's.json'}",
                  "--copy", str(tmp_path / "copy.json"), "--json", str(tmp_path / "o.json"),
                  "--md", str(tmp_path / "o.md"), "--commit", "abc"])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["provenance"]["commit"] == "abc" and len(doc["records"]) == 4
    keys = {"impl", "shape", "concurrency", "output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "layers",
            "gpu_busy_pct", "step_gpu_us", "roofline_us"}  # fmt: skip
    assert all(keys <= set(r) for r in doc["records"])
    assert sv.main(["report", "--ckpt", f"ours={ckpt}", "--serve", "ours=/nonexistent.json",
                    "--copy", str(tmp_path / "copy.json"), "--json", str(tmp_path / "x.json")]) == 2  # fmt: skip
    assert not (tmp_path / "x.json").exists()
