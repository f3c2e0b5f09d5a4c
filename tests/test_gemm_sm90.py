"""sm_90a NVFP4 W4A16 GEMM family (cutedsl/sm90/kernels/gemm.py; host side cutedsl/sm90/).

CPU: every variant compiles for sm_90a and shows wgmma/HGMMA; tactic and prep contracts.
GPU (sm90): kernel vs fp32 torch math on the same quantized operands (dequantized with
cutedsl.formats), fresh random data, outputs poisoned with NaN, edge cases and DSv4 shapes.
"""

from __future__ import annotations

import inspect
from dataclasses import astuple

import pytest
import torch
from nvfp4_data import assert_close as _assert_close
from nvfp4_data import moe_case as _moe_case
from nvfp4_data import poisoned as _poison
from nvfp4_data import rand_weight as _rand_weight
from nvfp4_data import ref_w4a16 as _ref

from cutedsl import formats, jit
from cutedsl.sm90 import gemm as G
from cutedsl.sm90 import tactics as TT
from cutedsl.sm90 import weight as W
from cutedsl.sm90.kernels import gemm as gemm_sm90
from cutedsl.sm90.tactics import GpuSpec, Tactic
from cutedsl.tools import check_kernels

H200 = GpuSpec("NVIDIA H200", 132)
H100 = GpuSpec("NVIDIA H100 80GB HBM3", 132)  # a table of decode rows (M <= 32)

TARGETS = gemm_sm90.check_targets()


# ------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_variant_compiles_for_sm90a_with_wgmma(target) -> None:
    r = check_kernels.run_target("cutedsl.sm90.kernels.gemm", target)
    assert r.ok, f"{target.name}: {r.error or 'missing ' + ', '.join(r.missing)}"


def test_check_targets_cover_every_variant() -> None:
    names = {t.name for t in TARGETS}
    assert any("moe_offs" in n for n in names) and any("splitk" in n for n in names)
    # both load paths: the producer warp (tile_m 16) and warp 0 (tile_m >= 64)
    assert {"sm90.w4a16_gemm.moe_offs.n128m16", "sm90.w4a16_gemm.moe_offs.n128m64"} <= names
    assert all(t.arch == "sm_90a" and "HGMMA" in "".join(t.sass_patterns) for t in TARGETS)


@pytest.mark.parametrize(
    ("n", "k", "tile_n", "split_k", "ok"),
    [
        (4096, 8192, 128, 1, True),
        (1536, 4096, 128, 4, True),
        (1536, 4096, 64, 64, True),
        (1000, 4096, 64, 1, False),  # N not a multiple of the tile
        (4096, 4000, 64, 1, False),  # K not a multiple of 64
        (4096, 4096, 64, 3, False),  # K tiles (64) not divisible by split_k
    ],
)
def test_can_implement(n: int, k: int, tile_n: int, split_k: int, ok: bool) -> None:
    assert gemm_sm90.Sm90Nvfp4W4A16GemmKernel.can_implement(n, k, tile_n, split_k) is ok


@pytest.mark.parametrize(
    ("tile_m", "split_k", "moe"),
    [(16, 16, False), (16, 3, False), (32, 32, False), (64, 2, True)],
    ids=["over-cluster-size", "not-dividing-tile", "not-dividing-fragment", "moe"],
)
def test_split_k_limits_are_refused(tile_m: int, split_k: int, moe: bool) -> None:
    """A split-K cluster has at most 8 CTAs, each reducing an equal share of every thread's
    tile_m/2 accumulators; the MoE never splits."""
    with pytest.raises(ValueError, match="split"):
        gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=64, tile_m=tile_m, split_k=split_k, moe=moe)


@pytest.mark.parametrize(
    ("tile_m", "split_k", "moe"),
    [(16, 2, False), (24, 1, True), (24, 1, False)],
    ids=["split-slice-not-16", "moe-tile-not-16", "tile-not-16"],
)
def test_staged_epilogue_limits(tile_m: int, split_k: int, moe: bool) -> None:
    """The staged epilogue works for tiles whose (split-K: per-CTA) token slice is a multiple of
    16 and fits the ring, and is refused elsewhere; it is the default there up to 2 splits."""
    K = gemm_sm90.Sm90Nvfp4W4A16GemmKernel
    for tn, tm, sk in ((128, 256, 1), (64, 16, 1), (128, 256, 2), (128, 32, 2)):
        assert K(tile_n=tn, tile_m=tm, split_k=sk).staged_epilogue, (tn, tm, sk)
    for tn, tm, sk in ((128, 128, 8), (64, 256, 4)):  # possible, not the default
        assert not K(tile_n=tn, tile_m=tm, split_k=sk).staged_epilogue, (tn, tm, sk)
        assert K(tile_n=tn, tile_m=tm, split_k=sk, staged_epilogue=True).staged_epilogue
    # 128x128x2: its 5-stage ring (80 KiB) has no room for the 64 staged token rows beside the
    # 64 KiB parked fp32 tile, so it keeps the register stores
    assert not K(tile_n=128, tile_m=128, split_k=2).staged_epilogue
    with pytest.raises(ValueError, match="beside the parked fp32 tile"):
        K(tile_n=128, tile_m=128, split_k=2, staged_epilogue=True)
    assert K(tile_n=128, tile_m=16, moe=True).staged_epilogue
    assert not K(tile_n=64, tile_m=tile_m, split_k=split_k, moe=moe).staged_epilogue
    with pytest.raises(ValueError, match="staged epilogue"):
        K(tile_n=64, tile_m=tile_m, split_k=split_k, moe=moe, staged_epilogue=True)
    assert not K(tile_n=128, tile_m=64, stages=2).staged_epilogue  # 64 rows of 272 B > 16 KiB
    with pytest.raises(ValueError, match="room in the ring for 64 token rows of 272 B"):
        K(tile_n=128, tile_m=64, stages=2, staged_epilogue=True)


# (tile_n, tile_m) -> stages: two CTAs per SM where registers allow it and >= 4 stages remain
# (measured on the H200, 2026-12-03), else the deepest ring that fits (<= 8)
STAGES = {
    (64, 16): 8, (64, 32): 8, (64, 64): 8, (64, 128): 6, (64, 256): 6,
    (128, 16): 8, (128, 32): 8, (128, 64): 8, (128, 128): 5, (128, 256): 6,
    (64, 192): 4, (128, 192): 7,
}  # fmt: skip
SM_SMEM = 233472  # sm_90: 228 KiB of shared memory per SM, 1 KiB of it reserved per CTA


