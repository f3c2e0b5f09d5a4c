"""Launch the SM90 NVFP4 W4A16 GEMMs (`cutedsl.sm90.kernels.gemm`) on torch tensors.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), G groups (wo_a),
E experts, T routed rows (MoE).

  linear(a[M, K], wp) -> [M, N]                     (attention projections, MLPs; a row-strided)
  grouped(a[G, M, K], wp(G groups)) -> [G, M, N]                  (wo_a; a, out strided views)
  moe(a[T, K], offs[E+1] int32 on the device, wp(E groups)) -> [T, N]   (routed experts)
  moe(..., swiglu=True, swiglu_limit=L) -> [T, N/2]   (routed w13 in `swiglu_row_order`, with
      the clamped SwiGLU in its epilogue: the bits of moe() then `cutedsl.sm90.swiglu`)

BF16 activations and outputs, fp32 accumulation; `wp` is a `cutedsl.sm90.weight.Weight`. Without a
forced `tactic`, a launch takes `tactics.launch_tactic` for its M on its GPU. A
`tactics.StreamTactic` (forced, or named by the GPU's tuned table for a dense / grouped M) runs
the launch on the streaming decode kernel (`cutedsl.sm90.kernels.stream`: same operands, another
summation order): a dense / grouped one of at most its `tokens` rows, or a MoE one (no fused
SwiGLU) in tiles of `tokens` rows per expert.
Compile cache: `cutedsl.jit`, keyed on the compile-time values only (the Tactic, the MoE flag and a
fused SwiGLU's limit);
M, N, K, the group count, strides and addresses are runtime values (fake tensors with symbolic
extents), so one compile serves every token count and routing. CUDA graphs: `precompile` the
tactics (the runners' `warmup(max_tokens)` does) before capture; a launch allocates only the
outputs not given (split-K reduces through distributed shared memory: no scratch), never syncs
with the host and never compiles once warm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cutedsl import jit
from cutedsl.sm90.tactics import (
    MAX_GRID_Y,
    TILE_M_VERIFIED,
    StreamTactic,
    Tactic,
    gpu_spec,
    launch_tactic,
    moe_tile_bound,
)
from cutedsl.sm90.weight import Weight
from cutedsl.validate import ROWS_NEED, check_tensor, rows_addressable


def _build(
    tile_n: int,
    tile_m: int,
    split_k: int,
    moe: bool,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
    no_jit_engine: bool = False,
) -> object:
    from cutedsl.sm90.kernels.gemm import compile_kernel

    return compile_kernel(
        tile_n, tile_m, split_k, moe, no_jit_engine=no_jit_engine, swiglu=swiglu,
        swiglu_limit=swiglu_limit,
    )  # fmt: skip


def _check_moe_grid(rows: int, experts: int, tile: int, what: str) -> None:
    """Raise unless a MoE launch of `rows` rows in token tiles of `tile` fits the grid's y."""
    bound = moe_tile_bound(rows, experts, tile)
    if bound > MAX_GRID_Y:
        raise ValueError(
            f"a: {rows} rows in token tiles of {tile} give up to {bound} MoE tiles, over the "
            f"grid limit {MAX_GRID_Y}; use a larger {what}"
        )


def _build_stream(
    rows: int,
    tokens: int,
    warps: int,
    depth: int,
    moe: bool = False,
    ctas: int = 0,
    res: int = 0,
    no_jit_engine: bool = False,
) -> object:
    from cutedsl.sm90.kernels.stream import compile_kernel

    return compile_kernel(
        rows, tokens, warps, depth, moe, ctas=ctas, res=res, no_jit_engine=no_jit_engine
    )


def _stream_kwargs(t: StreamTactic) -> dict:
    """The build's keyword arguments of a streaming configuration: none for one CTA per row
    block (so its cache key has none), the persistent grid's bound and resident slots
    otherwise (each only when set)."""
    return {k: v for k, v in (("ctas", t.ctas), ("res", t.res)) if v}


def stream_jobs(tactics: Iterable[StreamTactic], moe: bool = False) -> list[jit.Job]:
    """The `jit.Job` of each streaming decode configuration (dense / grouped, or MoE), in a
    stable order."""
    return [
        jit.Job(
            _build_stream,
            (t.rows, t.tokens, t.warps, t.depth, moe),
            tuple(sorted(_stream_kwargs(t).items())),
        )
        for t in sorted(tactics)
    ]


