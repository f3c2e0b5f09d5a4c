"""`cutedsl.sm90.tactics.reachable_tactics` (what a warm-up compiles and what the vLLM adapters
prefetch) is exactly the set of tactics `launch_tactic` returns for some M in 1..max_rows: never
one less (a launch would compile after warm-up, or fail during CUDA-graph capture), never one more
(a compile no request can use). CPU only: the reference walks every M."""

from __future__ import annotations

import random

import pytest

from cutedsl.sm90 import runners
from cutedsl.sm90.tactics import (
    GpuSpec,
    StreamTactic,
    Tactic,
    launch_tactic,
    reachable_tactics,
    table_tactic,
    tuned_table,
)

H200 = GpuSpec("NVIDIA H200", 132)  # has a tuned table (cutedsl/tuned/sm90/NVIDIA_H200.json)
H100 = GpuSpec("NVIDIA H100 80GB HBM3", 132)  # a table of decode rows (M <= 32) only
OTHERS = [H100, GpuSpec("a partitioned GPU", 16), GpuSpec("NVIDIA H20", 78)]


def every_m(n: int, k: int, groups: int, moe: bool, max_rows: int, spec: GpuSpec) -> set[Tactic]:
    return {launch_tactic(m, n, k, groups, moe, spec) for m in range(1, max_rows + 1)}


def test_the_tables_are_used() -> None:
    assert tuned_table(H200), "no tuned H200 table: the table path would go untested"
    assert tuned_table(H100), "no tuned H100 table: a table of decode rows would go untested"
    assert tuned_table(GpuSpec(H100.name, 16)) == {}, "another SM count: the rule"


@pytest.mark.parametrize("spec", [H200, *OTHERS], ids=lambda s: s.name)
def test_dense_and_grouped_shapes_of_the_table_and_the_rule(spec: GpuSpec) -> None:
    table = sorted(tuned_table(spec) or tuned_table(H200))[:12]
    shapes = table + [(1536, 4096, 1), (4096, 1024, 8), (576, 7168, 1)]
    for n, k, g in shapes:
        for max_rows in (1, 16, 33, 300, 2048, 8192):
            got = reachable_tactics(n, k, g, False, max_rows, spec)
            assert got == every_m(n, k, g, False, max_rows, spec), (n, k, g, max_rows)


@pytest.mark.parametrize("spec", [H200, *OTHERS], ids=lambda s: s.name)
def test_moe_shapes(spec: GpuSpec) -> None:
    for n, k, e in ((4096, 4096, 256), (4096, 2048, 256), (2048, 4096, 8), (6144, 7168, 384)):
        for max_rows in (6, 64, 8 * 512, 8 * 8192):
            got = reachable_tactics(n, k, e, True, max_rows, spec)
            assert got == every_m(n, k, e, True, max_rows, spec), (n, k, e, max_rows)


def test_random_shapes_and_gpus() -> None:
    rng = random.Random(random.getrandbits(32))
    for _ in range(40):
        spec = GpuSpec(f"gpu{rng.randrange(4)}", rng.choice([8, 16, 66, 78, 114, 132, 148]))
        moe = rng.random() < 0.5
        n = 64 * rng.randrange(1, 97)
        k = 64 * rng.choice([2, 8, 16, 32, 64, 112])
        groups = rng.choice([1, 2, 8, 16, 64, 256]) if moe else rng.choice([1, 1, 4, 8, 16])
        max_rows = rng.randrange(1, 20000)
        got = reachable_tactics(n, k, groups, moe, max_rows, spec)
        assert got == every_m(n, k, groups, moe, max_rows, spec), (
            spec,
            n,
            k,
            groups,
            moe,
            max_rows,
        )


def test_table_entries_are_checked() -> None:
    assert table_tactic({"tactic": [64, 16, 4]}, 16) == Tactic(64, 16, 4)
    stream = {"kernel": "stream", "tactic": [32, 8, 16, 2]}
    assert table_tactic(stream, 4) == StreamTactic(32, 8, 16, 2)
    with pytest.raises(ValueError, match="at M = 16 takes at most 8 tokens"):
        table_tactic(stream, 16)
    with pytest.raises(ValueError, match="kernel 'fast'"):
        table_tactic({"kernel": "fast", "tactic": [1]}, 1)


