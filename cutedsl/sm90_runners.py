"""The sm90 backend of each runner: weights prepared once, then the W4A16 kernels of `cutedsl.sm90`.

Every impl is a callable with the runner's `run` signature (inputs already checked, M > 0) and a
`warmup(max_tokens)` that compiles every tactic the heuristic can pick for 1..max_tokens rows and
reserves the impl's scratch in its `cutedsl.workspace` (routed experts and grouped o-proj: role
"main"; shared-expert MLP: role "shared", as vLLM may run it on a side stream next to the routed
experts; a linear has none: split-K reduces inside the kernel).

Hot path: no compile once warm, no lock, no host sync, no CPU tensor, no data-dependent host
branch. The only allocations are the op results (a linear's / the shared MLP's [M, N], the
grouped o-proj's [T, G, R]: a torch.library custom op returns new tensors; inside a CUDA graph
they come from the graph's private pool) and a copy of a non-contiguous input. Every
intermediate (the o-proj's per-group operand and output, routing buffers,
the gathered MoE rows, h, the SwiGLU result, y) is a view of the workspace
fetched per call; a call with more rows than warmed up raises `cutedsl.workspace.WorkspaceError`.
Kernel operands keep the layouts the kernels were validated with (contiguous, same strides).
The routed experts allocate nothing: routing and the weighted combine are our CuTeDSL kernels
(`cutedsl.moe.route` / `combine`, `cutedsl.kernels.moe_routing`; torch.sort and the fp32
`index_add_` are gone), and the combine sums each token's topk contributions in slot order
without atomics, so the MoE output is the same bit for bit on every run. The clamped SwiGLU
between the two GEMMs (shared and routed) is one CuTeDSL kernel on CUDA (`swiglu_clamp`,
`cutedsl.kernels.swiglu`) and the fp32 torch statement `swiglu_clamp_bf16` elsewhere.
"""

from __future__ import annotations

import torch

from cutedsl import sm90
from cutedsl.kernels import compile_once
from cutedsl.moe import combine, route, route_reserve, warmup_kernels
from cutedsl.workspace import Workspace, for_role

# Rows per chunk of the CPU SwiGLU's fp32 scratch (bounds it to 2 x CHUNK x I fp32 whatever the
# token count; on CUDA the SwiGLU and the MoE combine are kernels with no scratch).
CHUNK = 4096
# Routed rows reserved per token: topk <= 8 (DSv4 uses 6); the tactic warm-up assumes it too.
MAX_TOPK = 8


def _tactics(n: int, k: int, groups: int, max_tokens: int, moe: bool) -> set[tuple]:
    return {(*sm90.launch_tactic(m, n, k, groups, moe), moe) for m in range(1, max_tokens + 1)}


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


def _swiglu_kernel(limit: float | None) -> object:
    """The compiled `cutedsl.kernels.swiglu` kernel for one limit (M and I are dynamic)."""
    return compile_once(("swiglu", limit), lambda: _build_swiglu(limit))


def _build_swiglu(limit: float | None) -> object:
    from cutedsl.kernels.swiglu import compile_swiglu

    return compile_swiglu(limit)


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
        _swiglu_kernel(limit)(h, out)
    return out


def _mlp_reserve(ws: Workspace, rows: int, i: int) -> None:
    ws.reserve("h", (rows, 2 * i), torch.bfloat16)
    ws.reserve("s", (rows, i), torch.bfloat16)
    if ws.device.type != "cuda":  # the torch statement's scratch; CUDA runs the kernel
        ws.reserve("f32", (2, min(rows, CHUNK), i), torch.float32)


def _swiglu(ws: Workspace, h: torch.Tensor, limit: float | None) -> torch.Tensor:
    m, i = h.shape[0], h.shape[1] // 2
    out = ws.get("s", (m, i), torch.bfloat16)
    if h.is_cuda:
        return swiglu_clamp(h, limit, out)
    tmp = ws.get("f32", (2, min(m, CHUNK), i), torch.float32)
    return swiglu_clamp_bf16(h, limit, out, tmp)