def _launch_stream(
    a3: torch.Tensor, wp: Weight, out3: torch.Tensor, offs: torch.Tensor | None,
    tactic: StreamTactic,
) -> None:  # fmt: skip
    """Check a StreamTactic against the launch, then run it."""
    from cutedsl.sm90.kernels.stream import Sm90Nvfp4StreamGemmKernel as K

    err = K.config_error(
        tactic.rows, tactic.tokens, tactic.warps, tactic.depth, tactic.ctas, tactic.res
    )
    if err:
        raise ValueError(f"tactic {tactic}: {err}")
    per_warp = -(-(wp.k // 64) // tactic.warps)  # K tiles of the busiest warp
    if tactic.res and per_warp > tactic.res:
        raise ValueError(
            f"tactic {tactic}: K = {wp.k} gives {per_warp} K tiles per warp, "
            f"over its {tactic.res} resident activation slots"
        )
    m = a3.shape[1]
    moe = offs is not None
    if moe:
        _check_moe_grid(m, wp.groups, tactic.tokens, "tokens")
    if moe and m * max(wp.k, wp.n) >= 2**31:  # the kernel's activation / output offsets: int32
        raise ValueError(f"a: {m} rows of {max(wp.k, wp.n)} elements exceed 2^31 elements")
    if not moe and m > tactic.tokens:
        raise ValueError(f"a: {m} rows, tactic {tactic} takes at most {tactic.tokens}")
    if not K.can_implement(wp.n, wp.k, tactic.rows):
        raise ValueError(f"tactic {tactic}: N = {wp.n} is not a multiple of {tactic.rows} rows")
    args = (tactic.rows, tactic.tokens, tactic.warps, tactic.depth, moe)
    jit.compiled(_build_stream, *args, **_stream_kwargs(tactic))(
        *kernel_operands(a3, wp, out3, offs)
    )


def _epilogue_kwargs(swiglu: bool, swiglu_limit: float | None) -> dict:
    """The build's keyword arguments of an epilogue: none for the plain bf16 store (so its cache
    key has none), the fused SwiGLU's flag and limit otherwise."""
    return {"swiglu": True, "swiglu_limit": swiglu_limit} if swiglu else {}


def kernel(
    tactic: Tactic, moe: bool, swiglu: bool = False, swiglu_limit: float | None = None
) -> object:
    """The compiled kernel of one tactic (compiled or loaded on first use; `jit`)."""
    kw = _epilogue_kwargs(swiglu, swiglu_limit)
    return jit.compiled(_build, tactic.tile_n, tactic.tile_m, tactic.split_k, moe, **kw)


def jobs(
    tactics: Iterable[tuple[Tactic | StreamTactic, bool]],
    swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> list[jit.Job]:
    """The `jit.Job` of each (tactic, moe) variant with one epilogue, in a stable order (the
    tiled kernel's, then the streaming kernel's, which has only the plain epilogue)."""
    kw = tuple(sorted(_epilogue_kwargs(swiglu, swiglu_limit).items()))
    tactics = list(tactics)
    tiled = sorted((t, moe) for t, moe in tactics if isinstance(t, Tactic))
    stream = sorted((t, moe) for t, moe in tactics if isinstance(t, StreamTactic))
    if stream and swiglu:
        raise NotImplementedError(f"tactic {stream[0][0]}: the streaming kernel has no SwiGLU")
    out = [jit.Job(_build, (t.tile_n, t.tile_m, t.split_k, moe), kw) for t, moe in tiled]
    for moe in (False, True):
        out += stream_jobs([t for t, m in stream if m == moe], moe)
    return out


def precompile(
    tactics: Iterable[tuple[Tactic | StreamTactic, bool]],
    swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> None:
    """Compile (or load) (tactic, moe) variants before CUDA-graph capture."""
    jit.ensure(jobs(tactics, swiglu, swiglu_limit))


def _check_a(a: torch.Tensor, ndim: int, k: int) -> None:
    check_tensor("a", a, (None,) * (ndim - 1) + (k,), (torch.bfloat16,), contiguous=True)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Raise unless `rows_addressable(t)`."""
    if not rows_addressable(t):
        raise ValueError(
            f"{name}: strides {list(t.stride())} (start at byte {t.data_ptr() % 16} mod 16), "
            f"expected {ROWS_NEED}"
        )


_DUMMY: dict[tuple, torch.Tensor] = {}


def _dummy(device: torch.device, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    key = (device, shape, dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def _launch(
    a3: torch.Tensor,  # (La, M, K) bf16, `_check_rows`
    wp: Weight,
    out3: torch.Tensor,  # (La, M, N) bf16, `_check_rows`
    offs: torch.Tensor | None,
    tactic: Tactic | StreamTactic | None,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> None:
    """Launch one GEMM (split-K tactics reduce in a thread-block cluster: no scratch); with
    `swiglu`, out3 has N / 2 columns."""
    la, m, k = a3.shape
    moe = offs is not None
    if tactic is None:
        tactic = launch_tactic(m, wp.n, k, wp.groups, moe, gpu_spec(a3.device))
    if isinstance(tactic, StreamTactic):
        if swiglu:
            raise NotImplementedError(f"tactic {tactic}: the streaming kernel has no SwiGLU")
        _launch_stream(a3, wp, out3, offs, tactic)
        return
    if tactic.tile_m not in TILE_M_VERIFIED:
        raise ValueError(f"tactic {tactic}: tile_m {tactic.tile_m} not in {TILE_M_VERIFIED}")
    if moe and tactic.split_k != 1:
        raise NotImplementedError(f"tactic {tactic}: split-K with MoE offsets is not wired")
    if moe:
        _check_moe_grid(m, wp.groups, tactic.tile_m, "tile_m")
    kernel(tactic, moe, swiglu, swiglu_limit)(*kernel_operands(a3, wp, out3, offs))


def kernel_operands(
    a3: torch.Tensor,  # (La, M, K) bf16, `_check_rows`
    wp: Weight,
    out3: torch.Tensor,  # (La, M, N) bf16, `_check_rows`
    offs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The operands of a compiled kernel (`cutedsl.sm90.kernels.gemm.compile_kernel`) as views:
    a (M, K, La), w (N, K/2, L), sf (N, K/64, L), gs, out (N, M, La), offs (a dummy unless MoE)."""
    offs_t = offs if offs is not None else _dummy(a3.device, (1,), torch.int32)
    return (
        a3.permute(1, 2, 0),
        wp.w.permute(1, 2, 0),
        wp.sf.permute(2, 1, 0),
        wp.gs,
        out3.permute(2, 1, 0),
        offs_t,
    )


def linear(
    a: torch.Tensor,  # (M, K) bf16, `validate.rows_addressable` (e.g. a column slice)
    wp: Weight,  # one group
    out: torch.Tensor | None = None,  # (M, N) bf16
    tactic: Tactic | StreamTactic | None = None,
) -> torch.Tensor:
    """out = a @ dequant(wp)^T, fp32 accumulation, BF16 out. M may be 0. The kernel reads the
    rows of `a` through its row stride: a column slice of a wider tensor needs no copy."""
    if wp.groups != 1:
        raise ValueError(f"wp: {wp.groups} groups, expected 1 (use grouped)")
    check_tensor("a", a, (None, wp.k), (torch.bfloat16,))
    _check_rows("a", a)
    m = a.shape[0]
    if out is None:
        out = a.new_empty((m, wp.n))
    if m == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, m, wp.n), None, tactic)
    return out


def grouped(
    a: torch.Tensor,  # (G, M, K) bf16, `_check_rows` (e.g. x[T, G, K].transpose(0, 1))
    wp: Weight,  # G groups
    out: torch.Tensor | None = None,  # (G, M, N) bf16, `_check_rows`
    tactic: Tactic | StreamTactic | None = None,
) -> torch.Tensor:
    """out[g] = a[g] @ dequant(wp[g])^T for G equal groups (wo_a). a and out are strided views:
    a token-major [T, G, K] input and [T, G, N] output need no copies."""
    check_tensor("a", a, (wp.groups, None, wp.k), (torch.bfloat16,))
    _check_rows("a", a)
    g, m, _ = a.shape
    if out is None:
        out = a.new_empty((g, m, wp.n))
    check_tensor("out", out, (g, m, wp.n), (torch.bfloat16,))
    _check_rows("out", out)
    if m == 0:
        return out
    _launch(a, wp, out, None, tactic)
    return out


def moe(
    a: torch.Tensor,  # (T, K) bf16, rows grouped by expert
    offs: torch.Tensor,  # (E+1,) int32 on the device: expert e owns rows [offs[e], offs[e+1])
    wp: Weight,  # E groups
    out: torch.Tensor | None = None,  # (T, N) bf16; with swiglu (T, N/2)
    tactic: Tactic | StreamTactic | None = None,
    *,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ dequant(wp[e])^T. One compile serves every routing; rows
    outside [offs[0], offs[E]) are not written.
    With `swiglu`, wp is a w13 in `cutedsl.sm90.weight.swiglu_row_order` and out[:, i] is the
    clamped SwiGLU (limit `swiglu_limit`, None: no clamp) of gate i and up i, each rounded to
    bf16 first: the bits `cutedsl.sm90.swiglu.swiglu_clamp` gives on the unfused output."""
    _check_a(a, 2, wp.k)
    check_tensor("offs", offs, (wp.groups + 1,), (torch.int32,))
    t = a.shape[0]
    n_out = wp.n // 2 if swiglu else wp.n
    if out is None:
        out = a.new_empty((t, n_out))
    check_tensor("out", out, (t, n_out), (torch.bfloat16,), a.device, contiguous=True)
    if t == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, t, n_out), offs, tactic, swiglu, swiglu_limit)
    return out
