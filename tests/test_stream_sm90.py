"""The SM90 streaming decode GEMM (cutedsl/sm90/kernels/stream.py; host side
cutedsl/sm90/stream.py, cutedsl/sm90/stream_weight.py).

CPU: the stream layout is a permutation of the sm90 encoding's words (independent index reference,
round trip, every element) that decodes exactly to the NVFP4 weight; the torch statement of the
kernel's schedule and math on the stream operands equals the reference ops; the schedule covers
each unit once; every variant compiles for sm_90a (through the jit cache and check-kernels) and
shows the instructions the design relies on.
GPU (sm90): kernel vs the reference on fresh random data, outputs poisoned with NaN, every M in
1..32 and every tactic, dense and grouped, determinism, counters left zero, CUDA-graph capture and
replay with no allocation and no compile.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cutedsl import formats, jit
from cutedsl import reference as ref
from cutedsl.sm90 import stream as ST
from cutedsl.sm90 import stream_weight as SW
from cutedsl.sm90 import weight as W
from cutedsl.sm90.kernels import stream as K
from cutedsl.tools import check_kernels

TARGETS = K.check_targets()


def _weight(groups: int, n: int, k: int, dev: str = "cpu", special: bool = False):
    """Fresh random NVFP4 weight [groups, n, k]: codes, e4m3 block scales (special: every
    magnitude 0x00..0x7E, half negative), global scales."""
    packed = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8)
    if special:
        mag = torch.randint(0, 0x7F, (groups, n, k // 16), dtype=torch.int32)
        sign = torch.randint(0, 2, (groups, n, k // 16), dtype=torch.int32) << 7
        sf = (mag | sign).to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        sf = (torch.rand(groups, n, k // 16) * 3 + 0.02).to(torch.float8_e4m3fn)
    gs = torch.rand(groups) * 0.01 + 0.001
    return packed.to(dev), sf.to(dev), gs.to(dev)


# ------------------------------------------------------------------------------------- CPU


def _expected_blob(wp: W.Weight) -> torch.Tensor:
    """The stream layout by its definition, one 32-bit word at a time (independent of
    `stream_weight`'s vectorized gathers): int32 [L, KP, B, 1152]."""
    L, N, KH = wp.w.shape
    KP, B = 2 * KH // 128, N // 64
    words = wp.w.view(torch.int32).reshape(L, N, 2 * KP, 4, 2).tolist()  # [l][n][tile][c][q]
    sf = wp.sf.tolist()  # [l][tile][n]
    out = torch.empty(L, KP, B, 1152, dtype=torch.int32)
    for lj in range(L * KP * B):
        l, j, b = lj // (KP * B), (lj // B) % KP, lj % B
        rec = []
        for kt in range(2):
            for t in range(128):
                row0 = 64 * b + 16 * (t // 32) + (t % 32) // 4
                c = t % 4
                for rr, q in ((0, 0), (0, 1), (1, 0), (1, 1)):
                    rec.append(words[l][row0 + 8 * rr][2 * j + kt][c][q])
        for s in range(32):
            row0 = 64 * b + 16 * (s // 8) + s % 8
            for kt, rr in ((0, 0), (0, 1), (1, 0), (1, 1)):
                rec.append(sf[l][2 * j + kt][row0 + 8 * rr])
        out[l, j, b] = torch.tensor(rec, dtype=torch.int32)
    return out


def test_stream_layout_is_the_defined_permutation_of_the_sm90_words() -> None:
    """Every word of the stream blob is where the layout's definition puts it, the blob holds
    exactly the sm90 encoding's words (a permutation: same multiset, same size), and
    from_stream(to_stream(w)) gives every element of the sm90 encoding back."""
    groups, n, k = 2, 192, 384
    packed, sf, gs = _weight(groups, n, k, special=True)
    wp = W.prepare_weight(packed, sf, gs)
    sw = SW.to_stream(wp)
    assert sw.blob.shape == (groups, k // 128, n // 64, SW.CHUNK) and sw.blob.dtype == torch.uint8
    assert sw.blob.is_contiguous()
    got = sw.blob.view(torch.int32)
    assert torch.equal(got, _expected_blob(wp))
    src = torch.cat((wp.w.reshape(-1).view(torch.int32), wp.sf.reshape(-1)))
    assert torch.equal(got.reshape(-1).sort().values, src.sort().values)
    back = SW.from_stream(sw)
    assert torch.equal(back.w, wp.w) and torch.equal(back.sf, wp.sf)
    assert torch.equal(back.gs, wp.gs) and (back.n, back.k, back.groups) == (n, k, groups)


def test_stream_weight_decodes_exactly_to_the_nvfp4_weight() -> None:
    """prepare_stream_weight (the load-time path) decodes, through the host model of the kernel's
    register decode, to exactly e2m1 x block scale of the checkpoint tensors
    (formats.dequantize_nvfp4 with global scale 1): every e2m1 code, every e4m3 magnitude
    (subnormals, zero), negative scales; the global scale multiplies after it, per group."""
    groups, n, k = 3, 128, 512
    packed, sf, gs = _weight(groups, n, k, special=True)
    sw = SW.prepare_stream_weight(packed.reshape(groups * n, -1), sf.reshape(groups * n, -1), gs,
                                  groups=groups)  # fmt: skip
    want = formats.dequantize_nvfp4(packed, sf, 1.0, torch.float32)  # e2m1 x block scale
    got = W.decode_emulated(SW.from_stream(sw))
    assert torch.equal(got, want), f"{int((got != want).sum())} weights decode differently"
    assert torch.equal(SW.dequantize_stream(sw), want * gs[:, None, None])


def test_stream_weight_refuses_k_not_a_multiple_of_128() -> None:
    packed, sf, gs = _weight(1, 64, 192)
    with pytest.raises(ValueError, match="multiple of 128"):
        SW.prepare_stream_weight(packed[0], sf[0], gs[0])


@pytest.mark.parametrize(("units", "ctas"), [(1, 1), (7, 3), (64, 64), (96, 40), (1000, 132)])
def test_schedule_covers_each_unit_once(units: int, ctas: int) -> None:
    """The CTAs' unit ranges partition [0, U), none is empty (G <= U), and cta_of inverts them."""
    starts = [ST.unit_start(c, units, ctas) for c in range(ctas + 1)]
    assert starts[0] == 0 and starts[-1] == units
    assert all(b > a for a, b in zip(starts, starts[1:]))
    for u in range(units):
        c = ST.cta_of(u, units, ctas)
        assert starts[c] <= u < starts[c + 1], (u, c)


CASES = [  # (groups, n, k, m)
    (1, 256, 1024, 1),
    (1, 384, 512, 7),
    (1, 128, 256, 32),
    (3, 128, 640, 5),
]


@pytest.mark.parametrize(("groups", "n", "k", "m"), CASES)
def test_emulate_equals_the_reference(groups: int, n: int, k: int, m: int) -> None:
    """The torch statement of the kernel (its schedule, partials and ordered sums, on the stream
    operands) equals the reference op (fp32 math on the checkpoint tensors) for every tactic that
    takes m and grids from one CTA to one per unit: only the fp32 summation order differs."""
    packed, sf, gs = _weight(groups, n, k)
    sw = SW.prepare_stream_weight(packed, sf, gs)
    a = torch.randn(groups, m, k).to(torch.bfloat16)
    if groups == 1:
        want = ref.nvfp4_linear_ref(a[0], packed[0], sf[0], gs[0])[None]
    else:  # the grouped o-projection's reference takes [T, G, D] and one global scale
        want = torch.stack(
            [ref.nvfp4_linear_ref(a[g], packed[g], sf[g], gs[g]) for g in range(groups)]
        )
        want_g = (
            ref.nvfp4_grouped_oproj_ref(
                a.transpose(0, 1), packed.reshape(groups * n, -1), sf.reshape(groups * n, -1), 1.0
            ).transpose(0, 1)
            * gs[:, None, None]
        )
        torch.testing.assert_close(want, want_g, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for tactic in ST.tactics_for(m, n):
        units = groups * (n // tactic.rows) * (k // 128)
        for ctas in sorted({c for c in (1, 2, 3, units // 3, units - 1, units) if 1 <= c <= units}):
            got = ST.emulate(a, sw, tactic, ctas)
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), (str(tactic), ctas, err)


def test_tactics_and_refusals() -> None:
    assert ST.default_tactic(1, 4096) == ST.StreamTactic(2, 16, 1)
    assert ST.default_tactic(17, 4096) == ST.StreamTactic(2, 32, 1)
    assert ST.default_tactic(32, 192) == ST.StreamTactic(1, 32, 1)
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        ST.default_tactic(33, 4096)
    for m in range(1, 33):
        ts = ST.tactics_for(m, 1536)
        assert ts and all(m <= t.tile_m for t in ts)
        assert {(t.warpgroups, t.ctas_per_sm) for t in ts} == {(1, 1), (1, 2), (2, 1)}
    with pytest.raises(ValueError, match="warpgroups"):
        K.Sm90StreamW4A16DecodeKernel(warpgroups=4)
    with pytest.raises(ValueError, match="tile_m"):
        K.Sm90StreamW4A16DecodeKernel(tile_m=8)
    with pytest.raises(ValueError, match="stages"):
        K.Sm90StreamW4A16DecodeKernel(stages=1)
    assert K.Sm90StreamW4A16DecodeKernel.can_implement(1536, 4096, 2)
    assert not K.Sm90StreamW4A16DecodeKernel.can_implement(1536, 4160, 2)  # K % 128
    assert not K.Sm90StreamW4A16DecodeKernel.can_implement(192, 4096, 2)  # N % 128
    for w in K.WARPGROUPS:
        for tm in K.TILE_MS:
            for c in (1, 2):  # the ring fits c CTAs per SM (228 KiB, 1 KiB reserved per CTA)
                st = K.default_stages(w, tm, c)
                assert c * (st * K.stage_bytes(w, tm) + 2048) <= 233472 - 1024 * c, (w, tm, c)


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_variant_compiles_for_sm90a_and_shows_the_design(target) -> None:
    """Register-A WGMMA (HGMMA with an R operand), the prmt / shf decode, the bulk weight copy
    (UBLKCP) with its evict-first policy, the activation TMA, 128-bit shared fragment loads and
    the partial protocol's fence / atomic / L2 loads, in the PTX and the SASS."""
    r = check_kernels.run_target("cutedsl.sm90.kernels.stream", target)
    assert r.ok, f"{target.name}: {r.error or 'missing ' + ', '.join(r.missing)}"


def test_compiles_through_the_jit_cache(tmp_path) -> None:
    """The launcher's builder compiles for sm_90a on this GPU-less machine through `jit.compiled`
    (the one compile cache): once per key, a second call is a hit. In a fresh process: the DSL
    reads CUTE_DSL_ARCH once per process."""
    code = (
        "from cutedsl import jit\n"
        "from cutedsl.sm90 import stream as ST\n"
        "fn = jit.compiled(ST._build, 2, 16, 1, no_jit_engine=True)\n"
        "again = jit.compiled(ST._build, 2, 16, 1, no_jit_engine=True)\n"
        "print(fn is not None, again is fn, jit.compile_count(), jit.target_arch())\n"
    )
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTEDSL_CACHE_DIR=str(tmp_path / "cache"))
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True", "1", "sm_90a"], r.stdout
    assert [j.args for j in ST.jobs([ST.StreamTactic(1, 32, 2), ST.StreamTactic(2, 16, 1)])] == [
        (1, 32, 2),
        (2, 16, 1),
    ]


# ------------------------------------------------------------------------------------- GPU


def _assert_close(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16 output vs the fp32 reference (one bf16 rounding; fp32 sums in another order)."""
    assert not torch.isnan(out).any(), f"{what}: NaN left in output (an element was not written)"
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(want.shape)}"
    err = (out.float() - want).abs()
    tol = 8e-3 * want.abs() + 2e-3 * want.abs().max().clamp_min(1e-6)
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, max err {err.max().item():.4g}, "
        f"max |ref| {want.abs().max().item():.4g}, first at {bad.nonzero()[0].tolist()}"
    )


def _poison(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _dense(n: int, k: int):
    packed, sf, gs = _weight(1, n, k, "cuda")
    return SW.prepare_stream_weight(packed[0], sf[0], gs[0]), (packed[0], sf[0], gs[0])


DENSE = [  # (name, N, K)
    ("small", 128, 256),
    ("one_unit_per_cta", 256, 1024),
    ("flash.fused_wqa_wkv", 1536, 4096),
    ("flash.wq_b", 32768, 1024),
    ("pro.wo_b", 7168, 16384),
]


@pytest.mark.sm90
@pytest.mark.parametrize(("name", "n", "k"), DENSE, ids=[d[0] for d in DENSE])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 32])
def test_dense_edge_m(name: str, n: int, k: int, m: int) -> None:
    sw, (packed, sf, gs) = _dense(n, k)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = _poison((m, n))
    ST.linear(a, sw, out)
    if m:
        _assert_close(out, ref.nvfp4_linear_ref(a, packed, sf, gs), f"{name} m={m}")


TACTIC_MS = [1, 9, 16, 23, 32]


@pytest.mark.sm90
@pytest.mark.parametrize(("n", "k"), [(1536, 4096), (512, 256), (4096, 2048)])
@pytest.mark.parametrize("m", TACTIC_MS)
def test_dense_every_tactic(n: int, k: int, m: int) -> None:
    """Every tactic that takes m: whole row tiles, split ones, grids up to one CTA per unit."""
    sw, (packed, sf, gs) = _dense(n, k)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    want = ref.nvfp4_linear_ref(a, packed, sf, gs)
    for tactic in ST.tactics_for(m, n):
        out = _poison((m, n))
        ST.linear(a, sw, out, tactic=tactic)
        _assert_close(out, want, f"{tactic} n={n} k={k} m={m}")


@pytest.mark.sm90
def test_dense_special_scales() -> None:
    """Subnormal, zero and negative block scales through the kernel."""
    n, k, m = 512, 2048, 5
    packed, sf, gs = _weight(1, n, k, "cuda", special=True)
    sw = SW.prepare_stream_weight(packed[0], sf[0], gs[0])
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = _poison((m, n))
    ST.linear(a, sw, out)
    _assert_close(out, ref.nvfp4_linear_ref(a, packed[0], sf[0], gs[0]), "special scales")


GROUPED = [("flash.wo_a", 8, 1024, 4096), ("pro.wo_a", 16, 1024, 4096), ("small", 3, 128, 256)]


@pytest.mark.sm90
@pytest.mark.parametrize(("name", "g", "n", "k"), GROUPED, ids=[x[0] for x in GROUPED])
@pytest.mark.parametrize("m", [1, 6, 16, 32])
def test_grouped_every_tactic(name: str, g: int, n: int, k: int, m: int) -> None:
    packed, sf, gs = _weight(g, n, k, "cuda")
    sw = SW.prepare_stream_weight(packed, sf, gs)
    a = torch.randn(g, m, k, device="cuda").to(torch.bfloat16)
    want = torch.stack([ref.nvfp4_linear_ref(a[i], packed[i], sf[i], gs[i]) for i in range(g)])
    for tactic in ST.tactics_for(m, n):
        out = _poison((g, m, n))
        ST.grouped(a, sw, out, tactic=tactic)
        _assert_close(out, want, f"{name} {tactic} m={m}")


@pytest.mark.sm90
def test_deterministic_and_counters_left_zero() -> None:
    """Split row tiles are summed in CTA order whoever arrives last: launches are bit-identical,
    and every per-tile counter is zero after each launch."""
    n, k, m = 1536, 4096, 7
    sw, _ = _dense(n, k)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    tactic = ST.default_tactic(m, n)
    ctas = ST.grid_ctas(a.device, tactic)
    scratch = ST.scratch_for(a.device, tactic, ctas, n // tactic.rows)
    first = ST.linear(a, sw, tactic=tactic, scratch=scratch)
    for _ in range(20):
        assert torch.equal(ST.linear(a, sw, tactic=tactic, scratch=scratch), first)
    torch.cuda.synchronize()
    assert int(scratch.counters.abs().sum()) == 0


@pytest.mark.sm90
def test_cuda_graph_capture_replays_fresh_data_without_allocating() -> None:
    """After a warm-up launch, a launch allocates nothing and compiles nothing; a captured graph
    replays correctly on fresh activations (dense and grouped)."""
    n, k, m, g = 1536, 4096, 9, 8
    sw, (packed, sf, gs) = _dense(n, k)
    gp, gsf, ggs = _weight(g, 1024, 4096, "cuda")
    swg = SW.prepare_stream_weight(gp, gsf, ggs)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ag = torch.randn(g, m, 4096, device="cuda").to(torch.bfloat16)
    out, outg = _poison((m, n)), _poison((g, m, 1024))
    ST.linear(a, sw, out)
    ST.grouped(ag, swg, outg)  # warm-up: compiles, makes the scratch
    torch.cuda.synchronize()
    compiles = jit.compile_count()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
    ST.linear(a, sw, out)
    ST.grouped(ag, swg, outg)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ST.linear(a, sw, out)
        ST.grouped(ag, swg, outg)
    for _ in range(3):
        a.copy_(torch.randn(m, k, device="cuda").to(torch.bfloat16))
        ag.copy_(torch.randn(g, m, 4096, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        outg.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, ref.nvfp4_linear_ref(a, packed, sf, gs), "graph dense")
        want = torch.stack([ref.nvfp4_linear_ref(ag[i], gp[i], gsf[i], ggs[i]) for i in range(g)])
        _assert_close(outg, want, "graph grouped")
    assert jit.compile_count() == compiles


@pytest.mark.sm90
def test_gpu_matches_the_torch_statement() -> None:
    """The kernel and `emulate` (its schedule on the host) agree to fp32 rounding on the GPU's
    grid: the statement the CPU tests check is the kernel's."""
    n, k, m = 512, 2048, 4
    sw, _ = _dense(n, k)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    for tactic in ST.tactics_for(m, n):
        units = (n // tactic.rows) * (k // 128)
        ctas = min(ST.grid_ctas(a.device, tactic), units)
        want = ST.emulate(a.unsqueeze(0), sw, tactic, ctas)[0]
        out = _poison((m, n))
        ST.linear(a, sw, out, tactic=tactic)
        _assert_close(out, want, str(tactic))


def test_bench_has_the_stream_column() -> None:
    """The GEMM bench times the stream design next to ours at M <= 32 (dense and wo_a): its
    applicability, the derived ratios, and the MD columns (blank past M = 32)."""
    from cutedsl.bench import gemm_sm90 as B

    shapes = {s.name: s for s in B.SHAPES["flash"]}
    assert "stream" in B.IMPLS
    assert B.stream_applies(shapes["wq_b"], 1) is None
    assert B.stream_applies(shapes["wo_a(G=8)"], 32) is None
    assert B.stream_applies(shapes["wq_b"], 64).startswith("n/a")
    assert B.stream_applies(shapes["routed_w13(E=256)"], 1).startswith("n/a")
    r = B.new_row("flash", shapes["wq_b"], 1)
    r.update(us=9.0, stream_us=6.0, copy_us=5.4, stream_tactic="stream2x16x1")
    r = B.finalize_row(r, 4000.0)
    assert r["x_stream"] == 1.5 and r["pct_copy_time_stream"] == 90.0
    big = B.finalize_row(dict(B.new_row("flash", shapes["wq_b"], 64), us=20.0), 4000.0)
    md = B.format_md(
        dict(date="d", command="c", header=[], stopped_early="", device="x"), [r, big]
    ).splitlines()
    table = [ln for ln in md if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]
    i = head.index("ours/stream")
    assert cells[0][i] == "1.50" and cells[1][i] == ""
    assert cells[0][head.index("stream tactic")] == "stream2x16x1"
