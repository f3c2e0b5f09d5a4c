"""The torch.library custom ops: one per runner call, each with a shape-only fake, side by side.

torch.compile(fullgraph=True) sees every runner call as one opaque op (Dynamo never traces into
CuTeDSL). The ops' signatures hold only tensors and ints: the runner (weights prepared for its
backend, compiled kernels, buffers) lives in `_RUNNERS`, keyed by an integer id given at
construction. The fakes read only static facts of the runner (N, G, R, H), never its tensors.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

LIB = "dsv4_cutedsl"


class _Runner(Protocol):
    id: int


_RUNNERS: weakref.WeakValueDictionary[int, _Runner] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def register(runner: _Runner) -> int:
    """Give `runner` an id for the ops; the registry holds it weakly (its layer owns it)."""
    rid = next(_NEXT_ID)
    _RUNNERS[rid] = runner
    return rid


def get_runner(runner_id: int) -> _Runner:
    # int(): under torch.compile(dynamic=True) an int argument may arrive as a SymInt; the id is
    # a constant of the call site, so specializing on it costs nothing.
    runner_id = int(runner_id)
    try:
        return _RUNNERS[runner_id]
    except KeyError:
        raise KeyError(f"no cutedsl runner with id {runner_id} (was its layer deleted?)") from None


# --- linear: y[M, N] = x[M, K] · Wᵀ -------------------------------------------------------------
@torch.library.custom_op(f"{LIB}::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, runner_id: int) -> torch.Tensor:
    return get_runner(runner_id).run(x)


@nvfp4_linear.register_fake
def _(x: torch.Tensor, runner_id: int) -> torch.Tensor:
    r = get_runner(runner_id)
    return x.new_empty((x.shape[0], r.n), dtype=r.out_dtype)


# --- grouped o-projection (wo_a): o[T, NH, hd] → inverse RoPE → [T, G, R] ------------------------
@torch.library.custom_op(f"{LIB}::nvfp4_grouped_oproj", mutates_args=())
def nvfp4_grouped_oproj(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, runner_id: int
) -> torch.Tensor:
    return get_runner(runner_id).run(o, positions, cos_sin_cache)


@nvfp4_grouped_oproj.register_fake
def _(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, runner_id: int):
    r = get_runner(runner_id)
    return o.new_empty((o.shape[0], r.n_groups, r.r), dtype=r.out_dtype)


# --- shared expert: x[M, H] → down(swiglu_clamp(gate_up(x))) [M, H] -----------------------------
@torch.library.custom_op(f"{LIB}::nvfp4_shared_mlp", mutates_args=())
def nvfp4_shared_mlp(x: torch.Tensor, runner_id: int) -> torch.Tensor:
    return get_runner(runner_id).run(x)


@nvfp4_shared_mlp.register_fake
def _(x: torch.Tensor, runner_id: int) -> torch.Tensor:
    r = get_runner(runner_id)
    return x.new_empty((x.shape[0], r.h), dtype=r.out_dtype)


# --- routed experts: out[M, H] = Σ_j w[m, j] · expert_{ids[m, j]}(x[m]) (writes vLLM's buffer) ---
@torch.library.custom_op(f"{LIB}::nvfp4_moe", mutates_args=("out",))
def nvfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    runner_id: int,
) -> None:
    get_runner(runner_id).run(x, topk_ids, topk_weights, out)


@nvfp4_moe.register_fake
def _(x, topk_ids, topk_weights, out, runner_id) -> None:
    return None
