"""The sm90 implementation of each public runner: weights prepared once (`cutedsl.sm90.weight`),
then the W4A16 kernels (`cutedsl.sm90.gemm`).

Every implementation is built from its runner (`Impl(runner)`), is a callable with the runner's
`run` signature (inputs already checked, M > 0) and has a `warmup(max_tokens)` that compiles every
tactic `launch_tactic` can pick for 1..max_tokens rows on this GPU and reserves its scratch in its
`cutedsl.workspace` (routed experts and grouped o-proj: role "main"; shared-expert MLP: role
"shared", as vLLM may run it on a side stream next to the routed experts; a linear has none:
split-K reduces inside the kernel).

Hot path: no compile once warm, no lock, no host sync, no CPU tensor, no data-dependent host
branch. The only allocations are the op results (a linear's / the shared MLP's [M, N], the
grouped o-proj's [T, G, R]: a torch.library custom op returns new tensors; inside a CUDA graph
they come from the graph's private pool) and a copy of an input whose rows the kernel cannot
address (a column slice of a wider tensor is read in place). Every
intermediate (the o-proj's per-group operand and output, routing buffers, the gathered MoE rows,
h, the SwiGLU result, y) is a view of the workspace fetched per call; a call with more rows than
warmed up raises `cutedsl.workspace.WorkspaceError`. The routed experts allocate nothing: routing
and the weighted combine are kernels (`cutedsl.sm90.routing`), and the combine sums each token's
topk contributions in slot order without atomics, so the MoE output is the same bit for bit on
every run. The clamped SwiGLU between the two GEMMs is `cutedsl.sm90.swiglu`; with
`CUTEDSL_SM90_FUSED_SWIGLU=1` the routed experts' w13 GEMM applies it in its epilogue instead (w13
kept in `cutedsl.sm90.weight.swiglu_row_order`; the same bits, one launch and the h round trip
fewer). The shared-expert MLP always runs it separately (its decode tactics split K).
"""

from __future__ import annotations

import os

import torch

from cutedsl import jit
from cutedsl.sm90 import gemm, routing, swiglu
from cutedsl.sm90.tactics import AnyTactic, GpuSpec, gpu_spec, reachable_tactics
from cutedsl.sm90.weight import interleave_swiglu, prepare_weight
from cutedsl.validate import readable_rows, warn_copy
from cutedsl.workspace import Workspace, for_role

# Rows per chunk of the CPU SwiGLU's fp32 scratch (bounds it to 2 x CHUNK x I fp32 whatever the
# token count; on CUDA the SwiGLU and the MoE combine are kernels with no scratch).
CHUNK = 4096
# Routed rows reserved per token: topk <= 8 (DSv4 uses 6); the tactic warm-up assumes it too.
MAX_TOPK = 8
FUSED_SWIGLU_ENV = "CUTEDSL_SM90_FUSED_SWIGLU"


