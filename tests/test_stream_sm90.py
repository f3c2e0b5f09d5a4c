"""sm_90a streaming decode GEMM (cutedsl/sm90/kernels/stream.py; through `cutedsl.sm90.gemm` with
a `StreamTactic`, forced or named by a GPU's tuned table).

CPU: every check target compiles for sm_90a with its cp.async ring, mma.sync and the register
decode; configuration limits; what a launch refuses before compiling.
GPU (sm90): kernel vs fp32 torch math on the same quantized operands, fresh random data, outputs
poisoned with NaN; every configuration, edge token counts, K tiles fewer than warps, grouped
token-major views, determinism.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close as _assert_close
from nvfp4_data import moe_case as _moe_case
from nvfp4_data import poisoned as _poison
from nvfp4_data import rand_weight as _rand_weight
from nvfp4_data import ref_w4a16 as _ref

from cutedsl.sm90 import gemm as G
from cutedsl.sm90 import weight as W
from cutedsl.sm90.kernels import stream
from cutedsl.sm90.tactics import StreamTactic
from cutedsl.tools import check_kernels

TARGETS = stream.check_targets()
K = stream.Sm90Nvfp4StreamGemmKernel


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_variant_compiles_for_sm90a_with_mma_sync(target) -> None:
    r = check_kernels.run_target("cutedsl.sm90.kernels.stream", target)
    assert r.ok, f"{target.name}: {r.error or 'missing ' + ', '.join(r.missing)}"


def test_check_targets_cover_every_row_block_and_token_width() -> None:
    cfgs = {tuple(int(x) for x in t.name.split(".")[-1][1:].replace("t", " ").replace("w", " ")
                  .replace("d", " ").replace("p", " ").replace("r", " ").split())
            for t in TARGETS}  # fmt: skip
    assert {r for r, *_ in cfgs} == set(stream.ROWS)
    assert {t for _, t, *_ in cfgs} == set(stream.TOKENS)
    persistent = {c for c in cfgs if len(c) >= 5}  # the persistent grid: each row block too
    assert {r for r, *_ in persistent} == set(stream.ROWS)
    assert any(len(c) == 6 for c in cfgs)  # and resident activations
    assert all("wgmma" in t.absent_patterns for t in TARGETS)


@pytest.mark.parametrize(
    ("cfg", "msg"),
    [
        ((24, 8, 8, 4), "rows must be one of"),
        ((16, 12, 8, 4), "tokens must be one of"),
        ((16, 8, 0, 4), "warps must be 1..16"),
        ((16, 8, 17, 4), "warps must be 1..16"),
        ((16, 8, 8, 1), "depth must be 2..16"),
        ((32, 32, 16, 16), "need .* B of shared memory"),
        # 232320 B: under the 227 KiB a CTA may have, not beside the DSL's static 1 KiB
        ((16, 8, 11, 11), "need 232320 B of shared memory"),
    ],
)
def test_configuration_limits_are_refused(cfg, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        K(*cfg)
    K(16, 8, 11, 10)  # 211200 B


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"ctas": -1}, "ctas must be 0 .one CTA per row block. or 1..4096"),
        ({"ctas": stream.MAX_CTAS + 1}, "ctas must be 0"),
        ({"res": 2}, "res > 0 .resident activations. needs the persistent grid"),
        ({"ctas": 132, "res": stream.MAX_RES + 1}, "res must be 0 or 1..64"),
    ],
)
def test_persistent_limits_are_refused(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        K(16, 8, 8, 4, **kw)


def test_persistent_park_regions_count_against_shared_memory() -> None:
    """Persistent mode parks in two regions per warp beside the ring, which never stops."""
    K(16, 8, 14, 8)  # 215040 B: the fragments park in the ring
    assert K.smem_bytes(16, 8, 14, 8, 132) - K.smem_bytes(16, 8, 14, 8) == 14 * 2 * 640
    with pytest.raises(ValueError, match="need 232960 B of shared memory"):
        K(16, 8, 14, 8, ctas=132)
    # resident activations: the ring stages lose their activation rows, each warp gains res slots
    assert K.stage_bytes(16, 16, res=1) == K.stage_bytes(16, 16) - 2 * stream.A_TILE
    assert K.smem_bytes(16, 16, 16, 2, 132, 4) == 16 * (2 * 768 + 2 * 1280 + 4 * 2 * 1152)
    with pytest.raises(ValueError, match="and 4 resident slots need 237568 B"):
        K(16, 16, 16, 4, ctas=132, res=4)


def test_ring_and_park_sizes() -> None:
    """A stage holds per lane 12 bytes per row pair, and per token tile 8 activation rows of
    64 k padded to 144 B (ldmatrix's 8 row addresses then hit distinct bank groups); the parked
    fragments (8 token rows of 20 floats per block) fit the region they reuse."""
    assert K.stage_bytes(16, 8) == 2 * 32 * 12 + 8 * 144
    assert K.stage_bytes(32, 32) == 4 * 32 * 12 + 4 * 8 * 144
    assert len({(r * stream.A_ROW // 16) % 8 for r in range(8)}) == 8
    for r in stream.ROWS:
        for t in stream.TOKENS:
            park = (r // 16) * (t // 8) * stream.BLOCK * 4
            assert K.region_bytes(r, t, 2) >= park
            assert K.region_bytes(r, t, 2) >= 2 * K.stage_bytes(r, t)


def _cpu_weight(n: int, k: int, groups: int = 1):
    packed = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8)
    sf = (torch.rand(groups, n, k // 16) * 4 + 2**-7).to(torch.float8_e4m3fn)
    return W.prepare_weight(packed, sf, torch.rand(groups) * 0.02 + 0.001)


@pytest.mark.parametrize(
    ("m", "n", "tactic", "err", "msg"),
    [
        (9, 256, StreamTactic(16, 8, 8, 4), ValueError, "9 rows, tactic s16x8w8d4 takes at most 8"),
        (4, 256, StreamTactic(16, 12, 8, 4), ValueError, "tokens must be one of"),
        (4, 272, StreamTactic(32, 8, 8, 4), ValueError, "N = 272 is not a multiple of 32"),
    ],
)
def test_launch_refuses_before_compiling(m, n, tactic, err, msg) -> None:
    """Checked on the host, before any compile or device work (CPU tensors)."""
    wp = _cpu_weight(n if n % 64 == 0 else 320, 128)
    if n % 64:  # a weight whose N is a multiple of 16 but not of 32 (not a prepared shape)
        wp = W.Weight(wp.w[:, :n], wp.sf[:, :, :n], wp.gs, n, wp.k, 1)
    a = torch.randn(m, 128, dtype=torch.bfloat16)
    with pytest.raises(err, match=msg):
        G.linear(a, wp, out=torch.empty(m, n, dtype=torch.bfloat16), tactic=tactic)


def test_resident_slots_must_hold_every_k_tile_of_a_warp() -> None:
    """K 1024 = 16 K tiles: 2 per warp of 8, which 1 resident slot cannot hold (on the host,
    before any compile)."""
    wp = _cpu_weight(256, 1024)
    a = torch.randn(1, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 K tiles per warp, over its 1 resident activation"):
        G.linear(a, wp, out=torch.empty(1, 256, dtype=torch.bfloat16),
                 tactic=StreamTactic(16, 8, 8, 2, 132, 1))  # fmt: skip


def test_moe_grid_limit_and_swiglu_are_refused() -> None:
    wp = _cpu_weight(128, 128, groups=2)
    offs = torch.tensor([0, 2, 4], dtype=torch.int32)
    t = StreamTactic(16, 8, 8, 4)
    a = torch.randn(4, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="no SwiGLU"):
        G.moe(a, offs, wp, tactic=t, swiglu=True, swiglu_limit=10.0)
    wide = _cpu_weight(2048, 2048, groups=2)
    rows = 2**31 // 2048  # 32770 token tiles of 32: within the grid, past int32 offsets
    with pytest.raises(ValueError, match="exceed 2\\^31 elements"):
        G.moe(torch.empty(rows, 2048, dtype=torch.bfloat16, device="meta"),
              torch.tensor([0, 0, rows], dtype=torch.int32), wide,
              tactic=StreamTactic(16, 32, 8, 2),
              out=torch.empty(rows, 2048, dtype=torch.bfloat16, device="meta"))  # fmt: skip
    rows = 8 * 65535  # min(E, T) + T // 8 > 65535 CTA rows
    big = torch.empty(rows, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="over the grid limit 65535"):
        G.moe(big, torch.tensor([0, rows // 2, rows], dtype=torch.int32), wp, tactic=t)


def test_stream_jobs_are_stable_and_distinct() -> None:
    ts = [StreamTactic(32, 8, 4, 4), StreamTactic(16, 8, 8, 4), StreamTactic(16, 8, 8, 4)]
    assert [j.args for j in G.stream_jobs(set(ts))] == [(16, 8, 8, 4, False), (32, 8, 4, 4, False)]
    assert [j.args for j in G.stream_jobs(ts[:1], moe=True)] == [(32, 8, 4, 4, True)]
    # the persistent grid's bound and resident slots are keywords (absent at 0: the cache keys
    # of one CTA per block)
    jobs = G.stream_jobs(
        [
            StreamTactic(16, 8, 8, 4, 132, 2),
            StreamTactic(16, 8, 8, 4, 132),
            StreamTactic(16, 8, 8, 4),
        ]
    )
    assert [(j.args, j.kwargs) for j in jobs] == [
        ((16, 8, 8, 4, False), ()),
        ((16, 8, 8, 4, False), (("ctas", 132),)),
        ((16, 8, 8, 4, False), (("ctas", 132), ("res", 2))),
    ]


def test_jobs_split_tiled_and_streaming_tactics() -> None:
    """A warm-up's (tactic, moe) set may mix both kernels (a tuned table's decode rows): each
    tactic gets its own kernel's job; the streaming kernel has no fused SwiGLU."""
    from cutedsl.sm90.tactics import Tactic

    mixed = {
        (Tactic(64, 16, 4), False),
        (StreamTactic(32, 8, 16, 2), False),
        (Tactic(64, 16, 1), True),
    }
    jobs = G.jobs(mixed)
    assert [(j.build, j.args) for j in jobs] == [
        (G._build, (64, 16, 1, True)),
        (G._build, (64, 16, 4, False)),
        (G._build_stream, (32, 8, 16, 2, False)),
    ]
    with pytest.raises(NotImplementedError, match="no SwiGLU"):
        G.jobs(mixed, swiglu=True, swiglu_limit=7.0)


