"""The sm90 backend glue of each runner (weight prep, group/expert layouts, routing, clamp,
combine, workspaces) on the CPU, with the kernel launch replaced by a torch statement of its
contract on the exact buffers the launchers pass, against the W4A16 torch references. The kernels
themselves run in tests/test_gemm_sm90.py and tests/test_runners_gpu.py on an SM90 GPU.

Every impl is warmed up first; its workspace buffers are then poisoned with 0xFF bytes (NaN for
bf16/fp32), and each call runs with `Workspace.reserve` forbidden (a hot-path reservation would
be an allocation), twice, on fresh data."""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import assert_close_to_ref, bf16, fresh_gen, quantized, sm90_launch_emulator
from nvfp4_data import no_reserve as _no_reserve
from nvfp4_data import warm_and_poison as _warm

from cutedsl import reference, validate, workspace
from cutedsl.grouped_oproj import Nvfp4GroupedOproj
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE
from cutedsl.shared_mlp import Nvfp4SharedMlp
from cutedsl.sm90 import gemm, routing, swiglu, tactics
from cutedsl.sm90 import runners as sm90_runners
from cutedsl.workspace import Workspace, WorkspaceError

LIMIT = 10.0
H200 = tactics.GpuSpec("NVIDIA H200", 132)


@pytest.fixture
def emulated_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemm._launch` as torch: out3[l] = a3[l] · dequant(wp[l])ᵀ (dense / groups), or per expert
    rows [offs[e], offs[e+1]) of a3[0] (MoE); rows outside the experts are left untouched.
    `gemm.precompile` does not compile; tactics are chosen for an H200; the shared workspaces
    start empty."""
    monkeypatch.setattr(workspace, "_SHARED", {})
    monkeypatch.setattr(gemm, "precompile", lambda *args, **kwargs: None)
    monkeypatch.setattr(gemm, "_launch", sm90_launch_emulator())
    monkeypatch.setattr(sm90_runners, "gpu_spec", lambda device: H200)


def test_linear(emulated_launch, monkeypatch) -> None:
    g = fresh_gen()
    n, k = 128, 4096  # decode M: the heuristic splits K (in the kernel: no scratch)
    r = Nvfp4Linear(*(wq := quantized(n, k, gen=g)), backend="reference")
    impl = sm90_runners.Linear(r)
    assert tactics.launch_tactic(9, n, k, 1, False, H200).split_k > 1
    impl.warmup(16)
    for m in (9, 16, 40):  # a linear reserves nothing: more rows than warmed up still run
        x = bf16(m, k, gen=g)
        with _no_reserve(monkeypatch):
            got = impl(x)
        assert_close_to_ref(got, reference.nvfp4_linear_ref(x, *wq))
    assert not workspace._SHARED and not any(isinstance(v, Workspace) for v in vars(impl).values())


def test_linear_reads_column_slices_in_place(emulated_launch, monkeypatch, caplog) -> None:
    """A column slice of a wider tensor (row stride a multiple of 8) goes to the kernel as it is
    (no copy); a transposed input, a row stride not a multiple of 8 and a (1, K) tensor with odd
    strides are copied first, each runner kind warning once per stride order; every result
    equals the reference (the linear and the shared MLP's first GEMM)."""
    monkeypatch.setattr(validate, "_COPY_WARNED", set())
    g = fresh_gen()
    n, k = 128, 256
    wq = quantized(n, k, gen=g)
    impl = sm90_runners.Linear(Nvfp4Linear(*wq, backend="reference"))
    w13, w2 = quantized(2 * 64, k, gen=g, scale=0.5), quantized(k, 64, gen=g, scale=0.3)
    mlp = sm90_runners.SharedMlp(Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT,
                                                backend="reference"))  # fmt: skip
    mlp.warmup(8)
    seen = []
    launch = gemm._launch
    monkeypatch.setattr(gemm, "_launch", lambda a3, *rest: (seen.append(a3), launch(a3, *rest))[1])
    wide = bf16(5, k + 24, gen=g)
    cases = [
        (wide[:, 16 : 16 + k], True),  # column slice: row stride k + 24
        (bf16(k, 5, gen=g).T, False),  # transposed
        (bf16(5, k + 4, gen=g)[:, :k], False),  # row stride k + 4
        (bf16(k, 1, gen=g).T, False),  # (1, K) with strides (1, 1)
    ]
    for x, in_place in cases:
        caplog.clear()
        got = impl(x)
        assert (seen[-1].data_ptr() == x.data_ptr()) is in_place, x.stride()
        assert_close_to_ref(got, reference.nvfp4_linear_ref(x, *wq))
        got = mlp(x)
        assert (seen[-2].data_ptr() == x.data_ptr()) is in_place, x.stride()
        assert_close_to_ref(got, reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT))
        warned = [r.getMessage() for r in caplog.records if "copied on every call" in r.message]
        if in_place or x.stride() == (1, 1):  # (1, 1): the stride order of (k + 4, 1) again
            assert not warned
        else:
            assert [w.split(":")[0] for w in warned] == ["cutedsl sm90 linear input",
                                                          "cutedsl sm90 shared MLP input"]  # fmt: skip
            assert str(tuple(x.stride())) in warned[0]


def test_grouped_oproj(emulated_launch, monkeypatch) -> None:
    """The token-major [T, G, D] input and the [T, G, R] result go to the kernel as transposed
    views (no copy, no workspace): more rows than warmed up still run."""
    g = fresh_gen()
    grp, d, rr = 4, 128, 64
    wq = quantized(grp * rr, d, gen=g)
    r = Nvfp4GroupedOproj(*wq, n_groups=grp, backend="reference")
    impl = sm90_runners.GroupedOproj(r)
    impl.warmup(8)
    seen = []
    launch = gemm._launch
    monkeypatch.setattr(
        gemm,
        "_launch",
        lambda a3, wp, o3, *rest: (seen.append((a3, o3)), launch(a3, wp, o3, *rest)),
    )
    for tt in (5, 8, 9):
        x = bf16(tt, grp, d, gen=g)
        with _no_reserve(monkeypatch):
            got = impl(x)
        assert_close_to_ref(got, reference.nvfp4_grouped_oproj_ref(x, *wq))
        a3, o3 = seen[-1]
        assert a3.data_ptr() == x.data_ptr() and o3.data_ptr() == got.data_ptr()
    assert not workspace._SHARED and not any(isinstance(v, Workspace) for v in vars(impl).values())


def test_grouped_oproj_run_rotates_into_the_workspace(emulated_launch, monkeypatch) -> None:
    """The GPU backends' run(): inverse RoPE written into the "main" workspace (no allocation but
    the result), then the impl; equals the reference backend's run() on the same o."""
    g = fresh_gen()
    grp, rr, nh, hd = 2, 64, 4, 128  # D = NH·hd/G = 256
    wq = quantized(grp * rr, nh * hd // grp, gen=g)
    ref = Nvfp4GroupedOproj(*wq, n_groups=grp, backend="reference")
    r = Nvfp4GroupedOproj(*wq, n_groups=grp, head_dim=hd, backend="reference")
    r.backend, r._impl = "sm90", sm90_runners.GroupedOproj(r)  # the sm90 glue, emulated
    r.warmup(8)
    for ws in (workspace.for_role(torch.device("cpu"), "main"),):
        for b in ws._bufs.values():
            b.fill_(0xFF)
    theta = torch.rand(50, 32, generator=g) * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], dim=-1)
    for t in (3, 8):
        o, pos = bf16(t, nh, hd, gen=g), torch.randint(0, 50, (t,), generator=g)
        with _no_reserve(monkeypatch):
            got = r.run(o, pos, cache)
        want = ref.run(o, pos, cache)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    with pytest.raises(WorkspaceError, match="rope"):
        r.run(bf16(9, nh, hd, gen=g), torch.zeros(9, dtype=torch.long), cache)


def test_inverse_rope_into_matches_the_reference() -> None:
    from cutedsl.grouped_oproj import inverse_rope_into

    g = fresh_gen()
    t, nh, hd = 7, 3, 128
    o, pos = bf16(t, nh, hd, gen=g), torch.randint(0, 40, (t,), generator=g)
    theta = torch.rand(40, 32, generator=g) * 6.28
    cache = torch.cat([theta.cos(), theta.sin()], dim=-1)
    ws = Workspace("cpu")
    for name, shape in (("rope.cs", (t, 64)), ("rope.e", (t, nh, 32)), ("rope.o", (t, nh, 32)),
                        ("rope.y", (t, nh, 32))):  # fmt: skip
        ws.reserve(name, shape, torch.float32)
    out = torch.full_like(o, float("nan"))
    inverse_rope_into(out, o, pos, cache, ws)
    want = reference.inverse_rope_ref(o, pos, cache)
    assert torch.equal(out[..., :-64], o[..., :-64])  # the nope part passes through
    # fp32 math as the reference; a fused multiply-add may round the last fp32 bit differently
    torch.testing.assert_close(out.float(), want.float(), rtol=8e-3, atol=1e-6)


def test_shared_mlp(emulated_launch, monkeypatch) -> None:
    g = fresh_gen()
    h, i = 128, 64
    w13, w2 = quantized(2 * i, h, gen=g), quantized(h, i, gen=g, scale=0.3)
    r = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    impl = sm90_runners.SharedMlp(r)
    _warm(impl, 6)
    assert set(workspace._SHARED) == {(torch.device("cpu"), "shared")}  # not "main"
    for m in (6, 3):
        x = bf16(m, h, gen=g, scale=3.0)
        with _no_reserve(monkeypatch):
            got = impl(x)
        assert_close_to_ref(got, reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT))
    with pytest.raises(WorkspaceError, match=r"shared/h: needs .* reserved"):
        impl(bf16(7, h, gen=g))


def test_swiglu_chunks_match_out_of_place(monkeypatch) -> None:
    """The in-place, chunked SwiGLU equals the fp32 out-of-place formula bit for bit."""
    g = fresh_gen()
    hh = bf16(37, 2 * 48, gen=g, scale=8.0)
    gate, up = hh[:, :48].float(), hh[:, 48:].float()
    want = (torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)).bfloat16()
    tmp = torch.full((2, 8, 48), float("nan"))
    got = swiglu.swiglu_clamp_bf16(hh, LIMIT, torch.full_like(want, float("nan")), tmp)
    assert torch.equal(got, want)
    empty = swiglu.swiglu_clamp_bf16(hh[:0], LIMIT)  # no rows: no scratch chunks to walk
    assert empty.shape == (0, 48) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("fused", [False, True], ids=["swiglu_kernel", "fused_swiglu"])
@pytest.mark.parametrize("case", ["random", "one_expert", "not_local"])
def test_moe(emulated_launch, monkeypatch, case: str, fused: bool) -> None:
    """The routed experts against the reference, with the SwiGLU as its own kernel or fused into
    the w13 GEMM (w13 in the fused order; the emulated launch pairs gate and up by that order)."""
    g = fresh_gen()
    e, h, i, k, max_m = 5, 128, 64, 3, 11
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.5), quantized(e, h, i, gen=g, scale=0.3)
    r = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    monkeypatch.setenv(sm90_runners.FUSED_SWIGLU_ENV, "1" if fused else "0")
    impl = sm90_runners.MoE(r)
    assert impl.fused is fused
    monkeypatch.setattr(sm90_runners, "CHUNK", 8)  # several SwiGLU / combine chunks
    _warm(impl, max_m)
    for m in (max_m, 4):
        x = bf16(m, h, gen=g, scale=2.0)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
        if case == "one_expert":
            ids[:, 0], ids[:, 1:] = 4, -1
        elif case == "not_local":
            ids[::2, 1:] = -1
        tw = torch.rand(m, k, generator=g)
        out = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
        with _no_reserve(monkeypatch):
            impl(x, ids, tw, out)
        assert_close_to_ref(out, reference.nvfp4_moe_ref(x, ids, tw, *w13, *w2, LIMIT))
    m = max_m + 1
    ids = torch.zeros(m, k, dtype=torch.int32)
    with pytest.raises(WorkspaceError, match=r"main/moe\.out: needs .* reserved"):
        impl(bf16(m, h, gen=g), ids, torch.rand(m, k), torch.empty(m, h, dtype=torch.bfloat16))


def test_route_into_workspace_matches_fresh() -> None:
    """route() with a reserved (poisoned) workspace returns the same (offs, tok, inv) as without,
    for int32 and int64 ids; the CPU order is stable (assignment order inside an expert)."""

    g = fresh_gen()
    e, m, k = 6, 17, 4
    ids = torch.randint(-1, e, (m, k), generator=g).int()
    ws = Workspace("cpu", "t")
    routing.route_reserve(ws, 2 * m * k, e)
    for b in ws._bufs.values():
        b.fill_(0xFF)
    want = routing.route(ids, e)
    for got in (routing.route(ids, e, ws), routing.route(ids.long(), e, ws)):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, e)
    order = torch.sort(key, stable=True).indices
    assert torch.equal(want[1].long(), order // k)
    counts = torch.bincount(key, minlength=e + 1)
    assert want[0].tolist() == [0, *torch.cumsum(counts[:e], 0).tolist()]
    row = torch.empty_like(order)
    row[order] = torch.arange(m * k)
    assert torch.equal(want[2].T.reshape(-1).long(), torch.where(flat >= 0, row, -1))


def test_moe_strided_operands(emulated_launch, monkeypatch, caplog) -> None:
    """int64 ids, non-contiguous topk_weights and a non-contiguous `out`: the copies go through
    the reserved workspace ("route.ids", "moe.w", "moe.out"), the result is unchanged, and the
    output copy is logged once."""
    monkeypatch.setattr(validate, "_COPY_WARNED", set())
    g = fresh_gen()
    e, h, i, k, m = 4, 128, 64, 2, 5
    w13, w2 = quantized(e, 2 * i, h, gen=g, scale=0.5), quantized(e, h, i, gen=g, scale=0.3)
    r = Nvfp4MoE(*w13, None, *w2, None, swiglu_limit=LIMIT, backend="reference")
    impl = sm90_runners.MoE(r)
    _warm(impl, m)
    x = bf16(m, h, gen=g, scale=2.0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    ids[1, 1] = -1
    tw = torch.rand(k, m, generator=g).T  # [m, k], not contiguous
    out = torch.full((h, m), float("nan"), dtype=torch.bfloat16).T  # [m, h], not contiguous
    with _no_reserve(monkeypatch):
        impl(x, ids.long(), tw, out)
    assert_close_to_ref(out, reference.nvfp4_moe_ref(x, ids, tw, *w13, *w2, LIMIT))
    ref = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    impl(x, ids, tw.contiguous(), ref)
    assert torch.equal(out, ref)
    impl(x, ids, tw, out)
    warned = [r.getMessage() for r in caplog.records if "copied on every call" in r.message]
    assert len(warned) == 1 and warned[0].startswith("cutedsl sm90 routed experts output: (5, 128)")


def test_gpu_backend_runners_hold_only_their_prepared_weights(emulated_launch, monkeypatch) -> None:
    """Built for the sm90 backend, a runner lets go of its checkpoint-layout tensors (only the
    reference backend reads them) and still computes the reference result from its prepared
    copies: once vLLM's layer drops its own references, the weights are held once, not twice."""
    import cutedsl.runner

    monkeypatch.setattr(cutedsl.runner, "select_backend", lambda device, backend: "sm90")
    g = fresh_gen()
    h, i, e, k, m = 128, 64, 4, 2, 5
    wl, w13, w2 = quantized(64, h, gen=g), quantized(2 * i, h, gen=g), quantized(h, i, gen=g)
    ew13, ew2 = quantized(e, 2 * i, h, gen=g), quantized(e, h, i, gen=g, scale=0.3)
    lin = Nvfp4Linear(*wl)
    mlp = Nvfp4SharedMlp(*w13, None, *w2, None, swiglu_limit=LIMIT)
    moe = Nvfp4MoE(*ew13, None, *ew2, None, swiglu_limit=LIMIT)
    opj = Nvfp4GroupedOproj(*quantized(2 * 64, h, gen=g), n_groups=2)
    for r in (lin, mlp, moe, opj):
        assert r.backend == "sm90" and r.checkpoint_tensors
        for name in r.checkpoint_tensors:
            assert getattr(r, name) is None, f"{type(r).__name__}.{name} still held"
        r.warmup(m)
    x = bf16(m, h, gen=g, scale=2.0)
    assert_close_to_ref(lin(x), reference.nvfp4_linear_ref(x, *wl))
    assert_close_to_ref(mlp(x), reference.nvfp4_shared_mlp_ref(x, *w13, *w2, LIMIT))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    tw, out = torch.rand(m, k, generator=g), torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    moe(x, ids, tw, out)
    assert_close_to_ref(out, reference.nvfp4_moe_ref(x, ids, tw, *ew13, *ew2, LIMIT))
