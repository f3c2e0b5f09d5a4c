"""SM100 native NVFP4 kernels: host-side logic on the CPU, compiles for sm_100a, GPU numerics.

CPU tests check the host side of `cutedsl.sm100` (`weight`, `layout`, the launchers of `gemm`)
against `cutedsl.reference` through `cutedsl.sm100.emulate`, the torch statement of the kernel
contracts on the exact buffers the launchers pass. GPU tests (marker sm100) run the kernels
themselves on an SM100 GPU and skip at collection elsewhere. Every test draws fresh random data
from the global RNG, which tests/conftest.py seeds per test and reports on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys

import cutlass.cute as cute
import pytest
import torch
from nvfp4_data import bf16, quantized

from cutedsl import formats, jit, reference
from cutedsl.sm100 import emulate, layout, weight
from cutedsl.sm100 import gemm as launchers
from cutedsl.sm100.kernels import gemm as gemm_kernels
from cutedsl.sm100.kernels import quant as quant_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's 1 - 2<x,y>/(|x|^2+|y|^2) in float64."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _weight(n: int, k: int, lead: tuple[int, ...] = ()):
    w = torch.randn(*lead, n, k) * 0.05
    return formats.quantize_nvfp4(w)  # packed, linear sf, global


def _act(shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def _input_scale(x: torch.Tensor) -> torch.Tensor:
    return formats.global_scale_from_amax(x.float().abs().amax()).reshape(1)


def _assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out is bf16 of an fp32 value equal to ref up to accumulation order: |d| <= bf16 ulp."""
    assert not torch.isnan(out.float()).any(), "output has NaN (an element was not written)"
    err = (out.float() - ref.float()).abs()
    tol = 2**-7 * ref.float().abs() + 1e-4 * ref.float().abs().max()
    bad = err > tol
    assert not bad.any(), f"max err {err.max():.3e} at {torch.nonzero(bad)[0].tolist()}"


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("rows,kb", [(128, 4), (256, 8), (384, 12)])
def test_blocked_scale_offset_matches_swizzle(rows: int, kb: int) -> None:
    sf = torch.randint(0, 255, (rows, kb), dtype=torch.uint8)
    blocked = formats.swizzle_scales(sf).reshape(-1)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(kb), indexing="ij")
    off = weight.blocked_scale_offset(r, c, kb)
    assert torch.equal(blocked[off], sf)
    assert off.unique().numel() == rows * kb  # a bijection onto the buffer


def test_group_scale_offsets_match_assemble_group_scales() -> None:
    """The quant kernel writes group g's scale (r, c) at g*padded_T*KB + blocked offset."""
    g, t, pt, kb = 3, 70, 128, 8
    sf = torch.randint(1, 255, (g, t, kb), dtype=torch.uint8)
    blocked = formats.assemble_group_scales(sf, pt).reshape(-1)
    gi, r, c = torch.meshgrid(torch.arange(g), torch.arange(t), torch.arange(kb), indexing="ij")
    off = gi * pt * kb + weight.blocked_scale_offset(r, c, kb)
    assert torch.equal(blocked[off], sf)


def test_oproj_layout_roundtrip() -> None:
    t, g, d = 5, 3, 64
    x = _act((t, g, d))
    pt = layout.oproj_padded_t(t)
    a = layout.oproj_to_groups(x, pt)
    assert a.shape == (g * pt, d)
    for gi in range(g):
        assert torch.equal(a[gi * pt : gi * pt + t], x[:, gi])
        assert not a[gi * pt + t : (gi + 1) * pt].any()
    back = layout.oproj_from_groups(a, t, g)
    assert torch.equal(back, x)
    out = torch.full((t, g, 16), float("nan"))
    view = layout.oproj_out_view(out)  # (T, R, G), what the epilogue writes
    assert view.shape == (t, 16, g) and view.stride(1) == 1
    view.copy_(torch.arange(t * 16 * g, dtype=torch.float32).reshape(t, 16, g))
    assert out[2, 1, 3] == view[2, 3, 1]