def test_h100_decode_rows_take_the_streaming_kernel_where_it_was_faster() -> None:
    """bench/results/h100/gemm_sm90_stream.md: Flash wo_b (N 4096, K 8192) at M = 1 and 4 ran
    fastest on the streaming kernel, wq_b (N 32768, K 1024) on the tiled one."""
    assert launch_tactic(1, 4096, 8192, 1, False, H100) == StreamTactic(32, 8, 16, 2)
    assert launch_tactic(3, 4096, 8192, 1, False, H100) == StreamTactic(32, 8, 16, 2)
    assert isinstance(launch_tactic(5, 4096, 8192, 1, False, H100), Tactic)
    assert isinstance(launch_tactic(1, 32768, 1024, 1, False, H100), Tactic)
    # MoE launches never take it from a table (rows per expert are unknown on the host)
    assert isinstance(launch_tactic(1, 4096, 4096, 256, True, H100), Tactic)


def test_no_rows_no_tactics() -> None:
    assert reachable_tactics(4096, 4096, 1, False, 0, H200) == frozenset()


def test_runner_plans_are_the_union_of_their_gemms() -> None:
    """The jobs the vLLM adapters prefetch are the kernels the runners' warm-up compiles."""
    h, i, e, max_tokens = 4096, 2048, 256, 512
    w13, w2 = runners.moe_tactics(e, h, i, max_tokens, H200)
    assert w13 == {(t, True) for t in every_m(2 * i, h, e, True, 8 * max_tokens, H200)}
    assert w2 == {(t, True) for t in every_m(h, i, e, True, 8 * max_tokens, H200)}
    jobs = runners.moe_jobs(e, h, i, 10.0, max_tokens, H200)
    gemm_args = {(j.args, j.kwargs) for j in jobs if j.build.__module__ == "cutedsl.sm90.gemm"}
    assert gemm_args == {((t.tile_n, t.tile_m, t.split_k, True), ()) for t, _ in w13 | w2}
    assert {j.build.__module__ for j in jobs} == {
        "cutedsl.sm90.gemm", "cutedsl.sm90.routing", "cutedsl.sm90.swiglu"
    }  # fmt: skip
    shared = runners.shared_mlp_jobs(h, i, 10.0, max_tokens, H200)
    want = every_m(2 * i, h, 1, False, max_tokens, H200) | every_m(h, i, 1, False, max_tokens, H200)
    assert {j.args for j in shared[:-1]} == {(t.tile_n, t.tile_m, t.split_k, False) for t in want}


def test_fused_swiglu_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUTEDSL_SM90_FUSED_SWIGLU=1 the routed w13 tactics are planned with the fused
    epilogue (its limit in the key), w2 without, and no separate SwiGLU kernel; a bad value is
    refused naming the variable."""
    h, i, e, max_tokens = 4096, 2048, 256, 512
    w13, w2 = runners.moe_tactics(e, h, i, max_tokens, H200)
    monkeypatch.setenv(runners.FUSED_SWIGLU_ENV, "1")
    jobs = runners.moe_jobs(e, h, i, 10.0, max_tokens, H200)
    gemm_jobs = {(j.args, j.kwargs) for j in jobs if j.build.__module__ == "cutedsl.sm90.gemm"}
    fused = (("swiglu", True), ("swiglu_limit", 10.0))
    assert gemm_jobs == {((t.tile_n, t.tile_m, t.split_k, True), fused) for t, _ in w13} | {
        ((t.tile_n, t.tile_m, t.split_k, True), ()) for t, _ in w2
    }
    assert "cutedsl.sm90.swiglu" not in {j.build.__module__ for j in jobs}
    monkeypatch.setenv(runners.FUSED_SWIGLU_ENV, "yes")
    with pytest.raises(ValueError, match="CUTEDSL_SM90_FUSED_SWIGLU='yes'"):
        runners.moe_jobs(e, h, i, 10.0, max_tokens, H200)
