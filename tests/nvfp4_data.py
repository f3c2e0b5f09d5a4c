"""Fresh random NVFP4 test operands shared by the runner tests (quantized with cutedsl.formats)."""

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