@pytest.mark.parametrize("t", [1, 7, 128, 129])
def test_expected_quant_places_groups_at_padded_offsets(t: int) -> None:
    g, d = 2, 128
    x = _act((t, g, d))
    gs = _input_scale(x)
    pt = layout.oproj_padded_t(t)
    q, sf = emulate.expected_quant(x, gs, pt)
    lin = formats.unswizzle_scales(sf, g * pt, d).reshape(g, pt, d // 16)
    for gi in range(g):
        q_ref, sf_ref, _ = formats.quantize_nvfp4_activation(x[:, gi].float(), gs.reshape(()))
        assert torch.equal(q[gi * pt : gi * pt + t], q_ref)
        assert torch.equal(lin[gi, :t].view(torch.uint8), sf_ref.view(torch.uint8))
        assert not q[gi * pt + t : (gi + 1) * pt].any()
        assert not lin[gi, t:].view(torch.uint8).any()


def test_interleave_w13_roundtrip() -> None:
    w = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    iw = weight.interleave_w13(w)
    assert torch.equal(iw[:, 0::2], w[:, :3]) and torch.equal(iw[:, 1::2], w[:, 3:])
    assert torch.equal(weight.deinterleave_w13(iw), w)


def test_prepare_weight_rejects_bad_shapes() -> None:
    p, s, _ = _weight(128, 256)
    with pytest.raises(ValueError, match="w_packed: N = 64"):
        weight.prepare_weight(p[:64], s[:64])
    with pytest.raises(ValueError, match="w_packed: K = 128"):
        weight.prepare_weight(p[:, :64], s[:, :8])
    with pytest.raises(ValueError, match="w_sf: shape"):
        weight.prepare_weight(p, s[:, :8])
    with pytest.raises(ValueError, match="w_packed: 256 rows, expected a multiple of groups=3"):
        weight.prepare_weight(torch.cat([p, p]), torch.cat([s, s]), groups=3)


def test_prepare_weight_groups() -> None:
    """[L, N, K//2] and its flat [L*N, K//2] with groups=L give the same `Weight`: the codes
    unchanged and contiguous, group l's scales blocked on their own at byte l*N*KB."""
    lg, n, k = 3, 128, 512
    p, s, _ = _weight(n, k, lead=(lg,))
    w3 = weight.prepare_weight(p, s)
    flat = weight.prepare_weight(p.reshape(lg * n, k // 2), s.reshape(lg * n, k // 16), groups=lg)
    for pw in (w3, flat):
        assert (pw.n, pw.k, pw.groups) == (n, k, lg)
        assert pw.w.shape == (lg * n, k // 2) and pw.w.is_contiguous()
        assert torch.equal(pw.w, p.reshape(lg * n, k // 2))
        assert pw.sf.dtype == torch.float8_e4m3fn and pw.sf.shape == (lg * n, k // 16)
        per_group = torch.cat([formats.swizzle_scales(s[li]).reshape(-1) for li in range(lg)])
        assert torch.equal(pw.sf.reshape(-1).view(torch.uint8), per_group.view(torch.uint8))
    one = weight.prepare_weight(p[0], s[0])
    assert (one.n, one.groups) == (n, 1) and torch.equal(one.sf, w3.sf[:n])


def test_package_imports_without_cutlass() -> None:
    """Everything of cutedsl.sm100 but the device kernels imports on a machine without cutlass."""
    code = (
        "import sys\n"
        "import cutedsl.sm100, cutedsl.sm100.weight, cutedsl.sm100.layout, cutedsl.sm100.emulate\n"
        "import cutedsl.sm100.gemm, cutedsl.sm100.runners, cutedsl.sm100.kernels\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'cuda'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


# --------------------------------------------------------------------------- pipelines vs reference


@pytest.mark.parametrize("m", [1, 7, 129])
def test_linear_host_path_vs_reference(m: int) -> None:
    n, k = 256, 512
    x = _act((m, k))
    wp, ws, wg = _weight(n, k)
    xs = _input_scale(x)
    pw = weight.prepare_weight(wp, ws)
    w, w_sf = pw.w, pw.sf
    pm = formats.round_up(m, 128)
    q, sf = emulate.expected_quant(x, xs, pm)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    alpha = (xs * wg).reshape(1)
    emulate.emulate_gemm(q, sf, w, w_sf, alpha, out[:, :, None], m_a=pm, k=k)
    ref = reference.nvfp4_linear_ref(x, wp, ws, wg, act="nvfp4", input_scale=xs.reshape(()))
    _assert_close_bf16(out, ref)


def test_linear_fused_swiglu_host_path_vs_reference() -> None:
    m, i, k, lim = 33, 128, 256, 10.0
    x = _act((m, k), scale=4.0)
    w13 = torch.randn(2 * i, k) * 0.2  # large enough that the clamp bites
    wp, ws, wg = formats.quantize_nvfp4(w13)
    xs = _input_scale(x)
    pw = weight.prepare_weight(weight.interleave_w13(wp), weight.interleave_w13(ws))
    w, w_sf = pw.w, pw.sf
    q, sf = emulate.expected_quant(x, xs, 128)
    out = torch.full((m, i), float("nan"), dtype=torch.bfloat16)
    emulate.emulate_gemm(
        q, sf, w, w_sf, (xs * wg).reshape(1), out[:, :, None], m_a=128, k=k, swiglu_limit=lim
    )
    h = reference.nvfp4_linear_ref(x, wp, ws, wg, act="nvfp4", input_scale=xs.reshape(()))
    assert (h[:, :i] > lim).any() and (h[:, i:].abs() > lim).any(), "clamp not exercised"
    ref = reference.swiglu_clamp_ref(h[:, :i], h[:, i:], lim)
    _assert_close_bf16(out, ref)


@pytest.mark.parametrize("t", [1, 50, 130])
def test_grouped_oproj_host_path_vs_reference(t: int) -> None:
    g, d, r = 4, 256, 128
    x = _act((t, g, d))
    wp, ws, wg = _weight(g * r, d)
    xs = _input_scale(x)
    pw = weight.prepare_weight(wp, ws)
    w, w_sf = pw.w, pw.sf
    pt = layout.oproj_padded_t(t)
    q, sf = emulate.expected_quant(x, xs, pt)
    out = torch.full((t, g, r), float("nan"), dtype=torch.bfloat16)
    alpha = (xs * wg).expand(g).contiguous()
    emulate.emulate_gemm(q, sf, w, w_sf, alpha, layout.oproj_out_view(out), m_a=pt, k=d)
    ref = reference.nvfp4_grouped_oproj_ref(x, wp, ws, wg, act="nvfp4", input_scale=xs.reshape(()))
    _assert_close_bf16(out, ref)


def _routing(m: int, topk: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e)[:topk] for _ in range(m)]).to(torch.int32)
    ids[ids == e - 1] = 0  # expert e-1 stays empty (may duplicate expert 0 in a row: allowed)
    if m > 2:
        ids[1, 0] = -1  # not a local expert
    w = torch.rand(m, topk)
    return ids, w


def test_moe_layout_segments() -> None:
    m, topk, e = 150, 3, 5
    ids, _ = _routing(m, topk, e)
    offs, dest = layout.moe_layout(ids, e)
    assert offs.dtype == torch.int32 and offs.shape == (e,)
    flat = ids.reshape(-1).tolist()
    start = 0
    for ex in range(e):
        mine = [j for j, v in enumerate(flat) if v == ex]
        end = int(offs[ex])
        assert (end - start) % 128 == 0 and end - start == formats.round_up(len(mine), 128)
        assert dest[mine].tolist() == list(range(start, start + len(mine)))
        start = end
    assert all(dest[j] == -1 for j, v in enumerate(flat) if v < 0)
    assert int(offs[-1]) <= layout.moe_max_rows(m, topk, e)
    assert int(offs[e - 1]) == int(offs[e - 2])  # the empty expert owns no rows


def test_moe_host_path_vs_reference() -> None:
    m, topk, e, hid, i, lim = 40, 2, 4, 256, 256, 10.0
    x = _act((m, hid), scale=2.0)
    ids, tw = _routing(m, topk, e)
    w13p, w13s, w13g = formats.quantize_nvfp4(
        torch.randn(e, 2 * i, hid) * 0.2, torch.rand(e) * 1e-3 + 1e-4
    )
    w2p, w2s, w2g = formats.quantize_nvfp4(
        torch.randn(e, hid, i) * 0.1, torch.rand(e) * 1e-3 + 1e-4
    )
    a13 = _input_scale(x)
    pw13 = weight.prepare_weight(weight.interleave_w13(w13p), weight.interleave_w13(w13s))
    w13, w13_sf = pw13.w, pw13.sf
    pw2 = weight.prepare_weight(w2p, w2s)
    w2, w2_sf = pw2.w, pw2.sf

    rows = layout.moe_max_rows(m, topk, e)
    offs, dest = layout.moe_layout(ids, e)
    a = layout.moe_gather(x, dest, topk, rows)
    q, sf = emulate.expected_quant(a, a13, rows)
    h = torch.zeros((rows, i), dtype=torch.bfloat16)
    emulate.emulate_gemm(
        q, sf, w13, w13_sf, a13 * w13g, h[:, :, None], m_a=rows, k=hid, offs=offs, swiglu_limit=lim
    )
    a2 = _input_scale(h)
    q2, sf2 = emulate.expected_quant(h, a2, rows)
    y = torch.full((rows, hid), float("nan"), dtype=torch.bfloat16)
    emulate.emulate_gemm(q2, sf2, w2, w2_sf, a2 * w2g, y[:, :, None], m_a=rows, k=i, offs=offs)
    routed = dest[dest >= 0].long()
    assert not y[routed].isnan().any()  # every row a token was routed to was written
    y = torch.nan_to_num(y)  # rows past offs[-1] are never written, by contract
    out = layout.moe_combine(y, dest, tw)

    ref = reference.nvfp4_moe_ref(
        x, ids, tw, w13p, w13s, w13g, w2p, w2s, w2g, lim, "nvfp4", a13.reshape(()), a2.reshape(())
    )
    # h is rounded to bf16 before its NVFP4 re-quantization (the reference quantizes fp32).
    assert _calc_diff(out, ref) < 2e-3, _calc_diff(out, ref)


# --------------------------------------------------------------------------- kernel layouts, traced


def _trace(fn):
    """Run fn inside a CuTeDSL trace on the CPU (no kernel, no GPU) and return its result; with
    static shapes, layouts evaluate to Python ints at trace time."""
    out = {}

    @cute.jit
    def probe():
        out["v"] = fn()

    cute.compile(probe, no_jit_engine=True)
    return out["v"]


def test_kernel_sf_layout_is_per_group_blocked() -> None:
    """The layout the GEMM builds for SFA/SFB (`sf_layout`) addresses scale (row, k//16, group)
    exactly where formats.assemble_group_scales / swizzle_scales put it."""
    rows, k, l = 256, 512, 3
    kb = k // 16
    sf = torch.randint(0, 255, (l, rows, kb), dtype=torch.uint8)
    blocked = formats.assemble_group_scales(sf, rows).reshape(-1)
    coords = torch.stack([torch.randint(0, n, (400,)) for n in (rows, k, l)], 1).tolist()
    offs = _trace(
        lambda: [cute.crd2idx(tuple(c), gemm_kernels.sf_layout(rows, k, l)) for c in coords]
    )
    for (r, kk, gi), off in zip(coords, offs):
        assert blocked[off] == sf[gi, r, kk // 16], (r, kk, gi)


def test_kernel_swiglu_output_view() -> None:
    """Accumulator (row, col) of tile (m, n, l) lands at output column n*64 + col//2 (interleaved
    w13), through the strided wo_a-style output (sc_m, 1, sc_l)."""
    m_c, n_out, l, sc_m, sc_l = 300, 256, 3, 4096, 256
    cases = [((5, 7), (1, 2, 2)), ((0, 6), (0, 3, 0)), ((127, 127), (2, 0, 1))]

    def probe():
        d = cute.zipped_divide(
            gemm_kernels.swiglu_acc_layout(m_c, n_out, l, sc_m, sc_l), (128, 128)
        )
        return [cute.crd2idx(c, d) for c in cases]

    for ((r, j), (mt, nt, li)), off in zip(cases, _trace(probe)):
        assert off == (mt * 128 + r) * sc_m + (nt * 64 + j // 2) + li * sc_l


# --------------------------------------------------------------------------- compile / cache


def test_compile_key_covers_codegen_args() -> None:
    """Every codegen argument value of the GEMM gives its own `cutedsl.jit` key, and the quant
    kernel's key differs from every GEMM key."""
    gemm_keys = {
        jit.cache_key(gemm_kernels.compile_gemm, gr, lim, tile_n)
        for gr in (False, True)
        for lim in (None, 10.0, 7.0)
        for tile_n in (128, 256)
    }
    assert len(gemm_keys) == 12
    assert jit.cache_key(quant_kernels.compile_quant) not in gemm_keys


def _record_compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Replace `cutedsl.jit.compiled` by a recorder of (build, args, kwargs) whose "kernel"
    records its launch arguments; returns the list of both kinds of records."""
    calls: list[tuple] = []

    def compiled(build, *args, **kwargs):
        calls.append((build, args, kwargs))
        return lambda *launch: calls.append(("launch", launch))

    monkeypatch.setattr(jit, "compiled", compiled)
    monkeypatch.setattr(launchers, "_stream", lambda: None)
    return calls


def test_precompile_covers_every_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`precompile(limit)` requests exactly the quant kernel and the four GEMM variants, with the
    codegen values passed positionally, and every launch of the runner steps uses one of them
    (so nothing compiles after warm-up)."""
    calls = _record_compiles(monkeypatch)
    lim = 7.5
    launchers.precompile(lim)
    warm = {(b, a) for b, a, kw in (c for c in calls if c[0] != "launch") if not kw}
    assert warm == {
        (quant_kernels.compile_quant, ()),
        *((gemm_kernels.compile_gemm, (gr, sl, 128)) for gr in (False, True) for sl in (None, lim)),
    }
    calls.clear()
    k, n, e, topk, m = 256, 256, 3, 2, 5
    x = bf16(m, k)
    wl = weight.prepare_weight(*quantized(n, k)[:2])
    wl13 = weight.prepare_weight(*quantized(2 * n, k)[:2])
    w13 = weight.prepare_weight(*quantized(e, 2 * n, k)[:2])
    w2 = weight.prepare_weight(*quantized(e, k, n)[:2])
    one, alpha = torch.ones(1), torch.ones(e)
    launchers.linear(x, wl, one, one)
    launchers.linear(x, wl13, one, one, swiglu_limit=lim, out=torch.empty(m, n, dtype=x.dtype))
    launchers.grouped(bf16(m, 1, k), wl, one, one)
    ids = torch.randint(0, e, (m, topk))
    launchers.moe(x, ids, torch.rand(m, topk), w13, w2, one, one, alpha, alpha, lim)
    used = {(b, a) for b, a, _ in (c for c in calls if c[0] != "launch")}
    assert len([c for c in calls if c[0] == "launch"]) == 10  # linear 2 x 2, grouped 2, moe 4
    assert used == warm


def test_can_implement_table() -> None:
    K, qc = gemm_kernels.Sm100Nvfp4GemmKernel, quant_kernels.can_implement
    assert K.can_implement(128, 5, 1536, 7168, grouped=False, swiglu=False)
    assert K.can_implement(4096, 4096, 4096, 2048, grouped=True, swiglu=True, e=384)
    assert not K.can_implement(128, 5, 1536, 7000, grouped=False, swiglu=False)  # K % 256
    assert not K.can_implement(128, 5, 1000, 7168, grouped=False, swiglu=False)  # N % 128
    assert not K.can_implement(128, 128, 256, 256, grouped=True, swiglu=False, e=1024)
    assert not K.can_implement(400_000, 400_000, 7168, 3072, grouped=True, swiglu=False, e=384)
    assert qc(5, 128, 4096, 8, 8 * 4096, 4096)
    assert not qc(5, 100, 4096, 8, 8 * 4096, 4096)  # padded_T % 128
    assert not qc(200, 128, 4096, 1, 4096, 4096)  # padded_T < T
    assert not qc(5, 128, 4000, 1, 4000, 4000)  # K % 64
    assert not qc(300_000, 300_032, 7168, 1, 7168, 7168)  # 32-bit offsets


@pytest.mark.slow
@pytest.mark.parametrize("module", ["cutedsl.sm100.kernels.gemm", "cutedsl.sm100.kernels.quant"])
def test_kernels_compile_for_sm100a(module: str) -> None:
    """Every target of the module compiles for sm_100a from fakes (no GPU) with its PTX/SASS."""
    only = {"gemm": "sm100.nvfp4_gemm", "quant": "sm100.quant"}[module.rsplit(".", 1)[1]]
    proc = subprocess.run(
        [sys.executable, "-m", "cutedsl.tools.check_kernels", "--only", only],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# --------------------------------------------------------------------------- GPU (SM100 only)


@pytest.mark.sm100
@pytest.mark.parametrize("t,g", [(1, 1), (7, 1), (129, 1), (50, 8)])
def test_quant_kernel_matches_formats(t: int, g: int) -> None:
    d = 512
    x = _act((t, g, d)).cuda()
    gs = _input_scale(x).cuda()
    pt = layout.oproj_padded_t(t)
    q = torch.full((g * pt, d // 2), 0xFF, dtype=torch.uint8, device="cuda")
    sf = torch.full((g * pt, d // 16), 0xFF, dtype=torch.uint8, device="cuda")
    launchers.quantize_act(x, gs, pt, q, sf)
    q_ref, sf_ref = emulate.expected_quant(x, gs, pt)
    assert torch.equal(sf, sf_ref.view(torch.uint8))
    assert torch.equal(q, q_ref)


@pytest.mark.sm100
@pytest.mark.parametrize("m", [1, 7, 127, 128, 129, 150])
@pytest.mark.parametrize("swiglu", [False, True])
def test_linear_kernel_vs_reference(m: int, swiglu: bool) -> None:
    n, k = 512, 1024
    x = _act((m, k)).cuda()
    wp, ws, wg = _weight(n, k)
    xs = _input_scale(x).cuda()
    if swiglu:
        pw = weight.prepare_weight(
            weight.interleave_w13(wp).cuda(), weight.interleave_w13(ws).cuda()
        )
    else:
        pw = weight.prepare_weight(wp.cuda(), ws.cuda())
    alpha = (xs * wg.cuda()).reshape(1)
    n_out = n // 2 if swiglu else n
    out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    launchers.linear(x, pw, xs, alpha, swiglu_limit=10.0 if swiglu else None, out=out)
    h = reference.nvfp4_linear_ref(
        x.cpu(), wp, ws, wg, act="nvfp4", input_scale=xs.cpu().reshape(())
    )
    ref = reference.swiglu_clamp_ref(h[:, : n // 2], h[:, n // 2 :], 10.0) if swiglu else h
    _assert_close_bf16(out.cpu(), ref)


@pytest.mark.sm100
@pytest.mark.parametrize("t", [1, 128, 300])
def test_grouped_oproj_kernel_vs_reference(t: int) -> None:
    g, d, r = 8, 512, 256
    x = _act((t, g, d)).cuda()
    wp, ws, wg = _weight(g * r, d)
    xs = _input_scale(x).cuda()
    pw = weight.prepare_weight(wp.cuda(), ws.cuda(), groups=g)
    out = torch.full((t, g, r), float("nan"), dtype=torch.bfloat16, device="cuda")
    alpha = (xs * wg.cuda()).expand(g).contiguous()
    launchers.grouped(x, pw, xs, alpha, out=out)
    ref = reference.nvfp4_grouped_oproj_ref(
        x.cpu(), wp, ws, wg, act="nvfp4", input_scale=xs.cpu().reshape(())
    )
    _assert_close_bf16(out.cpu(), ref)


@pytest.mark.sm100
def test_grouped_gemm_kernel_vs_emulation_any_routing() -> None:
    """One compile, several routings (incl. an empty expert and all tokens on one expert)."""
    e, n, k = 6, 256, 512
    wp, ws, _ = _weight(n, k, lead=(e,))
    pw = weight.prepare_weight(wp.cuda(), ws.cuda())
    w, w_sf = pw.w, pw.sf
    alpha = torch.rand(e, device="cuda") + 0.5
    for case, (m, topk) in enumerate([(37, 2), (1, 1), (300, 3)]):
        ids, _ = _routing(m, topk, e)
        if case == 1:
            ids[:] = 2
        x = _act((m, k)).cuda()
        rows = layout.moe_max_rows(m, topk, e)
        offs, dest = layout.moe_layout(ids.cuda(), e)
        a = layout.moe_gather(x, dest, topk, rows)
        gs = _input_scale(x).cuda()
        q = torch.empty((rows, k // 2), dtype=torch.uint8, device="cuda")
        sf = torch.empty((rows, k // 16), dtype=torch.uint8, device="cuda")
        launchers.quantize_act(a, gs, rows, q, sf)
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launchers.gemm(q, sf, w, w_sf, alpha, out[:, :, None], m_a=rows, k=k, offs=offs)
        exp = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        emulate.emulate_gemm(
            q.cpu(), sf.cpu(), w.cpu(), w_sf.cpu(), alpha.cpu(), exp[:, :, None],
            m_a=rows, k=k, offs=offs.cpu(),
        )  # fmt: skip
        used = int(offs[-1])
        _assert_close_bf16(out[:used].cpu(), exp[:used].float())


@pytest.mark.sm100
def test_moe_kernels_vs_reference() -> None:
    m, topk, e, hid, i, lim = 200, 6, 8, 512, 256, 10.0
    x = _act((m, hid), scale=2.0)
    ids, tw = _routing(m, topk, e)
    w13p, w13s, w13g = formats.quantize_nvfp4(
        torch.randn(e, 2 * i, hid) * 0.2, torch.rand(e) * 1e-3 + 1e-4
    )
    w2p, w2s, w2g = formats.quantize_nvfp4(
        torch.randn(e, hid, i) * 0.1, torch.rand(e) * 1e-3 + 1e-4
    )
    a13 = _input_scale(x)
    a2 = torch.tensor([0.02 / 448.0])  # a static calibration-like scale for the intermediate
    pw13 = weight.prepare_weight(
        weight.interleave_w13(w13p).cuda(), weight.interleave_w13(w13s).cuda()
    )
    pw2 = weight.prepare_weight(w2p.cuda(), w2s.cuda())
    out = launchers.moe(
        x.cuda(), ids.cuda(), tw.cuda(), pw13, pw2,
        a13.cuda(), a2.cuda(), (a13 * w13g).cuda(), (a2 * w2g).cuda(), lim,
    )  # fmt: skip
    ref = reference.nvfp4_moe_ref(
        x, ids, tw, w13p, w13s, w13g, w2p, w2s, w2g, lim, "nvfp4", a13.reshape(()), a2.reshape(())
    )
    assert not torch.isnan(out).any()
    # The intermediate is rounded to bf16 before its NVFP4 re-quantization (reference: fp32).
    assert _calc_diff(out.cpu(), ref) < 2e-3


@pytest.mark.sm100
def test_linear_cuda_graph_replay_with_new_data() -> None:
    """Warm up, capture, write new inputs into the same buffers, replay, compare."""
    m, n, k = 64, 256, 512
    wp, ws, wg = _weight(n, k)
    pw = weight.prepare_weight(wp.cuda(), ws.cuda())
    x = _act((m, k)).cuda()
    xs = torch.tensor([8.0 / 2688.0], device="cuda")  # static input_scale (amax 8)
    alpha = xs * wg.cuda()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launchers.precompile()
    launchers.linear(x, pw, xs, alpha, out=out)  # loads the cubin before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launchers.linear(x, pw, xs, alpha, out=out)
    x2 = _act((m, k))
    x.copy_(x2.cuda())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.nvfp4_linear_ref(x2, wp, ws, wg, act="nvfp4", input_scale=xs.cpu().reshape(()))
    _assert_close_bf16(out.cpu(), ref)


# --------------------------------------------------------------------------- launchers on the CPU


@pytest.mark.parametrize("m", [1, 129])
def test_linear_launcher_emulated(m: int) -> None:
    n, k = 256, 512
    x = _act((m, k))
    wp, ws, wg = _weight(n, k)
    xs = _input_scale(x)
    pw = weight.prepare_weight(wp, ws)
    out = launchers.linear(x, pw, xs, xs * wg, kernels=emulate.EMULATED)
    ref = reference.nvfp4_linear_ref(x, wp, ws, wg, act="nvfp4", input_scale=xs.reshape(()))
    _assert_close_bf16(out, ref)


def test_grouped_oproj_launcher_emulated() -> None:
    t, g, d, r = 70, 4, 256, 128
    x = _act((t, g, d))
    wp, ws, wg = _weight(g * r, d)
    xs = _input_scale(x)
    pw = weight.prepare_weight(wp, ws, groups=g)
    out = launchers.grouped(x, pw, xs, xs * wg, kernels=emulate.EMULATED)
    ref = reference.nvfp4_grouped_oproj_ref(x, wp, ws, wg, act="nvfp4", input_scale=xs.reshape(()))
    _assert_close_bf16(out, ref)


def test_moe_launcher_emulated() -> None:
    m, topk, e, hid, i, lim = 30, 2, 3, 256, 256, 10.0
    x = _act((m, hid), scale=2.0)
    ids, tw = _routing(m, topk, e)
    w13p, w13s, w13g = formats.quantize_nvfp4(
        torch.randn(e, 2 * i, hid) * 0.2, torch.rand(e) * 1e-3 + 1e-4
    )
    w2p, w2s, w2g = formats.quantize_nvfp4(
        torch.randn(e, hid, i) * 0.1, torch.rand(e) * 1e-3 + 1e-4
    )
    a13, a2 = _input_scale(x), torch.tensor([0.3 / 2688.0])
    pw13 = weight.prepare_weight(weight.interleave_w13(w13p), weight.interleave_w13(w13s))
    pw2 = weight.prepare_weight(w2p, w2s)
    out = launchers.moe(
        x, ids, tw, pw13, pw2, a13, a2, a13 * w13g, a2 * w2g, lim, kernels=emulate.EMULATED
    )
    ref = reference.nvfp4_moe_ref(
        x, ids, tw, w13p, w13s, w13g, w2p, w2s, w2g, lim, "nvfp4", a13.reshape(()), a2.reshape(())
    )
    assert _calc_diff(out, ref) < 2e-3, _calc_diff(out, ref)


def test_gemm_argument_packing(monkeypatch) -> None:
    """The compile-cache key and the runtime ints `gemm` hands the compiled kernel, per mode
    (no GPU: recorded)."""
    rec = _record_compiles(monkeypatch)
    k, n = 512, 256
    a = torch.zeros((3 * 128, k // 2), dtype=torch.uint8)
    sfa = torch.zeros((3 * 128, k // 16), dtype=torch.uint8)
    b = torch.zeros((3 * n, k // 2), dtype=torch.uint8)
    sfb = torch.zeros((3 * n, k // 16), dtype=torch.uint8)
    alpha = torch.ones(3)
    out = torch.zeros((70, 3, n), dtype=torch.bfloat16)  # wo_a: (T, G, R)
    launchers.gemm(a, sfa, b, sfb, alpha, layout.oproj_out_view(out), m_a=128, k=k)
    # (m_a, m_c, n, k, l, e, sc_m, sc_l)
    assert rec[-2] == (gemm_kernels.compile_gemm, (False, None, 128), {})
    assert rec[-1][1][7:15] == (128, 70, n, k, 3, 3, 3 * n, n)
    h = torch.zeros((384, n // 2), dtype=torch.bfloat16)
    offs = torch.tensor([128, 128, 384], dtype=torch.int32)
    launchers.gemm(a, sfa, b, sfb, alpha, h[:, :, None], m_a=384, k=k, offs=offs, swiglu_limit=10.0)
    assert rec[-2] == (gemm_kernels.compile_gemm, (True, 10.0, 128), {})
    assert rec[-1][1][7:15] == (384, 384, n, k, 1, 3, n // 2, 0)
    with pytest.raises(ValueError, match="out: N_out"):
        launchers.gemm(a, sfa, b, sfb, alpha, h[:, :, None], m_a=384, k=k, offs=offs)