def test_table_configurations_are_tested() -> None:
    """Every streaming configuration a committed tuned table names runs in the GPU tests below
    (the dense test, every shape)."""
    import json

    from cutedsl.sm90.tactics import TUNED_DIR

    named = set()
    for path in sorted(TUNED_DIR.glob("*.json")):
        for per_m in json.loads(path.read_text())["dense"].values():
            named |= {tuple(e["tactic"]) for e in per_m.values() if e.get("kernel") == "stream"}
    assert named, "no table names the streaming kernel: this check would check nothing"
    assert named <= set(CONFIGS), sorted(named - set(CONFIGS))


# ------------------------------------------------------------------------------------- GPU


CONFIGS = [
    (16, 8, 8, 4),
    (16, 8, 8, 8),
    (16, 8, 16, 2),
    (32, 8, 4, 4),
    (16, 16, 8, 4),
    (32, 16, 16, 2),
    (16, 32, 4, 2),
    (32, 32, 8, 2),
    (16, 8, 1, 3),  # one warp: no cross-warp sum
    # the persistent grid: a CTA per SM or two, a few CTAs (several blocks each, uneven), one;
    # a prologue longer than a warp's tiles (three_k_tiles: one block per CTA, <= 1 tile per warp)
    (16, 8, 8, 2, 132),
    (32, 8, 16, 2, 264),
    (16, 32, 4, 2, 7),
    (32, 8, 4, 4, 1),
    (16, 8, 8, 4, 132),
    (16, 8, 8, 8, 7),
    # and every configuration a committed tuned table names (test_table_configurations_are_tested)
    (16, 8, 8, 2),
    (32, 8, 4, 2),
    (32, 8, 8, 2),
    (32, 8, 16, 2),
]
SHAPES = [  # (name, N, K): DSv4-Flash decode shapes and K tile counts below, at and off the warps
    ("flash.fused_wqa_wkv", 1536, 4096),
    ("flash.wq_b", 32768, 1024),
    ("flash.wo_b", 4096, 8192),
    ("three_k_tiles", 256, 192),
    ("odd_k_tiles", 128, 64 * 13),
]


