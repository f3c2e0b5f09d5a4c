"""The sm90 backend of each runner: weights prepared once, then the W4A16 kernels of `cutedsl.sm90`.

Every impl is a callable with the runner's `run` signature (inputs already checked, M > 0) and a
`warmup(max_tokens)` that compiles every tactic the heuristic can pick for 1..max_tokens rows.
Hot path: no compile once warm, no host sync, no CPU tensor; allocations are the outputs and the
intermediates, from the caching allocator (inside a CUDA graph, from the graph's private pool).
"""

from __future__ import annotations

import torch

from cutedsl import sm90
from cutedsl.moe import route


def _tactics(n: int, k: int, groups: int, max_tokens: int, moe: bool) -> set[tuple]:
    return {(*sm90.launch_tactic(m, n, k, groups, moe), moe) for m in range(1, max_tokens + 1)}


def swiglu_clamp_bf16(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """h [M, 2I] bf16 (gate | up) → silu(min(gate, L)) · clamp(up, −L, L) in fp32 → bf16 [M, I]."""
    i = h.shape[1] // 2
    g, u = h[:, :i].float(), h[:, i:].float()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


class _Linear:
    def __init__(self, r) -> None:
        self.wp = sm90.prepare_nvfp4_weight(r.weight, r.weight_scale, r.weight_scale_2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return sm90.sm90_nvfp4_gemm_prepared(x.contiguous(), self.wp)

    def warmup(self, max_tokens: int) -> None:
        sm90.warmup(sorted(_tactics(self.wp.n, self.wp.k, 1, max_tokens, False)))


class _GroupedOproj:
    def __init__(self, r) -> None:
        self.wp = sm90.prepare_nvfp4_weight(
            r.weight, r.weight_scale, r.weight_scale_2, groups=r.n_groups
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, D] → [T, G, R]
        y = sm90.sm90_nvfp4_grouped_gemm(x.transpose(0, 1).contiguous(), self.wp)
        return y.transpose(0, 1).contiguous()

    def warmup(self, max_tokens: int) -> None:
        sm90.warmup(sorted(_tactics(self.wp.n, self.wp.k, self.wp.groups, max_tokens, False)))


class _SharedMlp:
    def __init__(self, r) -> None:
        self.wp13 = sm90.prepare_nvfp4_weight(r.w13, r.w13_scale, r.w13_scale_2)
        self.wp2 = sm90.prepare_nvfp4_weight(r.w2, r.w2_scale, r.w2_scale_2)
        self.limit = r.swiglu_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = sm90.sm90_nvfp4_gemm_prepared(x.contiguous(), self.wp13)
        return sm90.sm90_nvfp4_gemm_prepared(swiglu_clamp_bf16(h, self.limit), self.wp2)

    def warmup(self, max_tokens: int) -> None:
        t = _tactics(self.wp13.n, self.wp13.k, 1, max_tokens, False)
        sm90.warmup(sorted(t | _tactics(self.wp2.n, self.wp2.k, 1, max_tokens, False)))


class _MoE:
    def __init__(self, r) -> None:
        self.e = r.e
        self.wp13 = sm90.prepare_nvfp4_weight(r.w13, r.w13_scale, r.w13_scale_2, groups=r.e)
        self.wp2 = sm90.prepare_nvfp4_weight(r.w2, r.w2_scale, r.w2_scale_2, groups=r.e)
        self.limit = r.swiglu_limit

    def __call__(self, x, topk_ids, topk_weights, out) -> None:
        m, topk = topk_ids.shape
        order, offs, valid = route(topk_ids, self.e)
        a = x[order // topk]  # [M·topk, H], rows grouped by expert, non-local rows last
        h = sm90.sm90_nvfp4_moe_gemm(a, offs, self.wp13)
        y = sm90.sm90_nvfp4_moe_gemm(swiglu_clamp_bf16(h, self.limit), offs, self.wp2)
        # Rows past offs[E] (non-local assignments) are not written by the kernel: mask them.
        w = torch.where(valid, topk_weights.reshape(-1)[order], 0.0)
        y = torch.where(valid[:, None], y.float() * w[:, None], 0.0)
        acc = torch.zeros(m, y.shape[1], dtype=torch.float32, device=x.device)
        acc.index_add_(0, order // topk, y)
        out.copy_(acc)

    def warmup(self, max_tokens: int) -> None:
        t = set()
        for wp in (self.wp13, self.wp2):
            t |= _tactics(wp.n, wp.k, self.e, max_tokens * 8, True)
        sm90.warmup(sorted(t))


# The factories `Runner._make_impl` looks up by the runner's kind.
linear_impl = _Linear
grouped_oproj_impl = _GroupedOproj
shared_mlp_impl = _SharedMlp
moe_impl = _MoE
