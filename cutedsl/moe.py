"""The DSv4 routed experts: out[m] = Σ_j topk_weights[m, j] · expert_{topk_ids[m, j]}(x[m]).

Each expert is the clamped-SwiGLU MLP of `cutedsl.shared_mlp` with its own NVFP4 weights:
w13 u8 [E, 2I, H//2] (w1 rows then w3 rows), w13_scale e4m3 [E, 2I, H//16], w13_scale_2 fp32 [E],
w2 u8 [E, H, I//2], w2_scale e4m3 [E, H, I//16], w2_scale_2 fp32 [E]; input scales fp32 [E].
topk_ids int32 [M, topk]: local expert ids, −1 = not on this rank (expert parallelism).
The runner writes vLLM's `out` buffer (bf16 [M, H]) in place. Backends as in `cutedsl.linear`; the
GPU backends route on the device (per-expert offsets in a device tensor: one compiled kernel for
every routing, no host sync, CUDA-graph capturable). `route` and `combine` (our CuTeDSL kernels
of `cutedsl.kernels.moe_routing` on CUDA, torch on the CPU) group the assignments by expert and
sum each token's expert outputs in a fixed order (the sm90 backend; sm100 has its own padded
layout in `cutedsl.sm100`).
"""

from __future__ import annotations

import torch

from cutedsl import formats, ops, reference
from cutedsl.kernels import compile_once
from cutedsl.runner import Runner, check_tensor, per_expert_f32
from cutedsl.workspace import Workspace

# Largest expert count the route kernel handles (one CTA, one expert count per thread).
MAX_E = 1024


def _kernel(name: str) -> object:
    """The compiled route / combine kernel (cutedsl.kernels.moe_routing); keyed by name only: every
    extent is dynamic, so one compile serves every routing and size."""
    return compile_once(("moe_routing", name), lambda: _build(name))


def _build(name: str) -> object:
    from cutedsl.kernels import moe_routing

    return moe_routing.compile_route() if name == "route" else moe_routing.compile_combine()


def warmup_kernels() -> None:
    """Compile the route and combine kernels (before CUDA-graph capture; GPU processes only)."""
    _kernel("route")
    _kernel("combine")


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


class Nvfp4MoE(Runner):
    kind = "moe"
    checkpoint_tensors = ("w13", "w13_scale", "w2", "w2_scale")

    def __init__(
        self,
        w13: torch.Tensor,  # (E, 2I, H//2) uint8
        w13_scale: torch.Tensor,  # (E, 2I, H//16) e4m3
        w13_scale_2: torch.Tensor,  # (E,) fp32
        w13_input_scale: torch.Tensor | None,  # (E,) fp32
        w2: torch.Tensor,  # (E, H, I//2) uint8
        w2_scale: torch.Tensor,  # (E, H, I//16) e4m3
        w2_scale_2: torch.Tensor,  # (E,) fp32
        w2_input_scale: torch.Tensor | None,  # (E,) fp32
        *,
        swiglu_limit: float | None = 10.0,
        backend: str | None = None,
    ) -> None:
        check_tensor("w13", w13, (None, None, None), (torch.uint8,))
        self.e = w13.shape[0]
        if w13.shape[1] % 2:
            raise ValueError(f"w13: {w13.shape[1]} rows per expert, expected 2·I")
        self.i, self.h = w13.shape[1] // 2, w13.shape[2] * 2
        if self.i % formats.BLOCK or self.h % formats.BLOCK:
            raise ValueError(f"w13: I = {self.i}, H = {self.h}; both must be multiples of 16")
        dev, e4m3 = w13.device, (torch.float8_e4m3fn,)
        check_tensor("w13_scale", w13_scale, (self.e, 2 * self.i, self.h // 16), e4m3, dev)
        check_tensor("w2", w2, (self.e, self.h, self.i // 2), (torch.uint8,), dev)
        check_tensor("w2_scale", w2_scale, (self.e, self.h, self.i // 16), e4m3, dev)
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self.w13_scale_2 = per_expert_f32("w13_scale_2", w13_scale_2, self.e, dev)
        self.w2_scale_2 = per_expert_f32("w2_scale_2", w2_scale_2, self.e, dev)
        self.w13_input_scale = per_expert_f32("w13_input_scale", w13_input_scale, self.e, dev)
        self.w2_input_scale = per_expert_f32("w2_input_scale", w2_input_scale, self.e, dev)
        self.swiglu_limit = swiglu_limit
        self._setup(dev, backend)

    def _reference(self, x, topk_ids, topk_weights, out) -> None:
        y = reference.nvfp4_moe_ref(
            x, topk_ids, topk_weights, self.w13, self.w13_scale, self.w13_scale_2,
            self.w2, self.w2_scale, self.w2_scale_2, self.swiglu_limit,
        )  # fmt: skip
        out.copy_(y)

    def run(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        check_tensor("x", x, (None, self.h), (torch.bfloat16,), self.device)
        m = x.shape[0]
        check_tensor("topk_ids", topk_ids, (m, None), (torch.int32, torch.int64), self.device)
        k = topk_ids.shape[1]
        check_tensor("topk_weights", topk_weights, (m, k), (torch.float32,), self.device)
        check_tensor("out", out, (m, self.h), (torch.bfloat16,), self.device)
        if m == 0:
            return
        self._impl(x, topk_ids, topk_weights, out)

    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        ops.nvfp4_moe(x, topk_ids, topk_weights, out, self.id)
