"""Fresh random NVFP4 test operands shared by the runner and kernel tests (quantized with
cutedsl.formats, or random codes and scales for the SM90 W4A16 GEMMs), with their references."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cutedsl import formats, workspace
from cutedsl.workspace import Workspace


def fresh_gen() -> torch.Generator:
    """A CPU generator seeded from the global RNG, which conftest seeds afresh per test and
    logs on failure (fresh data every run, reproducible with CUTEDSL_TEST_SEED)."""
    return torch.Generator().manual_seed(int(torch.randint(2**31, ())))


def quantized(
    *shape: int, gen: torch.Generator | None = None, scale: float = 1.0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N(0, scale²) weights [..., N, K] quantized to NVFP4; 3-D weights (stacked experts) get one
    global scale per expert. Returns (packed, block scales, global scale)."""
    w = torch.randn(*shape, generator=gen).to(device) * scale
    gs = formats.global_scale_from_amax(w.abs().amax(dim=(-2, -1))) if len(shape) == 3 else None
    return formats.quantize_nvfp4(w, gs)


def bf16(*shape: int, gen: torch.Generator | None = None, scale: float = 1.0, device: str = "cpu"):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)


def assert_close_to_ref(got: torch.Tensor, want: torch.Tensor) -> None:
    """One GEMM chain on identically quantized operands vs its fp32 reference: finite, and within
    bf16 output rounding plus summation order (1% of the largest reference value)."""
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item() + 1e-4, err


def workspaces(impl) -> list[Workspace]:
    """The runner impl's own workspaces and every shared (per-role) one."""
    own = [v for v in vars(impl).values() if isinstance(v, Workspace)]
    return own + list(workspace._SHARED.values())


def warm_and_poison(impl, max_tokens: int) -> None:
    """impl.warmup(max_tokens), then fill every scratch byte of the workspaces with 0xFF (NaN in
    bf16 / fp32), so an intermediate read before it is written shows in the result."""
    impl.warmup(max_tokens)
    wss = workspaces(impl)
    assert wss and any(ws._bufs for ws in wss), "warm-up reserved nothing"
    for ws in wss:
        for b in ws._bufs.values():
            b.fill_(0xFF)


@contextlib.contextmanager
def no_reserve(monkeypatch: pytest.MonkeyPatch):
    """Within: any Workspace.reserve (a hot-path allocation) fails the test."""

    def refuse(self, name, shape, dtype):
        raise AssertionError(f"hot path reserved {self.label}/{name} {list(shape)} {dtype}")

    with monkeypatch.context() as mp:
        mp.setattr(Workspace, "reserve", refuse)
        yield


def sm90_launch_emulator():
    """A stand-in for `cutedsl.sm90.gemm._launch` on the CPU: out3[l] = a3[l] · dequant(wp[l])ᵀ (dense /
    groups), or per expert rows [offs[e], offs[e+1]) of a3[0] (MoE; rows outside the experts are
    left untouched), from the host model of the kernel's weight decode. With `swiglu` (MoE), the
    rows of wp are in `swiglu_row_order`: each expert's bf16 product is put back in (gate | up)
    order and goes through the torch statement of the SwiGLU kernel."""
    from cutedsl.sm90 import swiglu as sw
    from cutedsl.sm90 import weight

    def launch(a3, wp, out3, offs, tactic, swiglu=False, swiglu_limit=None):
        w = weight.dequantize_prepared(wp)  # [L, N, K] fp32
        if offs is None:
            out3.copy_(torch.einsum("lmk,lnk->lmn", a3.float(), w))
            return
        o = offs.tolist()
        for e in range(wp.groups):
            s, t = o[e], o[e + 1]
            h = (a3[0, s:t].float() @ w[e].T).to(out3.dtype)
            if swiglu:
                pairs = h.reshape(t - s, wp.n // 16, 2, 8)  # [rows, b, (gate, up), r]
                h = pairs.transpose(1, 2).reshape(t - s, wp.n)  # (gate | up)
                h = sw.swiglu_clamp_bf16(h, swiglu_limit)
            out3[0, s:t] = h

    return launch


# ---------------------------------------------------------------- the SM90 W4A16 GEMMs


def rand_weight(groups: int, n: int, k: int, dev: str = "cuda"):
    """Random NVFP4 operands: every e2m1 code, e4m3 scales over ~2^-7..2^2, per-group gs."""
    packed = torch.randint(0, 256, (groups, n, k // 2), dtype=torch.uint8, device=dev)
    sf = (torch.rand(groups, n, k // 16, device=dev) * 4 + 2**-7).to(torch.float8_e4m3fn)
    gs = torch.rand(groups, device=dev) * 0.02 + 0.001
    return packed, sf, gs


def ref_w4a16(
    a: torch.Tensor, packed: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor
) -> torch.Tensor:
    """fp32 a @ dequantized(w)^T: the W4A16 GEMMs' reference."""
    w = formats.dequantize_nvfp4(packed, sf, gs, dtype=torch.float32)
    return a.float() @ w.t()


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element written (no NaN left) and within bf16 rounding of the fp32 reference."""
    assert not torch.isnan(out).any(), f"{what}: NaN left in output (an element was not written)"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    err = (out.float() - ref).abs()
    tol = 8e-3 * ref.abs() + 2e-3 * ref.abs().max().clamp_min(1e-6)
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, max err {err.max().item():.4g}, "
        f"max |ref| {ref.abs().max().item():.4g}, first at {bad.nonzero()[0].tolist()}"
    )


def poisoned(shape, dev="cuda") -> torch.Tensor:
    """NaN everywhere: an element a kernel leaves unwritten shows."""
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=dev)


def moe_case(e: int, n: int, k: int, counts: list[int]):
    """Random NVFP4 experts, rows grouped by `counts` per expert: (prepared weight, offs on the
    device, a, fp32 reference)."""
    from cutedsl.sm90 import weight as W

    packed, sf, gs = rand_weight(e, n, k)
    wp = W.prepare_weight(packed, sf, gs)
    t = sum(counts)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty(t, n, device="cuda")
    o = offs.tolist()
    for i in range(e):
        if counts[i]:
            ref[o[i] : o[i + 1]] = ref_w4a16(a[o[i] : o[i + 1]], packed[i], sf[i], gs[i])
    return wp, offs, a, ref
