"""Routing of the SM90 MoE: group the routed assignments by expert, and sum each token's expert
outputs back, both on the device (CUDA: the `cutedsl.sm90.kernels.moe_routing` kernels; CPU: torch
statements of the same contracts).

`route` gives the per-expert offsets the MoE GEMM reads on the device (one compiled kernel for
every routing, no host sync, CUDA-graph capturable); `combine` sums in slot order without atomics,
so the MoE output is the same bit for bit on every run.
"""

from __future__ import annotations

import torch

from cutedsl import jit
from cutedsl.workspace import Workspace

# Largest expert count the route kernel handles (one CTA, one expert count per thread).
MAX_E = 1024


def _build(name: str, no_jit_engine: bool = False) -> object:
    from cutedsl.sm90.kernels import moe_routing

    if name == "route":
        return moe_routing.compile_route(no_jit_engine=no_jit_engine)
    return moe_routing.compile_combine(no_jit_engine=no_jit_engine)


def jobs() -> list[jit.Job]:
    """The `jit.Job`s of the route and combine kernels."""
    return [jit.Job(_build, ("route",)), jit.Job(_build, ("combine",))]


def _kernel(name: str) -> object:
    """The compiled route / combine kernel: every extent is dynamic, so one compile serves every
    routing and size."""
    return jit.compiled(_build, name)


def precompile() -> None:
    """Compile the route and combine kernels (before CUDA-graph capture; GPU processes only)."""
    jit.ensure(jobs())


def route_reserve(ws: Workspace, rows: int, e: int) -> None:
    """Warm-up: reserve `route`'s buffers in `ws` for up to `rows` = M·topk assignments."""
    for name in ("route.ids", "route.tok", "route.inv"):
        ws.reserve(name, (rows,), torch.int32)
    ws.reserve("route.offs", (e + 1,), torch.int32)


def _route_torch(
    ids: torch.Tensor, e: int, topk: int, offs: torch.Tensor, tok: torch.Tensor, inv: torch.Tensor
) -> None:
    """The route kernel's contract in torch (CPU; allocates): a stable order (assignment order
    inside each expert), which is one of the orders the kernel may produce."""
    key = ids.long()
    local = (key >= 0) & (key < e)
    key = torch.where(local, key, e)  # non-local: bucket e, after every expert
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=e + 1)
    offs[0] = 0
    offs[1:] = torch.cumsum(counts[:e], 0)
    tok.copy_(order // topk)
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=ids.device)
    inv.copy_(torch.where(local, row, -1).view(-1, topk).T)


def route(
    topk_ids: torch.Tensor, e: int, ws: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T = M·topk assignments j = m·topk + s by expert, on the device.

    topk_ids int32/int64 [M, topk]; a value < 0 or >= e is not local (expert parallelism).
    Returns int32 tensors:
      offs [E + 1]: expert x owns sorted rows [offs[x], offs[x+1]); offs[E] = local assignments;
      tok [T]: the token of each sorted row; rows [offs[E], T) hold the non-local assignments, so
        every entry is a valid token index (a gather x[tok] stays in bounds);
      inv [topk, M]: inv[s, m] = the sorted row of assignment (m, s), -1 if not local.
    Every assignment has exactly one row. The order inside an expert is unspecified on CUDA (the
    route kernel's warps race; GEMM rows are independent and `combine` sums in slot order, so
    results do not depend on it) and stable (assignment order) on the CPU.
    CUDA: the `cutedsl.kernels.moe_routing` route kernel (one launch, no host sync, no
    allocation with `ws`, CUDA-graph capturable; int64 or non-contiguous ids are first copied
    into an int32 workspace buffer). CPU: torch ops (allocate). With `ws` (reserved by
    `route_reserve`) the results are views of it; without, it is allocated.
    """
    m, topk = topk_ids.shape
    t = m * topk
    if not 1 <= e <= MAX_E:
        raise ValueError(f"route: {e} experts, the route kernel supports 1..{MAX_E}")
    if ws is None:
        ws = Workspace(topk_ids.device, "route")
        route_reserve(ws, t, e)
    offs = ws.get("route.offs", (e + 1,), torch.int32)
    tok = ws.get("route.tok", (t,), torch.int32)
    inv = ws.get("route.inv", (topk, m), torch.int32)
    if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous():
        ids = topk_ids.view(t)
    else:
        ids = ws.get("route.ids", (t,), torch.int32)
        ids.view(m, topk).copy_(topk_ids)
    if t == 0:
        offs.zero_()
    elif topk_ids.is_cuda:
        _kernel("route")(ids, offs, tok, inv)
    else:
        _route_torch(ids, e, topk, offs, tok, inv)
    return offs, tok, inv


def combine(
    y: torch.Tensor, inv: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[m] = bf16(Σ_{s = 0..topk-1, inv[s, m] >= 0} topk_weights[m, s] · y[inv[s, m]]).

    y bf16 [R, H] (expert outputs by sorted row; rows no inv entry names are never read),
    inv int32 [topk, M] from `route`, topk_weights fp32 [M, topk], out bf16 [M, H]. fp32 sum
    in slot order, each step a separately rounded multiply and add, from +0: deterministic,
    and the CPU torch statement below and the CUDA kernel (`cutedsl.kernels.moe_routing`, no
    atomics, no allocation, graph-capturable) give the same bits. CUDA needs H % 8 == 0, y and
    out contiguous and 16-byte aligned, topk_weights contiguous.
    """
    topk, m = inv.shape
    hid = y.shape[1]
    if out.shape != (m, hid) or topk_weights.shape != (m, topk):
        raise ValueError(
            f"combine: y {tuple(y.shape)}, inv {tuple(inv.shape)}, topk_weights "
            f"{tuple(topk_weights.shape)}, out {tuple(out.shape)}: expected [R, H], [topk, M], "
            "[M, topk], [M, H]"
        )
    if m == 0:
        return out
    if y.is_cuda:
        if (
            hid % 8
            or not all(t.is_contiguous() for t in (y, inv, topk_weights, out))
            or any(t.data_ptr() % 16 for t in (y, out))
        ):
            raise ValueError(
                "combine: CUDA needs H % 8 == 0, contiguous operands, 16 B aligned y/out"
            )
        _kernel("combine")(y, topk_weights, inv, out)
        return out
    acc = torch.zeros((m, hid), dtype=torch.float32, device=y.device)
    for s in range(topk):
        r = inv[s].long()
        p = y[r.clamp(min=0)].float() * topk_weights[:, s, None]
        acc = acc + torch.where(r[:, None] >= 0, p, 0.0)
    out.copy_(acc)
    return out