@pytest.mark.parametrize(
    ("tile", "stages"), STAGES.items(), ids=[f"n{t[0]}m{t[1]}" for t in STAGES]
)
def test_stage_count_fits_and_pairs_ctas(tile: tuple[int, int], stages: int) -> None:
    """The ring depth of each tile, and that it fits: one CTA's shared memory always, two CTAs
    per SM where the depth was chosen for two (tile_n 64, or tile_m <= 128, below 8 stages)."""
    tn, tm = tile
    k = gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=tn, tile_m=tm)
    assert k.stages == stages
    smem = stages * (tm * 128 + tn * 32 + tn * 4) + 1024 + 8 * 2 * stages  # ring, align, mbar
    assert smem <= gemm_sm90.SMEM_CAPACITY
    if (tn == 64 or tm <= 128) and 2 * (smem + 1024) <= SM_SMEM:
        assert stages == 8 or 2 * (smem + 1024 + tm * 128 + tn * 36) > SM_SMEM  # deepest pair
    if (tn, tm) in ((128, 128), (64, 128), (64, 64), (128, 64)):
        assert 2 * (smem + 1024) <= SM_SMEM  # these do pair up


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"producer": False, "k_per_stage": 2}, "needs the producer warp"),
        ({"k_per_stage": 3}, "k_per_stage must be 1 or 2"),
        ({"stages": 3, "k_per_stage": 2}, "split 3 stages"),
        ({"stages": 2, "k_per_stage": 2}, "into >= 2"),
    ],
)
def test_k_per_stage_limits_are_refused(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=64, tile_m=16, **kw)


@pytest.mark.parametrize("tile", list(STAGES), ids=[f"n{t[0]}m{t[1]}" for t in STAGES])
def test_producer_warp_default(tile: tuple[int, int]) -> None:
    """The decode tiles (tile_m 16; 64x32) get a producer warp, and 128x16 two K tiles per
    barrier stage; the others neither: 128x32 (74 registers) and the prefill tiles would lose a
    CTA per SM to the extra warp."""
    tn, tm = tile
    k = gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=tn, tile_m=tm)
    assert k.producer == (tm == 16 or (tn, tm) == (64, 32))
    assert k.kps == (2 if (tn, tm) == (128, 16) else 1) and k.stages % k.kps == 0
    assert k.consumers == 2 * tn
    assert k.threads == k.consumers + (32 if k.producer else 0)


def test_choose_tactic_splits_fit_a_cluster() -> None:
    assert TT.MAX_SPLIT_K == gemm_sm90.MAX_SPLIT_K  # the host copy of the kernel's cluster limit
    for m in (1, 7, 16, 33, 64, 100, 200, 256, 1000, 5000):
        for n, k in ((1536, 4096), (32768, 1024), (4096, 8192), (512, 512), (2048, 1024)):
            tn, tm, sk = astuple(TT.choose_tactic(m, n, k, 1, spec=H200))
            gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=tn, tile_m=tm, split_k=sk)  # accepted
            assert gemm_sm90.Sm90Nvfp4W4A16GemmKernel.can_implement(n, k, tn, sk)


def test_choose_tactic_rule_decode_splits_k_and_prefill_takes_big_tiles() -> None:
    """The rule, on shapes the measured table does not hold."""
    assert (2048, 4096, 1) not in TT.tuned_table(H200)
    tn, tm, sk = astuple(TT.choose_tactic(1, 2048, 4096, 1, spec=H200))
    assert (tn, tm) == (64, 16) and sk > 1  # 32 CTAs: split K
    assert TT.choose_tactic(16384, 2048, 8192, 1, spec=H200) == Tactic(128, 256, 1)
    assert TT.choose_tactic(16, 32768 + 128, 1024, 1, spec=H200) == Tactic(
        128, 16, 1
    )  # a full grid: no split
    assert TT.choose_tactic(100, 32768 + 128, 1024, 1, spec=H200) == Tactic(128, 128, 1)
    assert TT.choose_tactic(100, 2048, 4096, 1, spec=H200) == Tactic(
        128, 64, 4
    )  # 32 CTAs: up to one wave
    assert TT.choose_tactic(200, 2048, 8192, 1, spec=H200) == Tactic(128, 128, 4)
    assert TT.choose_tactic(100, 4096, 8192, 256, moe=True, spec=H200) == Tactic(
        128, 128, 1
    )  # the MoE never splits
    assert TT.choose_tactic(1, 256 * 64, 4096, 1, moe=True, spec=H200).split_k == 1
    assert TT.launch_tactic(64 * 6, 4096, 4096, 256, True, H200) == Tactic(
        128, 16, 1
    )  # the 12-03 sweep
    assert TT.launch_tactic(6, 4096, 4096, 256, True, H200) == Tactic(
        64, 16, 1
    )  # 192 CTAs of 128 rows
    assert TT.launch_tactic(24, 4096, 4096, 256, True, H200) == Tactic(128, 16, 1)
    # MoE prefill: 192-token tiles above 128 (H200 2026-12-04 sweep: 1.17-1.18x over 256)
    assert TT.launch_tactic(4096 * 6, 4096, 4096, 256, True, H200) == Tactic(128, 192, 1)
    assert TT.launch_tactic(16384 * 6, 4096, 2048, 256, True, H200) == Tactic(128, 192, 1)
    assert TT.launch_tactic(1024 * 6, 4096, 4096, 256, True, H200) == Tactic(128, 64, 1)
    assert TT.launch_tactic(4096, 4096, 4096, 8, True, H200) == Tactic(
        64, 192, 1
    )  # few experts: 64 rows