def fused_swiglu() -> bool:
    """Whether the routed experts fuse the clamped SwiGLU into their w13 GEMM
    (`CUTEDSL_SM90_FUSED_SWIGLU`: 1 on, 0 or unset off); read when a `MoE` is built and when its
    kernels are listed (`moe_jobs`), so the two agree."""
    v = os.environ.get(FUSED_SWIGLU_ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{FUSED_SWIGLU_ENV}={v!r}: expected 0 or 1")
    return v == "1"


def gemm_tactics(
    n: int, k: int, groups: int, moe: bool, max_rows: int, spec: GpuSpec
) -> set[tuple[AnyTactic, bool]]:
    """(tactic, moe) for every tactic a launch of 1..max_rows rows of an N x K weight with
    `groups` groups can take on `spec` (`tactics.reachable_tactics`)."""
    return {(t, moe) for t in reachable_tactics(n, k, groups, moe, max_rows, spec)}


def shared_mlp_tactics(
    h: int, i: int, max_tokens: int, spec: GpuSpec
) -> set[tuple[AnyTactic, bool]]:
    """The GEMM variants of a `SharedMlp` (hidden size h, intermediate size i)."""
    return gemm_tactics(2 * i, h, 1, False, max_tokens, spec) | gemm_tactics(
        h, i, 1, False, max_tokens, spec
    )


def moe_tactics(
    e: int, h: int, i: int, max_tokens: int, spec: GpuSpec
) -> tuple[set[tuple[AnyTactic, bool]], set[tuple[AnyTactic, bool]]]:
    """The (w13, w2) GEMM variants of a `MoE` of e local experts (routed rows up to
    max_tokens * MAX_TOPK)."""
    rows = max_tokens * MAX_TOPK
    return gemm_tactics(2 * i, h, e, True, rows, spec), gemm_tactics(h, i, e, True, rows, spec)


def _moe_gemm_plan(
    e: int, h: int, i: int, limit: float | None, max_tokens: int, spec: GpuSpec, fused: bool
) -> list[tuple[set[tuple[AnyTactic, bool]], dict]]:
    """The GEMM variants of a `MoE` as (tactics, epilogue keywords of `gemm.jobs` /
    `gemm.precompile`): w13 with the fused SwiGLU and w2 plain, or both plain. What `moe_jobs`
    lists and `MoE.warmup` compiles, from this one place."""
    w13, w2 = moe_tactics(e, h, i, max_tokens, spec)
    if fused:
        return [(w13, {"swiglu": True, "swiglu_limit": limit}), (w2, {})]
    return [(w13 | w2, {})]


# What each implementation's warmup(max_tokens) compiles on a CUDA device of `spec`, as jobs for
# `jit.prefetch` (the vLLM adapters start them before the weights load; `cutedsl.vllm.prefetch`).


def linear_jobs(n: int, k: int, groups: int, max_tokens: int, spec: GpuSpec) -> list[jit.Job]:
    """`Linear` (groups=1) or `GroupedOproj` (groups=G, N rows per group) of an N x K weight."""
    return gemm.jobs(gemm_tactics(n, k, groups, False, max_tokens, spec))


def shared_mlp_jobs(
    h: int, i: int, limit: float | None, max_tokens: int, spec: GpuSpec
) -> list[jit.Job]:
    """`SharedMlp`: its GEMMs and the clamped SwiGLU."""
    return gemm.jobs(shared_mlp_tactics(h, i, max_tokens, spec)) + [swiglu.job(limit)]


def moe_jobs(
    e: int, h: int, i: int, limit: float | None, max_tokens: int, spec: GpuSpec
) -> list[jit.Job]:
    """`MoE`: its GEMMs, the routing kernels and the clamped SwiGLU (fused into the w13 GEMMs
    when `fused_swiglu()`, else its own kernel)."""
    fused = fused_swiglu()
    plan = _moe_gemm_plan(e, h, i, limit, max_tokens, spec, fused)
    jobs = [job for tactics, kw in plan for job in gemm.jobs(tactics, **kw)]
    return jobs + ([] if fused else [swiglu.job(limit)]) + routing.jobs()


def _mlp_reserve(ws: Workspace, rows: int, i: int) -> None:
    ws.reserve("h", (rows, 2 * i), torch.bfloat16)
    ws.reserve("s", (rows, i), torch.bfloat16)
    if ws.device.type != "cuda":  # the torch statement's scratch; CUDA runs the kernel
        ws.reserve("f32", (2, min(rows, CHUNK), i), torch.float32)


def _swiglu(ws: Workspace, h: torch.Tensor, limit: float | None) -> torch.Tensor:
    m, i = h.shape[0], h.shape[1] // 2
    out = ws.get("s", (m, i), torch.bfloat16)
    if h.is_cuda:
        return swiglu.swiglu_clamp(h, limit, out)
    tmp = ws.get("f32", (2, min(m, CHUNK), i), torch.float32)
    return swiglu.swiglu_clamp_bf16(h, limit, out, tmp)


class Linear:
    def __init__(self, r) -> None:
        self.wp = prepare_weight(r.weight, r.weight_scale, r.weight_scale_2)
        self.device = r.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # output: the op's result
        return gemm.linear(readable_rows(x, "sm90 linear input"), self.wp)

    def warmup(self, max_tokens: int) -> None:
        wp = self.wp
        gemm.precompile(gemm_tactics(wp.n, wp.k, 1, False, max_tokens, gpu_spec(self.device)))


class GroupedOproj:
    def __init__(self, r) -> None:
        self.wp = prepare_weight(r.weight, r.weight_scale, r.weight_scale_2, groups=r.n_groups)
        self.device = r.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, D] → [T, G, R] (the result)
        t, g, _ = x.shape
        out = x.new_empty((t, g, self.wp.n))
        # the kernel reads and writes the token-major tensors through their strides
        gemm.grouped(x.transpose(0, 1), self.wp, out=out.transpose(0, 1))
        return out

    def warmup(self, max_tokens: int) -> None:
        wp = self.wp
        spec = gpu_spec(self.device)
        gemm.precompile(gemm_tactics(wp.n, wp.k, wp.groups, False, max_tokens, spec))


