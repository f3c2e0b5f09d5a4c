"""The clamped SwiGLU between the two GEMMs of the SM90 MLPs (shared and routed experts):
h [M, 2I] bf16 (gate | up) -> silu(min(gate, L)) · clamp(up, -L, L) in fp32 -> bf16 [M, I].
CUDA: one CuTeDSL kernel (`cutedsl.sm90.kernels.swiglu`, no scratch, no allocation); elsewhere the
fp32 torch statement `swiglu_clamp_bf16` (the kernel's contract, same operations in the same order).
"""

from __future__ import annotations

import torch

from cutedsl import jit


def swiglu_clamp_bf16(
    h: torch.Tensor,
    limit: float | None,
    out: torch.Tensor | None = None,
    tmp: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [M, 2I] bf16 (gate | up) → silu(min(gate, L)) · clamp(up, −L, L) in fp32 → bf16 [M, I].

    out: bf16 [M, I] (allocated if None); tmp: fp32 [2, C, I] scratch (allocated if None), used
    in chunks of C rows. Same fp32 operations as the out-of-place form, in place."""
    m, i = h.shape[0], h.shape[1] // 2
    if out is None:
        out = h.new_empty((m, i))
    if m == 0:
        return out
    if tmp is None:
        tmp = torch.empty((2, m, i), dtype=torch.float32, device=h.device)
    c = tmp.shape[1]
    for r0 in range(0, m, c):
        r1 = min(m, r0 + c)
        g, u = tmp[0, : r1 - r0], tmp[1, : r1 - r0]
        g.copy_(h[r0:r1, :i])
        u.copy_(h[r0:r1, i:])
        if limit is not None:
            g.clamp_(max=limit)
            u.clamp_(min=-limit, max=limit)
        torch.nn.functional.silu(g, inplace=True)
        g.mul_(u)
        out[r0:r1].copy_(g)
    return out


def _build(limit: float | None, no_jit_engine: bool = False) -> object:
    from cutedsl.sm90.kernels.swiglu import compile_swiglu

    return compile_swiglu(limit, no_jit_engine=no_jit_engine)


def job(limit: float | None) -> jit.Job:
    """The `jit.Job` of `kernel(limit)`."""
    return jit.Job(_build, (limit,))


def kernel(limit: float | None) -> object:
    """The compiled `cutedsl.sm90.kernels.swiglu` kernel for one limit (M and I are dynamic)."""
    return jit.compiled(_build, limit)


def swiglu_clamp(h: torch.Tensor, limit: float | None, out: torch.Tensor) -> torch.Tensor:
    """`swiglu_clamp_bf16` on CUDA as one CuTeDSL kernel (no fp32 scratch, no allocation):
    h bf16 [M, 2I] (gate | up), out bf16 [M, I], both contiguous and 16-byte aligned, I % 8 == 0."""
    m, i2 = h.shape
    if h.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError(f"swiglu: h {h.dtype} and out {out.dtype} must be bfloat16")
    if i2 % 16 or out.shape != (m, i2 // 2):
        raise ValueError(
            f"swiglu: h {tuple(h.shape)} needs 2I with I % 8 == 0 and out [M, I], got out {tuple(out.shape)}"
        )
    for name, t in (("h", h), ("out", out)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"swiglu: {name} must be contiguous and 16-byte aligned")
    if m:
        kernel(limit)(h, out)
    return out