class _Linear:
    def __init__(self, r) -> None:
        self.wp = sm90.prepare_nvfp4_weight(r.weight, r.weight_scale, r.weight_scale_2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # output: the op's result
        return sm90.sm90_nvfp4_gemm_prepared(x.contiguous(), self.wp)

    def warmup(self, max_tokens: int) -> None:
        sm90.warmup(sorted(_tactics(self.wp.n, self.wp.k, 1, max_tokens, False)))


class _GroupedOproj:
    def __init__(self, r) -> None:
        self.wp = sm90.prepare_nvfp4_weight(
            r.weight, r.weight_scale, r.weight_scale_2, groups=r.n_groups
        )
        self.device = r.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, D] → [T, G, R] (the result)
        ws = for_role(self.device, "main")
        t, g, d = x.shape
        a = ws.get("a", (g, t, d), torch.bfloat16)
        a.copy_(x.transpose(0, 1))  # per-group contiguous [G, T, D]
        y = ws.get("h", (g, t, self.wp.n), torch.bfloat16)
        sm90.sm90_nvfp4_grouped_gemm(a, self.wp, out=y)
        out = x.new_empty((t, g, self.wp.n))
        out.copy_(y.transpose(0, 1))
        return out

    def warmup(self, max_tokens: int) -> None:
        sm90.warmup(sorted(_tactics(self.wp.n, self.wp.k, self.wp.groups, max_tokens, False)))
        ws = for_role(self.device, "main")
        g, t = self.wp.groups, max_tokens
        ws.reserve("a", (g, t, self.wp.k), torch.bfloat16)
        ws.reserve("h", (g, t, self.wp.n), torch.bfloat16)


class _SharedMlp:
    def __init__(self, r) -> None:
        self.wp13 = sm90.prepare_nvfp4_weight(r.w13, r.w13_scale, r.w13_scale_2)
        self.wp2 = sm90.prepare_nvfp4_weight(r.w2, r.w2_scale, r.w2_scale_2)
        self.limit = r.swiglu_limit
        self.device = r.w13.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = for_role(self.device, "shared")
        h = ws.get("h", (x.shape[0], self.wp13.n), torch.bfloat16)
        sm90.sm90_nvfp4_gemm_prepared(x.contiguous(), self.wp13, out=h)
        s = _swiglu(ws, h, self.limit)
        return sm90.sm90_nvfp4_gemm_prepared(s, self.wp2)  # the op's result

    def warmup(self, max_tokens: int) -> None:
        t = _tactics(self.wp13.n, self.wp13.k, 1, max_tokens, False)
        sm90.warmup(sorted(t | _tactics(self.wp2.n, self.wp2.k, 1, max_tokens, False)))
        if self.device.type == "cuda":
            _swiglu_kernel(self.limit)
        ws = for_role(self.device, "shared")
        _mlp_reserve(ws, max_tokens, self.wp2.k)


class _MoE:
    def __init__(self, r) -> None:
        self.e = r.e
        self.wp13 = sm90.prepare_nvfp4_weight(r.w13, r.w13_scale, r.w13_scale_2, groups=r.e)
        self.wp2 = sm90.prepare_nvfp4_weight(r.w2, r.w2_scale, r.w2_scale_2, groups=r.e)
        self.limit = r.swiglu_limit
        self.device = r.w13.device

    def __call__(self, x, topk_ids, topk_weights, out) -> None:
        ws = for_role(self.device, "main")
        m, topk = topk_ids.shape
        t, hid = m * topk, self.wp2.n
        res = ws.get("moe.out", (m, hid), torch.bfloat16)  # first: a too-large M fails early
        offs, tok, inv = route(topk_ids, self.e, ws)
        a = ws.get("a", (t, hid), torch.bfloat16)
        torch.index_select(x, 0, tok, out=a)  # [M·topk, H], rows grouped by expert
        h = ws.get("h", (t, self.wp13.n), torch.bfloat16)
        sm90.sm90_nvfp4_moe_gemm(a, offs, self.wp13, out=h)
        s = _swiglu(ws, h, self.limit)
        y = ws.get("a", (t, hid), torch.bfloat16)  # a is dead: y reuses its memory
        # Rows past offs[E] (non-local assignments) are not written: combine never reads them.
        sm90.sm90_nvfp4_moe_gemm(s, offs, self.wp2, out=y)
        w = topk_weights
        if not w.is_contiguous():
            w = ws.get("moe.w", (m, topk), torch.float32)
            w.copy_(topk_weights)
        direct = out.is_contiguous() and out.data_ptr() % 16 == 0
        combine(y, inv, w, out if direct else res)
        if not direct:
            out.copy_(res)

    def warmup(self, max_tokens: int) -> None:
        t = set()
        for wp in (self.wp13, self.wp2):
            t |= _tactics(wp.n, wp.k, self.e, max_tokens * MAX_TOPK, True)
        sm90.warmup(sorted(t))
        if self.device.type == "cuda":
            warmup_kernels()
            _swiglu_kernel(self.limit)
        ws = for_role(self.device, "main")
        rows, hid = max_tokens * MAX_TOPK, self.wp2.n
        route_reserve(ws, rows, self.e)
        ws.reserve("moe.w", (rows,), torch.float32)
        ws.reserve("moe.out", (max_tokens, hid), torch.bfloat16)
        ws.reserve("a", (rows, hid), torch.bfloat16)
        _mlp_reserve(ws, rows, self.wp2.k)


# The factories `Runner._make_impl` looks up by the runner's kind.
linear_impl = _Linear
grouped_oproj_impl = _GroupedOproj
shared_mlp_impl = _SharedMlp
moe_impl = _MoE