class SharedMlp:
    def __init__(self, r) -> None:
        self.wp13 = prepare_weight(r.w13, r.w13_scale, r.w13_scale_2)
        self.wp2 = prepare_weight(r.w2, r.w2_scale, r.w2_scale_2)
        self.limit = r.swiglu_limit
        self.device = r.w13.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = for_role(self.device, "shared")
        h = ws.get("h", (x.shape[0], self.wp13.n), torch.bfloat16)
        gemm.linear(readable_rows(x, "sm90 shared MLP input"), self.wp13, out=h)
        s = _swiglu(ws, h, self.limit)
        return gemm.linear(s, self.wp2)  # the op's result

    def warmup(self, max_tokens: int) -> None:
        spec = gpu_spec(self.device)
        gemm.precompile(shared_mlp_tactics(self.wp13.k, self.wp2.k, max_tokens, spec))
        if self.device.type == "cuda":
            swiglu.kernel(self.limit)
        ws = for_role(self.device, "shared")
        _mlp_reserve(ws, max_tokens, self.wp2.k)


class MoE:
    def __init__(self, r, fused: bool | None = None) -> None:
        """`fused`: the SwiGLU in the w13 GEMM's epilogue (None: `fused_swiglu()`)."""
        self.e = r.e
        self.fused = fused_swiglu() if fused is None else fused
        self.wp13 = prepare_weight(r.w13, r.w13_scale, r.w13_scale_2, groups=r.e)
        if self.fused:
            interleave_swiglu(self.wp13)
        self.wp2 = prepare_weight(r.w2, r.w2_scale, r.w2_scale_2, groups=r.e)
        self.limit = r.swiglu_limit
        self.device = r.w13.device

    def __call__(self, x, topk_ids, topk_weights, out) -> None:
        ws = for_role(self.device, "main")
        m, topk = topk_ids.shape
        t, hid = m * topk, self.wp2.n
        res = ws.get("moe.out", (m, hid), torch.bfloat16)  # first: a too-large M fails early
        offs, tok, inv = routing.route(topk_ids, self.e, ws)
        a = ws.get("a", (t, hid), torch.bfloat16)
        torch.index_select(x, 0, tok, out=a)  # [M·topk, H], rows grouped by expert
        if self.fused:
            s = ws.get("s", (t, self.wp2.k), torch.bfloat16)
            gemm.moe(a, offs, self.wp13, out=s, swiglu=True, swiglu_limit=self.limit)
        else:
            h = ws.get("h", (t, self.wp13.n), torch.bfloat16)
            gemm.moe(a, offs, self.wp13, out=h)
            s = _swiglu(ws, h, self.limit)
        y = ws.get("a", (t, hid), torch.bfloat16)  # a is dead: y reuses its memory
        # Rows past offs[E] (non-local assignments) are not written: combine never reads them.
        gemm.moe(s, offs, self.wp2, out=y)
        w = topk_weights
        if not w.is_contiguous():
            w = ws.get("moe.w", (m, topk), torch.float32)
            w.copy_(topk_weights)
        direct = out.is_contiguous() and out.data_ptr() % 16 == 0
        routing.combine(y, inv, w, out if direct else res)
        if not direct:
            warn_copy("sm90 routed experts output", out, "contiguous, 16-byte aligned")
            out.copy_(res)

    def warmup(self, max_tokens: int) -> None:
        spec = gpu_spec(self.device)
        args = (self.e, self.wp13.k, self.wp2.k, self.limit, max_tokens, spec, self.fused)
        for tactics, kw in _moe_gemm_plan(*args):
            gemm.precompile(tactics, **kw)
        if self.device.type == "cuda":
            routing.precompile()
            if not self.fused:
                swiglu.kernel(self.limit)
        ws = for_role(self.device, "main")
        rows, hid = max_tokens * MAX_TOPK, self.wp2.n
        routing.route_reserve(ws, rows, self.e)
        ws.reserve("moe.w", (rows,), torch.float32)
        ws.reserve("moe.out", (max_tokens, hid), torch.bfloat16)
        ws.reserve("a", (rows, hid), torch.bfloat16)
        if self.fused:
            ws.reserve("s", (rows, self.wp2.k), torch.bfloat16)
        else:
            _mlp_reserve(ws, rows, self.wp2.k)