def test_moe_tile_bound_covers_every_routing() -> None:
    """The MoE grid (`moe_tile_bound`) holds every expert's m tiles on random, decode-like
    (one or two rows per expert), one-hot and tile-aligned routings, and is reached by some."""
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    reached = False
    for e in (1, 8, 256, 384):
        for tm in TT.TILE_M_VERIFIED:
            for counts in (
                torch.randint(0, 3 * tm, (e,), generator=gen),
                torch.randint(0, 3, (e,), generator=gen),
                torch.nn.functional.one_hot(torch.tensor(e // 2), e) * (5 * tm + 3),
                torch.full((e,), tm),
            ):
                rows = int(counts.sum())
                tiles = int(((counts + tm - 1) // tm).sum())
                bound = TT.moe_tile_bound(rows, e, tm)
                assert tiles <= bound, (e, tm, counts.tolist())
                assert gemm_sm90.moe_grid_y(rows, e, tm) == bound  # the kernel's own copy
                reached |= tiles == bound
    assert reached


def test_moe_grid_limit_is_refused() -> None:
    """A routed launch whose tile bound exceeds grid.y is refused on the host, naming `a`."""
    wp = W.prepare_weight(*_rand_weight(4, 128, 64, dev="cpu"))
    a = torch.empty(1, 16 * 70000, 64, dtype=torch.bfloat16)
    offs = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="grid limit 65535"):
        G._launch(
            a, wp, torch.empty(1, a.shape[1], 128, dtype=torch.bfloat16), offs, Tactic(128, 16, 1)
        )


@pytest.mark.parametrize("spec", [H200, H100], ids=lambda s: s.name)
def test_choose_tactic_takes_the_measured_table(spec: GpuSpec) -> None:
    """Table shapes take the fastest measured tactic of the smallest measured M >= m (the rule
    beyond the largest), and every entry is a tactic its kernel takes for its shape (a streaming
    entry: a configuration the streaming kernel takes, with the tokens of its M)."""
    table = TT.tuned_table(spec)
    assert (1536, 4096, 1) in table and (1024, 4096, 8) in table  # fused_wqa_wkv, wo_a (G = 8)
    for (n, k, g), entries in table.items():
        prev = 0
        for m_max, tactic in entries:
            for m in {prev + 1, (prev + 1 + m_max) // 2, m_max}:
                assert TT.choose_tactic(m, n, k, g, spec=spec) == tactic, (n, k, g, m)
            prev = m_max
            if isinstance(tactic, TT.StreamTactic):
                from cutedsl.sm90.kernels.stream import Sm90Nvfp4StreamGemmKernel as S

                assert S.config_error(*astuple(tactic)) is None and tactic.tokens >= m_max
                assert S.can_implement(n, k, tactic.rows)
                continue
            tn, tm, sk = astuple(tactic)
            gemm_sm90.Sm90Nvfp4W4A16GemmKernel(tile_n=tn, tile_m=tm, split_k=sk)
            assert gemm_sm90.Sm90Nvfp4W4A16GemmKernel.can_implement(n, k, tn, sk)
            assert tm in TT.TILE_M_VERIFIED
        # beyond the largest measured M: the rule, as on a GPU without a table
        m = prev + 1
        assert TT.choose_tactic(m, n, k, g, spec=spec) == TT.choose_tactic(
            m, n, k, g, spec=GpuSpec("a GPU without a table", spec.num_sms)
        ), (n, k, g, m)


def test_the_h200_table_and_the_rule_elsewhere() -> None:
    assert TT.choose_tactic(4096, 1536, 4096, 1, spec=H200) == Tactic(
        128, 192, 1
    )  # measured (2026-12-04)
    assert TT.choose_tactic(4097, 1536, 4096, 1, spec=H200) == Tactic(
        128, 256, 1
    )  # beyond the table: the rule
    assert TT.choose_tactic(128, 1024, 4096, 8, spec=H200) == Tactic(
        64, 128, 2
    )  # measured (the rule: 128x64x1)
    # another GPU (no table of its name), or this name with another SM count: the rule
    for other in (
        GpuSpec("NVIDIA H800", 132),
        GpuSpec("NVIDIA H200", 114),
        GpuSpec(H100.name, 114),
    ):
        assert TT.tuned_table(other) == {}
    assert TT.choose_tactic(128, 1024, 4096, 8, spec=GpuSpec("NVIDIA H200", 114)) == Tactic(
        128, 64, 1
    )


def _special_scales(shape: tuple, gen: torch.Generator, dev: str = "cpu") -> torch.Tensor:
    """e4m3 codes covering every magnitude 0x00..0x7E (subnormals, zero, the largest), half of
    them negative (as a checkpoint never has, but the encoding must keep exact)."""
    mag = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32) << 7
    return (mag | sign).to(torch.uint8).to(dev).view(torch.float8_e4m3fn)


def test_encoding_decodes_exactly_to_the_nvfp4_weight() -> None:
    """The sm90 weight encoding and the host model of the kernel's register decode (same bit
    operations as device_utils) give back exactly formats.dequantize_nvfp4 of the original:
    every e2m1 code, every e4m3 scale magnitude (subnormals and 0 included), negative scales."""
    gen = torch.Generator().manual_seed(7)
    groups, n, k = 3, 64, 512
    packed = torch.randint(0, 256, (groups, n, k // 2), generator=gen, dtype=torch.uint8)
    sf = _special_scales((groups, n, k // 16), gen)
    gs = torch.rand(groups, generator=gen) + 0.5
    wp = W.prepare_weight(packed.reshape(groups * n, -1), sf.reshape(groups * n, -1), gs,
                                groups=groups)  # fmt: skip
    assert wp.w.shape == (groups, n, k // 2) and wp.w.dtype == torch.uint8
    assert wp.sf.shape == (groups, k // 64, n) and wp.sf.dtype == torch.int32
    want = formats.dequantize_nvfp4(packed, sf, 1.0, torch.float32)
    got = W.decode_emulated(wp)
    assert torch.equal(got, want), f"{int((got != want).sum())} weights decode differently"
    assert torch.equal(W.dequantize_prepared(wp), want * gs[:, None, None])


def test_encoding_does_not_depend_on_the_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder works in chunks of rows: chunks of 80 rows (a last partial chunk, groups
    straddling chunks) give the same bytes and scale words as one chunk."""
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    groups, n, k = 3, 192, 256
    packed = torch.randint(0, 256, (groups, n, k // 2), generator=gen, dtype=torch.uint8)
    sf = _special_scales((groups, n, k // 16), gen)
    whole = W.prepare_weight(packed, sf, 1.0)
    monkeypatch.setattr(W, "_ROWS_PER_CHUNK", 80)
    parts = W.prepare_weight(packed, sf, 1.0)
    assert torch.equal(parts.w, whole.w) and torch.equal(parts.sf, whole.sf)


def test_two_scale_images_per_word_match_one_per_word() -> None:
    """The kernel's `e5m3x4_to_bf16x2x2` (prmt selectors 0x4140 / 0x4342 with the 0x07 bytes, then
    << 4, as its PTX text says) gives, in each half, the single-scale image the host model
    (`weight.decode_emulated`: selectors 0x4040..0x4343, << 4) builds for the same code: codes 0,
    1 and 2, 3, low half first, for random scale words and every code in every byte."""
    import re

    from cutedsl.sm90.kernels import decode

    src = inspect.getsource(decode.e5m3x4_to_bf16x2x2)
    assert re.findall(r"prmt\.b32 t, \$\d, k, (0x[0-9a-f]+)", src) == ["0x4140", "0x4342"]
    src = inspect.getsource(W.decode_emulated)
    assert "(0x4040, 0x4141, 0x4242, 0x4343)" in src
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    s = torch.cat([torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64),
                   torch.arange(256, dtype=torch.int64) * 0x01010101])  # fmt: skip
    k = torch.full_like(s, W.SCALE_HI * 0x01010101)
    one = [(W._prmt(s, k, sel) << 4) & 0xFFFFFFFF for sel in (0x4040, 0x4141, 0x4242, 0x4343)]
    two = [(W._prmt(s, k, sel) << 4) & 0xFFFFFFFF for sel in (0x4140, 0x4342)]
    for q in range(2):
        assert torch.equal(two[q] & 0xFFFF, one[2 * q] & 0xFFFF)
        assert torch.equal(two[q] >> 16, one[2 * q + 1] & 0xFFFF)


def test_encoding_places_each_lanes_fragment() -> None:
    """Word (c, q) of a row's 64-wide K tile holds exactly the 8 K positions the PTX wgmma
    register-A layout gives lane c (k = 16j + 8h + 2c + e, j = 2q, 2q+1): decoding a weight whose
    only nonzero element is at k finds it in that word."""
    n, k = 64, 128
    for kk in range(k):
        packed = torch.zeros(n, k // 2, dtype=torch.uint8)
        packed[5, kk // 2] = 0x2 << (4 * (kk % 2))  # e2m1 1.0 at (row 5, kk)
        sf = torch.full((n, k // 16), 1.0).to(torch.float8_e4m3fn)
        wp = W.prepare_weight(packed, sf, 1.0)
        words = wp.w[0, 5].reshape(k // 64, 4, 2, 4)  # [t, c, q, byte]
        t, j, c = kk // 64, (kk % 64) // 16, (kk % 8) // 2
        nz = words.nonzero().tolist()
        assert len(nz) == 1 and nz[0][:3] == [t, c, j // 2], (kk, nz)
        assert W.decode_emulated(wp)[0, 5, kk] == 1.0 and W.decode_emulated(wp).sum() == 1.0


def test_prepare_errors() -> None:
    n, k = 128, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sf = (torch.rand(n, k // 16) + 0.1).to(torch.float8_e4m3fn)
    wp = W.prepare_weight(packed, sf, torch.tensor(0.5))
    assert wp.gs.tolist() == [0.5]
    g = W.prepare_weight(packed, sf, 1.0, groups=2)
    assert g.groups == 2 and g.n == 64 and torch.equal(g.w[1], wp.w[0, 64:])
    with pytest.raises(ValueError, match="b_sf: shape"):
        W.prepare_weight(packed, sf[:, :-1], 1.0)
    with pytest.raises(ValueError, match="N=96"):
        W.prepare_weight(packed[:96], sf[:96], 1.0)
    bad = sf.clone().view(torch.uint8)
    bad[3, 2] = 0xFF
    with pytest.raises(ValueError, match=r"NaN block scale .* \[0, 3, 2\]"):
        W.prepare_weight(packed, bad.view(torch.float8_e4m3fn), 1.0)


def test_swiglu_row_order_pairs_gate_and_up_in_each_fragment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`swiglu_row_order`: a permutation whose 16-row groups hold gate 8b..8b+7 then up
    8b..8b+7, so wgmma fragment rows lane/4 and lane/4 + 8 of a warp are gate and up of one
    output column; `interleave_swiglu` of a prepared w13 equals preparing the reordered
    checkpoint rows (bytes and scale words), per group, and decodes to the reordered weight."""
    i = 48
    order = W.swiglu_row_order(2 * i)
    assert sorted(order.tolist()) == list(range(2 * i))
    for b in range(i // 8):
        for r in range(8):
            assert order[16 * b + r] == 8 * b + r and order[16 * b + 8 + r] == i + 8 * b + r
    with pytest.raises(ValueError, match="2I with I a multiple of 8"):
        W.swiglu_row_order(72)
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    groups, n, k = 3, 128, 256
    packed = torch.randint(0, 256, (groups, n, k // 2), generator=gen, dtype=torch.uint8)
    sf = _special_scales((groups, n, k // 16), gen)
    gs = torch.rand(groups, generator=gen) + 0.5
    order = W.swiglu_row_order(n)
    want = W.prepare_weight(packed[:, order], sf[:, order], gs)
    wp = W.prepare_weight(packed, sf, gs)
    plain = W.dequantize_prepared(wp)
    got = W.interleave_swiglu(wp)
    assert torch.equal(got.w, want.w) and torch.equal(got.sf, want.sf)
    assert torch.equal(W.dequantize_prepared(got), plain[:, order])
    # a group at a time and two groups at a time (a last partial chunk): the same
    for chunk in (1, 2 * (n * k // 2 + 4 * n * k // 64)):
        monkeypatch.setattr(W, "_REORDER_CHUNK_BYTES", chunk)
        got = W.interleave_swiglu(W.prepare_weight(packed, sf, gs))
        assert torch.equal(got.w, want.w) and torch.equal(got.sf, want.sf), chunk


def test_fused_swiglu_limits_are_refused() -> None:
    """The fused SwiGLU needs an unsplit tile with the staged epilogue and a positive limit (or
    none); it halves the tile's output columns and their staging pitch."""
    K = gemm_sm90.Sm90Nvfp4W4A16GemmKernel
    k = K(tile_n=128, tile_m=16, moe=True, swiglu=True, swiglu_limit=10.0)
    assert k.out_cols == 64 and k.pitch == 144 and k.staged_epilogue
    assert K(tile_n=64, tile_m=32, moe=True, swiglu=True).swiglu_limit is None
    with pytest.raises(ValueError, match="unsplit tile with the staged epilogue"):
        K(tile_n=64, tile_m=16, split_k=2, swiglu=True)
    with pytest.raises(ValueError, match="unsplit tile with the staged epilogue"):
        K(tile_n=128, tile_m=24, moe=True, swiglu=True)
    with pytest.raises(ValueError, match="unsplit tile with the staged epilogue"):
        K(tile_n=128, tile_m=16, moe=True, swiglu=True, staged_epilogue=False)
    for lim, kw in ((10.0, {}), (0.0, {"swiglu": True}), (-1.0, {"swiglu": True})):
        with pytest.raises(ValueError, match=f"swiglu_limit {lim}"):
            K(tile_n=128, tile_m=16, moe=True, swiglu_limit=lim, **kw)


# ------------------------------------------------------------------------------------- GPU


DENSE = [  # (name, N, K)
    ("small", 256, 512),
    ("odd_k_tiles", 256, 320),
    ("one_k_tile", 128, 64),
    ("flash.fused_wqa_wkv", 1536, 4096),
    ("flash.wq_b", 32768, 1024),
    ("flash.wo_b", 4096, 8192),
    ("pro.shared_w13", 6144, 7168),
    ("pro.shared_w2", 7168, 3072),
]


@pytest.mark.sm90
@pytest.mark.parametrize("m", [0, 1, 7, 127, 129, 300])
def test_dense_edge_m(m: int) -> None:
    n, k = 256, 512
    packed, sf, gs = _rand_weight(1, n, k)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, n))
    G.linear(a, W.prepare_weight(packed[0], sf[0], gs[0]), out=out)
    _assert_close(out, _ref(a, packed[0], sf[0], gs[0]), f"dense M={m}")


@pytest.mark.sm90
@pytest.mark.parametrize(("name", "n", "k"), DENSE, ids=[d[0] for d in DENSE])
@pytest.mark.parametrize("m", [1, 32, 129, 1024])
def test_dense_dsv4_shapes(name: str, n: int, k: int, m: int) -> None:
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, n))
    G.linear(a, wp, out=out)
    _assert_close(out, _ref(a, packed[0], sf[0], gs[0]), f"{name} M={m}")


TACTICS = [
    (64, 16, 1),
    (64, 16, 4),
    (128, 32, 2),
    (64, 64, 1),
    (128, 128, 1),
    (128, 256, 1),
    (64, 256, 1),
    (128, 128, 8),
    (64, 128, 2),
    (64, 16, 8),  # split-K clusters of 8, 4 and 2 CTAs on every tile_n / token tile
    (128, 16, 8),
    (128, 64, 4),
    (64, 256, 8),
    (128, 256, 2),
    (128, 192, 1),  # 192 tokens: two full waves of 128x192 tiles on fused_wqa_wkv at M = 4096
    (128, 192, 2),
    (64, 192, 4),
]


@pytest.mark.parametrize("tile_m", [8, 24])
def test_unverified_token_tiles_are_refused(tile_m: int) -> None:
    """Regression: on the H200 (2026-12-02) tile_m 8 gave wrong results and tile_m 24 aborted the
    process inside cute.compile; a forced tactic with such a tile must raise, not compile."""
    packed, sf, gs = _rand_weight(1, 512, 1024, dev="cpu")
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.zeros(3, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"tile_m {tile_m} not in"):
        G.linear(a, wp, tactic=Tactic(64, tile_m, 1))


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", [(64, 16, 8), (128, 16, 1), (64, 32, 2), (128, 128, 1)])
def test_linear_reads_a_column_slice_in_place(tactic) -> None:
    """A column slice of a wider tensor as `a` (row stride K + 64): the same bits as its
    contiguous copy, at decode and prefill tactics (split-K and unsplit)."""
    n, k, m = 512, 1024, 37
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed[0], sf[0], gs)
    wide = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)
    a = wide[:, 32 : 32 + k]
    got, want = _poison((m, n)), _poison((m, n))
    G.linear(a, wp, out=got, tactic=Tactic(*tactic))
    G.linear(a.contiguous(), wp, out=want, tactic=Tactic(*tactic))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"tactic {tactic}"
    _assert_close(got, _ref(a, packed[0], sf[0], gs[0]), f"column slice, tactic {tactic}")


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", [(64, 16, 1), (64, 16, 4), (128, 256, 1)])
def test_dense_special_scales(tactic) -> None:
    """Every e4m3 scale magnitude (subnormals, 0, 448) and negative scales, on the device."""
    n, k, m = 256, 1024, 40
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    sf = _special_scales((n, k // 16), gen, "cuda")
    gs = torch.tensor(1e-3, device="cuda")
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, n))
    G.linear(a, wp, out=out, tactic=Tactic(*tactic))
    _assert_close(out, _ref(a, packed, sf, gs), f"special scales, tactic {tactic}")


@pytest.mark.sm90
def test_split_k_is_deterministic() -> None:
    """Split-K partials are summed in a fixed order: two calls give bit-identical outputs."""
    n, k, m = 1536, 4096, 3
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed[0], sf[0], gs[0])
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert TT.launch_tactic(m, n, k, 1, False, H200).split_k > 1
    outs = [G.linear(a, wp) for _ in range(5)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    _assert_close(outs[0], _ref(a, packed[0], sf[0], gs[0]), "split-K")


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", TACTICS, ids=[f"n{t[0]}m{t[1]}k{t[2]}" for t in TACTICS])
def test_dense_every_tactic(tactic) -> None:
    n, k, m = 512, 1024, 77
    packed, sf, gs = _rand_weight(1, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, n))
    G.linear(a, wp, out=out, tactic=Tactic(*tactic))
    _assert_close(out, _ref(a, packed[0], sf[0], gs[0]), f"tactic {tactic}")


STAGED = [
    (128, 256, 1),
    (64, 16, 1),
    (128, 128, 1),
    (64, 128, 1),
    (64, 256, 1),
    (128, 32, 1),
    (128, 256, 2),  # split-K: each CTA of the cluster stages its token slice
    (128, 128, 8),
    (128, 32, 2),
    (64, 256, 8),
    (128, 64, 4),
    (128, 192, 1),
    (128, 192, 2),
]


@pytest.mark.sm90
@pytest.mark.parametrize("tile", STAGED, ids=[f"n{t[0]}m{t[1]}k{t[2]}" for t in STAGED])
def test_staged_epilogue_matches_register_stores(tile) -> None:
    """The staged epilogue (stmatrix + 16-byte stores) writes exactly what the register epilogue
    writes, bit for bit, on grouped operands with a token tail in every group; with split-K the
    sums are the same rank-ordered ones."""
    from cutedsl.sm90.kernels.gemm import compile_kernel

    tn, tm, sk = tile
    g, n, k, m = 2, 512, 1024, 3 * tm // 2 + 5
    packed, sf, gs = _rand_weight(g, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
    outs = []
    for staged in (True, False):
        fn = compile_kernel(tn, tm, sk, False, staged_epilogue=staged)
        out = _poison((g, m, n))
        fn(*G.kernel_operands(a, wp, out))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"tile {tile}: staged and register epilogues differ"
    for i in range(g):
        _assert_close(outs[0][i], _ref(a[i], packed[i], sf[i], gs[i]), f"tile {tile} group {i}")


@pytest.mark.sm90
def test_dense_from_quantize_nvfp4() -> None:
    """Operands produced by the real quantizer (shared checkpoint convention)."""
    n, k, m = 1536, 4096, 33
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    packed, sf, gs = formats.quantize_nvfp4(w)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = _poison((m, n))
    G.linear(a, W.prepare_weight(packed, sf, gs), out=out)
    _assert_close(out, _ref(a, packed, sf, gs), "quantize_nvfp4 weights")


GROUPED = [("flash.wo_a", 8, 1024, 4096), ("pro.wo_a", 16, 1024, 4096), ("small", 3, 128, 256)]


@pytest.mark.sm90
@pytest.mark.parametrize(("name", "g", "r", "d"), GROUPED, ids=[x[0] for x in GROUPED])
@pytest.mark.parametrize("m", [0, 1, 127, 129])
def test_grouped_equal_groups(name: str, g: int, r: int, d: int, m: int) -> None:
    packed, sf, gs = _rand_weight(g, r, d)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.randn(g, m, d, device="cuda", dtype=torch.bfloat16)
    out = _poison((g, m, r))
    G.grouped(a, wp, out=out)
    ref = torch.stack([_ref(a[i], packed[i], sf[i], gs[i]) for i in range(g)])
    _assert_close(out, ref, f"{name} M={m}")


@pytest.mark.sm90
@pytest.mark.parametrize("m", [1, 4, 33, 300])
@pytest.mark.parametrize(
    "tactic", [None, (64, 16, 4), (128, 256, 2)], ids=["default", "splitk4", "m256k2"]
)
def test_grouped_token_major_views(m: int, tactic) -> None:
    """wo_a's operands as the model holds them: a [T, G, D] input and a [T, G, R] output, passed
    as transposed views (token stride G*D, group stride D): every output element written, equal
    bit for bit to the launch on contiguous per-group copies, and to the reference."""
    g, r, d = 8, 1024, 4096
    packed, sf, gs = _rand_weight(g, r, d)
    wp = W.prepare_weight(packed, sf, gs)
    x = torch.randn(m, g, d, device="cuda", dtype=torch.bfloat16)
    t = None if tactic is None else TT.Tactic(*tactic)
    out = _poison((m, g, r))
    G.grouped(x.transpose(0, 1), wp, out=out.transpose(0, 1), tactic=t)
    want = G.grouped(x.transpose(0, 1).contiguous(), wp, out=_poison((g, m, r)), tactic=t)
    assert not out.isnan().any(), "an output element was not written"
    assert torch.equal(out, want.transpose(0, 1))
    ref = torch.stack([_ref(x[:, i], packed[i], sf[i], gs[i]) for i in range(g)], dim=1)
    _assert_close(out, ref, f"token-major M={m}")


def test_grouped_refuses_operands_the_kernel_cannot_address() -> None:
    """A K stride other than 1, a token stride not a multiple of 8 elements or a start off 16
    bytes is refused by name before any launch (CPU tensors: nothing runs)."""
    packed, sf, gs = _rand_weight(2, 64, 128, dev="cpu")
    wp = W.prepare_weight(packed, sf, gs)
    buf = torch.zeros(4, 2, 136, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a: strides"):
        G.grouped(torch.zeros(2, 128, 4, dtype=torch.bfloat16).transpose(1, 2), wp)
    with pytest.raises(ValueError, match="a: strides"):
        G.grouped(torch.zeros(4, 2, 130, dtype=torch.bfloat16)[..., :128].transpose(0, 1), wp)
    with pytest.raises(ValueError, match="a: strides"):
        G.grouped(buf[..., 1:129].transpose(0, 1), wp)
    with pytest.raises(ValueError, match="out: strides"):
        G.grouped(
            buf[..., :128].transpose(0, 1), wp, out=torch.zeros(2, 64, 4).bfloat16().transpose(1, 2)
        )


def test_linear_refuses_rows_the_kernel_cannot_address() -> None:
    """linear() reads a row-strided `a` in place and refuses, by name, a K stride other than 1,
    a row stride not a positive multiple of 8 and a start off 16 bytes (CPU: nothing runs)."""
    packed, sf, gs = _rand_weight(1, 64, 128, dev="cpu")
    wp = W.prepare_weight(packed[0], sf[0], gs)
    wide = torch.zeros(4, 136, dtype=torch.bfloat16)
    assert G.rows_addressable(wide[:, 8:]) and G.rows_addressable(wide)
    for bad in (torch.zeros(128, 4, dtype=torch.bfloat16).T, wide[:, 1:129],
                torch.zeros(4, 130, dtype=torch.bfloat16)[:, :128],
                torch.zeros(1, 128, dtype=torch.bfloat16).expand(4, 128)):  # fmt: skip
        assert not G.rows_addressable(bad)
        with pytest.raises(ValueError, match="a: strides"):
            G.linear(bad, wp)


MEASURED = [
    (n, k, g, m_max, tactic)
    for (n, k, g), entries in TT.tuned_table(H200).items()
    for m_max, tactic in entries
]


@pytest.mark.sm90
@pytest.mark.parametrize(
    ("n", "k", "g", "m_max", "tactic"),
    MEASURED,
    ids=[f"n{n}k{k}g{g}-m{m}-{t}" for n, k, g, m, t in MEASURED],
)
def test_every_measured_tactic(n: int, k: int, g: int, m_max: int, tactic: tuple) -> None:
    """Each entry of the measured tactic table on its own shape, through the default launch
    path (the table picks it), at an odd row count in its M range: the sweep that chose these
    timed them but did not check their values."""
    m = max(1, m_max - 1)
    assert TT.choose_tactic(m, n, k, g, spec=H200) == tactic
    packed, sf, gs = _rand_weight(g, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    if g == 1:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = _poison((m, n))
        G.linear(a, wp, out=out)
        ref = _ref(a, packed[0], sf[0], gs[0])
    else:
        a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
        out = _poison((g, m, n))
        G.grouped(a, wp, out=out)
        ref = torch.stack([_ref(a[i], packed[i], sf[i], gs[i]) for i in range(g)])
    _assert_close(out, ref, f"N={n} K={k} G={g} M={m} tactic {tactic}")


@pytest.mark.sm90
@pytest.mark.parametrize(
    "counts",
    [
        [3, 0, 129, 1, 0, 64, 127, 7],  # empty experts, tile edges
        [0, 0, 0, 300, 0, 0, 0, 0],  # all tokens on one expert
        [1, 1, 1, 1, 1, 1, 1, 1],
        [0, 5, 2000, 0, 0, 0, 0, 1],  # hot expert: many m tiles of one expert
    ],
    ids=["mixed_empty", "all_on_one", "one_each", "hot_expert"],
)
def test_moe_offsets(counts: list[int]) -> None:
    wp, offs, a, ref = _moe_case(8, 256, 512, counts)
    out = _poison(ref.shape)
    G.moe(a, offs, wp, out=out)
    _assert_close(out, ref, f"moe {counts}")


MOE_TACTICS = [(128, 16, 1), (64, 32, 1), (128, 64, 1), (128, 128, 1), (128, 256, 1),
               (64, 16, 1), (128, 32, 1), (128, 192, 1), (64, 192, 1)]  # fmt: skip


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", MOE_TACTICS, ids=[f"n{t[0]}m{t[1]}" for t in MOE_TACTICS])
def test_moe_every_tile(tactic) -> None:
    """Every token tile the MoE heuristic can pick, on empty experts, partial tiles and an expert
    spanning several m tiles."""
    wp, offs, a, ref = _moe_case(6, 256, 512, [0, 40, 1, 0, 300, 17])
    out = _poison(ref.shape)
    G.moe(a, offs, wp, out=out, tactic=Tactic(*tactic))
    _assert_close(out, ref, f"moe tactic {tactic}")


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", MOE_TACTICS, ids=[f"n{t[0]}m{t[1]}" for t in MOE_TACTICS])
def test_moe_staged_epilogue_matches_register_stores(tactic) -> None:
    """The MoE's staged epilogue writes exactly what the register epilogue writes, on experts
    spanning several m tiles."""
    from cutedsl.sm90.kernels.gemm import compile_kernel

    tn, tm, _ = tactic
    wp, offs, a, ref = _moe_case(6, 256, 512, [0, 3 * tm + 5, 1, 0, 300, 17])
    outs = []
    for staged in (True, False):
        fn = compile_kernel(tn, tm, 1, True, staged_epilogue=staged)
        out = _poison(ref.shape)
        fn(*G.kernel_operands(a.unsqueeze(0), wp, out.unsqueeze(0), offs))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"moe tactic {tactic}: staged and register differ"
    _assert_close(outs[0], ref, f"moe staged tactic {tactic}")


@pytest.mark.sm90
@pytest.mark.parametrize("limit", [10.0, None], ids=["limit10", "nolimit"])
@pytest.mark.parametrize("tactic", MOE_TACTICS, ids=[f"n{t[0]}m{t[1]}" for t in MOE_TACTICS])
def test_moe_fused_swiglu_equals_gemm_then_swiglu_kernel(tactic, limit) -> None:
    """The w13 GEMM with the fused SwiGLU epilogue (w13 in `swiglu_row_order`) writes exactly the
    bits of the unfused GEMM followed by the SwiGLU kernel, on empty experts, partial tiles and an
    expert over several m tiles; rows outside the experts stay unwritten; h is scaled so that
    the clamp at the limit is reached."""
    from cutedsl.sm90 import swiglu as sw

    tn, tm, _ = tactic
    i, k = 256, 512
    counts = [0, 3 * tm + 5, 1, 0, 300, 17]
    packed, sf, gs = _rand_weight(len(counts), 2 * i, k)
    gs = gs * 4  # |h| spread over ~0..30: the clamps bite, the SiLU sees every range
    t = sum(counts) + 7  # 7 rows past the experts: never written
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    tac = Tactic(*tactic)
    h = _poison((t, 2 * i))
    G.moe(a, offs, W.prepare_weight(packed, sf, gs), out=h, tactic=tac)
    want = _poison((t, i))
    rows = int(offs[-1])
    sw.swiglu_clamp(h[:rows], limit, want[:rows])
    wp = W.interleave_swiglu(W.prepare_weight(packed, sf, gs))
    got = _poison((t, i))
    G.moe(a, offs, wp, out=got, tactic=tac, swiglu=True, swiglu_limit=limit)
    assert got[rows:].isnan().all(), "rows past the experts were written"
    assert not got[:rows].isnan().any(), "a routed row was not written"
    if limit is not None:
        assert (h[:rows, :i].float() > limit).any() and (h[:rows, i:].float().abs() > limit).any()
    diff = got[:rows].view(torch.int16) != want[:rows].view(torch.int16)
    assert not diff.any(), (
        f"tactic {tactic}: {int(diff.sum())} of {diff.numel()} outputs differ, first at "
        f"{diff.nonzero()[0].tolist()}"
    )


# (tile_n, tile_m, split_k, moe, K, stages): decode tiles that have the producer warp (and, on
# 128x16, two K tiles per barrier stage) by default and tiles that do not (128x32, prefill) forced
# to, so the load paths meet on each; K gives every split an odd K tile count (the last barrier
# stage holds one tile); 128x128's 5-stage ring cannot pair, so it runs with 4
PRODUCER = [
    (64, 16, 8, False, 1536, None),
    (128, 16, 1, False, 2112, None),
    (64, 32, 4, False, 768, None),
    (128, 32, 2, False, 2176, None),
    (128, 128, 1, False, 2112, 4),
    (128, 16, 1, True, 1088, None),
    (64, 16, 1, True, 1088, None),
]
LOAD_PATHS = [(True, 2), (True, 1), (False, 1)]  # (producer warp, K tiles per barrier stage)


@pytest.mark.sm90
@pytest.mark.parametrize(
    "tile", PRODUCER, ids=[f"n{t[0]}m{t[1]}k{t[2]}{'moe' if t[3] else ''}" for t in PRODUCER]
)
def test_load_paths_match(tile) -> None:
    """The producer warp with two or one K tiles per barrier stage and warp 0's loads write the
    same bits (dense: grouped operands with a token tail; MoE: empty experts, partial tiles, an
    expert over several m tiles), which match the reference."""
    from cutedsl.sm90.kernels.gemm import compile_kernel

    tn, tm, sk, moe, k, stages = tile
    if moe:
        wp, offs, a, ref = _moe_case(6, 256, k, [0, 3 * tm + 5, 1, 0, 300, 17])
        a, shape = a.unsqueeze(0), (1, *ref.shape)
    else:
        g, n, m = 2, 512, 3 * tm // 2 + 5
        packed, sf, gs = _rand_weight(g, n, k)
        wp, offs, shape = W.prepare_weight(packed, sf, gs), None, (g, m, n)
        a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
    outs = []
    for producer, kps in LOAD_PATHS:
        fn = compile_kernel(tn, tm, sk, moe, producer=producer, k_per_stage=kps, stages=stages)
        out = _poison(shape)
        fn(*G.kernel_operands(a, wp, out, offs))
        outs.append(out)
    for path, out in zip(LOAD_PATHS[1:], outs[1:], strict=True):
        assert torch.equal(outs[0], out), f"tile {tile}: load paths {LOAD_PATHS[0]}, {path} differ"
    if moe:
        _assert_close(outs[0][0], ref, f"moe tile {tile}")
    else:
        for i in range(g):
            _assert_close(outs[0][i], _ref(a[i], packed[i], sf[i], gs[i]), f"tile {tile} {i}")


@pytest.mark.sm90
@pytest.mark.parametrize("tactic", [(64, 16, 1), (128, 16, 1), (128, 64, 1)])
def test_moe_tile_schedule(tactic) -> None:
    """The in-kernel tile schedule (`_moe_tile`) on more experts than threads (each thread counts
    the tiles of several experts), mostly one- and two-row experts (decode), one hot expert, and 37
    non-local rows past offs[E], which must stay unwritten."""
    e, n, k, extra = 300, 128, 256, 37
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    counts = torch.randint(0, 3, (e,), generator=g)
    counts[int(torch.randint(0, e, (1,), generator=g))] = 150
    wp, offs, a, ref = _moe_case(e, n, k, counts.tolist())
    a = torch.cat([a, torch.randn(extra, k, device="cuda", dtype=torch.bfloat16)])
    out = _poison((a.shape[0], n))
    G.moe(a, offs, wp, out=out, tactic=Tactic(*tactic))
    _assert_close(out[: ref.shape[0]], ref, f"moe schedule tactic {tactic}")
    assert out[ref.shape[0] :].isnan().all(), "rows past offs[E] were written"


@pytest.mark.sm90
def test_moe_one_compile_serves_every_routing() -> None:
    """Two routings and two token counts reuse one compiled kernel (no second compile)."""
    compiles = None
    for counts in ([5, 0, 9, 2], [0, 40, 0, 1], [0, 0, 0, 0]):
        wp, offs, a, ref = _moe_case(4, 128, 256, counts)
        out = _poison(ref.shape)
        G.moe(a, offs, wp, out=out, tactic=Tactic(64, 16, 1))
        _assert_close(out, ref, f"moe {counts}")
        if compiles is None:
            compiles = jit.compile_count()
    assert jit.compile_count() == compiles


MOE_SHAPES = [
    ("flash.w13", 256, 4096, 4096),
    ("flash.w2", 256, 4096, 2048),
    ("pro.w13", 384, 6144, 7168),
    ("pro.w2", 384, 7168, 3072),
]


@pytest.mark.sm90
@pytest.mark.parametrize(("name", "e", "n", "k"), MOE_SHAPES, ids=[x[0] for x in MOE_SHAPES])
def test_moe_dsv4_shapes(name: str, e: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    counts = torch.zeros(e, dtype=torch.int64)
    active = torch.randperm(e, generator=g)[:12]
    counts[active] = torch.randint(0, 70, (12,), generator=g)
    wp, offs, a, ref = _moe_case(e, n, k, counts.tolist())
    out = _poison(ref.shape)
    G.moe(a, offs, wp, out=out)
    _assert_close(out, ref, name)


@pytest.mark.sm90
def test_cuda_graph_capture_replay_moe() -> None:
    """Capture once, write new routing/data into the same buffers, replay, compare."""
    e, n, k, t = 8, 256, 512, 96
    packed, sf, gs = _rand_weight(e, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    a = torch.empty(t, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)

    def fill(counts):
        a.copy_(torch.randn(t, k, device="cuda", dtype=torch.bfloat16))
        offs.copy_(torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32))
        out.fill_(float("nan"))

    fill([t] + [0] * (e - 1))
    G.moe(a, offs, wp, out=out, tactic=Tactic(64, 16, 1))  # warm-up (compile + load)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.moe(a, offs, wp, out=out, tactic=Tactic(64, 16, 1))
    for counts in ([10, 0, 30, 0, 6, 50, 0, 0], [0] * 7 + [t]):
        fill(counts)
        graph.replay()
        torch.cuda.synchronize()
        o = offs.tolist()
        ref = torch.cat([_ref(a[o[i] : o[i + 1]], packed[i], sf[i], gs[i]) for i in range(e)])
        _assert_close(out, ref, f"graph replay {counts}")