@pytest.mark.sm90
@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(StreamTactic(*c)) for c in CONFIGS])
@pytest.mark.parametrize(("name", "n", "k"), SHAPES, ids=[s[0] for s in SHAPES])
def test_dense_every_configuration(cfg, name: str, n: int, k: int) -> None:
    t = StreamTactic(*cfg)
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    for m in sorted({1, 3, t.tokens // 2 + 1, t.tokens}):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = _poison((m, n))
        G.linear(a, wp, out=out, tactic=t)
        _assert_close(out, _ref(a, packed[0], sf[0], gs[0]), f"{name} {t} M={m}")


PERSISTENT = [c for c in CONFIGS if len(c) == 5]
# resident activations, each on shapes whose K tiles per warp its slots hold: (config, N, K)
RESIDENT = [
    ((16, 8, 8, 2, 132, 2), 32768, 1024),  # flash.wq_b: 2 K tiles per warp
    ((32, 32, 8, 2, 132, 2), 32768, 1024),
    ((16, 16, 16, 2, 33, 4), 1536, 4096),  # flash.fused_wqa_wkv: 4 per warp, 96 blocks on 33
    ((16, 32, 8, 2, 7, 1), 256, 192),  # 3 K tiles: warps with 1 and with none
    ((32, 8, 4, 4, 1, 4), 128, 64 * 13),  # one CTA, 13 K tiles over 4 warps (4 / 3)
]


@pytest.mark.sm90
@pytest.mark.parametrize(
    ("cfg", "n", "k"), RESIDENT, ids=[str(StreamTactic(*c)) for c, *_ in RESIDENT]
)
def test_resident_activations(cfg, n: int, k: int) -> None:
    """Against the fp32 reference, and bit for bit the same configuration streaming its
    activations through the ring."""
    t, ring = StreamTactic(*cfg), StreamTactic(*cfg[:5])
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    for m in sorted({1, 3, t.tokens - 5, t.tokens}):  # a later token tile partly filled too
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got, want = _poison((m, n)), _poison((m, n))
        G.linear(a, wp, out=got, tactic=t)
        G.linear(a, wp, out=want, tactic=ring)
        _assert_close(got, _ref(a, packed[0], sf[0], gs[0]), f"{t} M={m}")
        assert torch.equal(got, want), f"{t} M={m}: not the bits of {ring}"


@pytest.mark.sm90
@pytest.mark.parametrize("cfg", PERSISTENT, ids=[str(StreamTactic(*c)) for c in PERSISTENT])
@pytest.mark.parametrize(("name", "n", "k"), SHAPES, ids=[s[0] for s in SHAPES])
def test_persistent_grid_gives_the_bits_of_one_cta_per_block(cfg, name: str, n: int, k: int):
    """Each warp sums its K tiles in the same order and the warps are summed in warp order
    whichever CTA owns a row block: the persistent grid's output equals, bit for bit, the one
    CTA per block launch of the same configuration."""
    t, base = StreamTactic(*cfg), StreamTactic(*cfg[:4])
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    for m in sorted({1, t.tokens}):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got, want = _poison((m, n)), _poison((m, n))
        G.linear(a, wp, out=got, tactic=t)
        G.linear(a, wp, out=want, tactic=base)
        assert torch.equal(got, want), f"{name} {t} M={m}: not the bits of {base}"


@pytest.mark.sm90
@pytest.mark.parametrize("ctas", [0, 3])  # 3: 32 row blocks over 3 persistent CTAs
def test_rows_past_m_are_not_written_and_a_column_slice_is_read_in_place(ctas: int) -> None:
    """M = 5 of an 8-token tile: the output rows around it stay untouched; `a` is a column slice
    of a wider tensor (row stride 2K)."""
    n, k = 512, 1024
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    wide = torch.randn(5, 2 * k, device="cuda", dtype=torch.bfloat16)
    a = wide[:, k:]
    buf = _poison((7, n))
    G.linear(a, wp, out=buf[1:6], tactic=StreamTactic(16, 8, 8, 4, ctas))
    assert buf[0].isnan().all() and buf[6].isnan().all(), "rows outside the output were written"
    _assert_close(buf[1:6], _ref(a, packed[0], sf[0], gs[0]), "column slice M=5")


@pytest.mark.sm90
@pytest.mark.parametrize(
    ("ctas", "d", "res"),  # 5: each group's 64 row blocks over 5 persistent CTAs; 100: one each
    [(0, 4096, 0), (5, 4096, 0), (100, 4096, 0), (5, 192, 0), (5, 4096, 8)],  # 192: 3 K tiles
)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_grouped_token_major_views(m: int, ctas: int, d: int, res: int) -> None:
    """wo_a as the model holds it: x [T, G, D] in, [T, G, R] out, as transposed views."""
    g, r = 8, 1024
    packed, sf, gs = _rand_weight(g, r, d)
    wp = W.prepare_weight(packed, sf, gs)
    x = torch.randn(m, g, d, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, g, r))
    t = StreamTactic(16, 16, 8, 4, ctas, res)
    G.grouped(x.transpose(0, 1), wp, out=out.transpose(0, 1), tactic=t)
    ref = torch.stack([_ref(x[:, i], packed[i], sf[i], gs[i]) for i in range(g)], dim=1)
    _assert_close(out, ref, f"grouped token-major M={m} {t}")


@pytest.mark.sm90
@pytest.mark.parametrize(("ctas", "res"), [(0, 0), (132, 0), (132, 8)])
def test_deterministic_and_graph_capturable(ctas: int, res: int) -> None:
    """The same bits on every run, eagerly and replayed from a CUDA graph."""
    n, k, m = 4096, 8192, 4
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    t = StreamTactic(16, 8, 16, 4, ctas, res)
    first = G.linear(a, wp, tactic=t)
    again = G.linear(a, wp, tactic=t)
    out = _poison((m, n))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.linear(a, wp, out=out, tactic=t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, again) and torch.equal(first, out)


MOE_CONFIGS = [
    (16, 8, 8, 4),
    (32, 8, 4, 4),
    (16, 16, 8, 2),
    (32, 32, 4, 2),
    (16, 8, 8, 2, 6),  # the persistent grid at N 256: 6 CTAs per expert tile, 16 blocks (3 / 2)
    (32, 8, 4, 4, 3),  # 3 CTAs per expert tile, 8 blocks (3 / 2)
    (16, 8, 8, 2, 6, 1),  # and resident activations (K 512: 1 K tile per warp),
    (16, 8, 4, 2, 6, 2),  # 2 slots per warp,
    (16, 8, 16, 2, 6, 1),  # warps 8-15 without a K tile
]


@pytest.mark.sm90
@pytest.mark.parametrize("cfg", MOE_CONFIGS, ids=[str(StreamTactic(*c)) for c in MOE_CONFIGS])
@pytest.mark.parametrize(
    "counts",
    [
        [1, 1, 0, 1, 1, 0, 1, 1],  # one decode token, top-6
        [3, 0, 17, 1, 0, 8, 33, 9],  # empty experts, tile edges of 8 / 16 / 32
        [0, 0, 0, 70, 0, 0, 0, 0],  # all rows on one expert: several tiles
    ],
    ids=["one_token", "mixed_empty", "all_on_one"],
)
def test_moe_offsets(cfg, counts: list[int]) -> None:
    wp, offs, a, ref = _moe_case(8, 256, 512, counts)
    out = _poison(ref.shape)
    G.moe(a, offs, wp, out=out, tactic=StreamTactic(*cfg))
    _assert_close(out, ref, f"moe {cfg} {counts}")
    if len(cfg) >= 5:  # the persistent grid: the bits of one CTA per row block
        base = _poison(ref.shape)
        G.moe(a, offs, wp, out=base, tactic=StreamTactic(*cfg[:4]))
        assert torch.equal(out, base), f"moe {cfg} {counts}: not the bits of one CTA per block"


@pytest.mark.sm90
def test_moe_rows_outside_the_offsets_are_not_written() -> None:
    """offs[0] > 0 and offs[E] < T: the rows before and after stay as they were."""
    wp, offs, a, ref = _moe_case(4, 128, 256, [2, 5, 0, 3])
    offs2 = offs + 3
    a2 = torch.cat([torch.randn(3, 256, device="cuda", dtype=torch.bfloat16), a,
                    torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)])  # fmt: skip
    out = _poison((a2.shape[0], 128))
    G.moe(a2, offs2, wp, out=out, tactic=StreamTactic(16, 8, 8, 4))
    assert out[:3].isnan().all() and out[-4:].isnan().all(), "rows outside the offsets written"
    _assert_close(out[3:-4], ref, "moe offset rows")


@pytest.mark.sm90
def test_moe_flash_routed_shapes() -> None:
    """DSv4-Flash routed w13 / w2 (256 experts, top-6) at 4 decode tokens."""
    for n, k in ((4096, 4096), (4096, 2048)):
        gen = torch.Generator().manual_seed(n + k)
        ids = torch.stack([torch.randperm(256, generator=gen)[:6] for _ in range(4)])
        counts = torch.bincount(ids.flatten(), minlength=256).tolist()
        wp, offs, a, ref = _moe_case(256, n, k, counts)
        out = _poison(ref.shape)
        for t in (StreamTactic(16, 8, 8, 4), StreamTactic(16, 8, 8, 2, 16)):
            out = _poison(ref.shape)
            G.moe(a, offs, wp, out=out, tactic=t)
            _assert_close(out, ref, f"routed {n}x{k} {t}")
