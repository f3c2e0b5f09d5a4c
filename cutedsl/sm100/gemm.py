"""GPU launchers of the SM100 (sm_100a) NVFP4 kernels, taking torch tensors.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), E experts, G o-proj
groups, T tokens of the o-projection, D = K of one group, R = out rows of one group, H hidden
size, I the intermediate size, topk experts per token.

Two kernel launches (`cutedsl.sm100.kernels`):
- `quantize_act`: bf16 activations -> NVFP4 codes + blocked e4m3 scales (`Sm100Nvfp4QuantKernel`),
  with one static per-tensor input scale.
- `gemm`: the block-scaled NVFP4 x NVFP4 -> bf16 GEMM (`Sm100Nvfp4GemmKernel`), batched or
  grouped by expert, optionally with the fused clamped SwiGLU; `cutedsl.sm100.emulate` states both
  in torch on the same buffers.
and one step per runner built from them: `linear` (one GEMM, optionally with the fused SwiGLU),
`grouped` (the wo_a o-projection, one GEMM per group on the (T, G, D) input read in place) and
`moe` (gather -> quant -> grouped L1 + SwiGLU -> quant -> grouped L2 -> weighted combine).

`quantize_act` and `gemm` check every argument against the kernel's contract, then hand the very
buffers to a `Kernels`: `CUTEDSL` launches the compiled CuTeDSL kernels (sm_100a);
`cutedsl.sm100.emulate.EMULATED` runs each kernel's torch statement on them instead (the
`sm100-emulated` backend, any device). Everything else is the same code for both.

Rules:
- `cutlass` is imported lazily, inside the launchers: this module imports on a CPU.
- Kernels compile through `cutedsl.jit.compiled`, keyed on their codegen arguments only
  (grouped, swiglu_limit, tile_n): every extent and stride is a runtime argument, so one compile
  serves every M. `precompile` compiles every variant; call it before CUDA-graph capture.
- No host sync and no host tensor per call: scales and alphas stay on the device, sizes come
  from tensor shapes.
- Every step takes `kernels=` (default `CUTEDSL`) and passes it to each launch.
- Given a `cutedsl.workspace.Workspace` (`ws=`, reserved at warm-up by `quant_reserve` /
  `moe_reserve`) every intermediate is a view of it (the MoE layout, gathered rows, NVFP4
  activations, h, y, the fp32 combine accumulator); only outputs not passed in are allocated.
  Without one, intermediates are allocated.

Conventions: global scales are dequant multipliers (checkpoint `weight_scale_2`, `input_scale`),
so alpha = input_scale * weight_scale_2, an fp32 device tensor ((1,), (G,) or (E,)). The MoE step
quantizes all routed tokens with ONE a13 and ONE a2 input scale (vLLM collapses per-expert input
scales to their max the same way); w13 / w2 alphas are per expert.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cutedsl import formats, jit
from cutedsl.sm100.layout import (
    TILE_M,
    moe_combine,
    moe_combine_reserve,
    moe_gather,
    moe_layout,
    moe_layout_reserve,
    moe_max_rows,
    oproj_out_view,
    oproj_padded_t,
)
from cutedsl.sm100.weight import TILE_N, Weight
from cutedsl.validate import require
from cutedsl.workspace import Workspace

# --------------------------------------------------------------------------- compile


def _gemm_kernel(grouped: bool, swiglu_limit: float | None) -> object:
    from cutedsl.sm100.kernels import gemm as gemm_kernels

    return jit.compiled(gemm_kernels.compile_gemm, grouped, swiglu_limit, TILE_N)


def _quant_kernel() -> object:
    from cutedsl.sm100.kernels import quant as quant_kernels

    return jit.compiled(quant_kernels.compile_quant)


def precompile(swiglu_limit: float | None = 10.0) -> None:
    """Compile every kernel variant the launchers use: the quant kernel, and the batched and
    grouped GEMM without and (unless `swiglu_limit` is None) with the fused SwiGLU at
    `swiglu_limit`. Call before any CUDA-graph capture."""
    _quant_kernel()
    for grouped in (False, True):
        _gemm_kernel(grouped, None)
        if swiglu_limit is not None:
            _gemm_kernel(grouped, swiglu_limit)


# --------------------------------------------------------------------------- kernel launches


class Kernels(Protocol):
    """The two kernel launches of the runner steps, on arguments `quantize_act` / `gemm` have
    checked (what each writes: `emulate.expected_quant`, `emulate.emulate_gemm`)."""

    name: str

    def precompile(self, swiglu_limit: float | None) -> None:
        """Compile what the launches need (before any CUDA-graph capture)."""

    def quant(
        self, x3: torch.Tensor, gs: torch.Tensor, padded_t: int, q: torch.Tensor, sf: torch.Tensor
    ) -> None:
        """`Sm100Nvfp4QuantKernel` on x3 (T, G, D) bf16 -> q, sf (`quantize_act`)."""

    def gemm(
        self,
        a: torch.Tensor,
        a_sf: torch.Tensor,
        b: torch.Tensor,
        b_sf: torch.Tensor,
        alpha: torch.Tensor,
        out: torch.Tensor,
        *,
        m_a: int,
        k: int,
        offs: torch.Tensor | None,
        swiglu_limit: float | None,
    ) -> None:
        """`Sm100Nvfp4GemmKernel` -> out (`gemm`)."""


def _ptr(dtype, t: torch.Tensor, align: int = 16):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class _CuteDslKernels:
    """The compiled CuTeDSL kernels on the current CUDA stream (raw pointers + runtime extents)."""

    name = "cutedsl"

    def precompile(self, swiglu_limit: float | None) -> None:
        precompile(swiglu_limit)

    def quant(self, x3, gs, padded_t, q, sf) -> None:
        import cutlass

        t, g, d = x3.shape
        _quant_kernel()(
            _ptr(cutlass.BFloat16, x3),
            _ptr(cutlass.Uint32, q),
            _ptr(cutlass.Uint8, sf),
            _ptr(cutlass.Float32, gs, 4),
            t,
            padded_t,
            d,
            g,
            x3.stride(0),
            x3.stride(1) if g > 1 else 0,  # a size-1 mode's stride is never used
            _stream(),
        )

    def gemm(self, a, a_sf, b, b_sf, alpha, out, *, m_a, k, offs, swiglu_limit) -> None:
        import cutlass

        from cutedsl.sm100.kernels import gemm as g

        m_c, _, lc = out.shape
        l_b = alpha.shape[0]
        grouped = offs is not None
        _gemm_kernel(grouped, swiglu_limit)(
            _ptr(g.AB_DTYPE, a),
            _ptr(g.AB_DTYPE, b),
            _ptr(g.SF_DTYPE, a_sf),
            _ptr(g.SF_DTYPE, b_sf),
            _ptr(g.C_DTYPE, out),
            _ptr(cutlass.Float32, alpha, 4),
            _ptr(cutlass.Int32, offs if grouped else alpha, 4),
            m_a,
            m_c,
            b.shape[0] // l_b,
            k,
            1 if grouped else lc,
            l_b,
            out.stride(0),
            out.stride(2) if lc > 1 else 0,  # a size-1 mode's stride is never used
            _stream(),
        )


CUTEDSL: Kernels = _CuteDslKernels()


def _require_operand(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    """A raw kernel operand: exactly `shape`, one of `dtypes`, contiguous (the kernels address
    it with compact strides from its pointer)."""
    require(
        tuple(t.shape) == shape and t.dtype in dtypes and t.is_contiguous(),
        f"{name}: {t.dtype} shape {tuple(t.shape)} strides {t.stride()}, expected a contiguous "
        f"{' or '.join(str(d) for d in dtypes)} tensor of shape {shape}",
    )


_SF_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def quantize_act(
    x: torch.Tensor,
    gs: torch.Tensor,
    padded_t: int,
    q: torch.Tensor,
    sf: torch.Tensor,
    kernels: Kernels = CUTEDSL,
) -> None:
    """Launch `Sm100Nvfp4QuantKernel`: x (T, D) or (T, G, D) bf16 (D contiguous, read in place)
    -> q uint8 (G*padded_T, D//2) and sf e4m3 bytes (G*padded_T, D//16) blocked per group, pad
    rows zero; gs fp32 (1,) or 0-dim device input scale. What it writes: `emulate.expected_quant`.
    Requires D % 64 == 0, padded_T % 128 == 0, padded_T >= T, 16 B aligned rows and groups;
    q, sf contiguous."""
    x3 = x[:, None] if x.ndim == 2 else x
    t, g, d = x3.shape
    require(x3.dtype == torch.bfloat16 and x3.stride(2) == 1, "x: expected bf16, D contiguous")
    require(
        x3.stride(0) % 8 == 0 and (g == 1 or x3.stride(1) % 8 == 0) and x3.data_ptr() % 16 == 0,
        f"x: strides {x3.stride()}, expected 16 B aligned rows and groups",
    )
    require(d % 64 == 0, f"x: D = {d}, expected a multiple of 64")
    require(padded_t % TILE_M == 0 and padded_t >= t, f"padded_t: {padded_t}, expected >= {t}")
    require(
        gs.dtype == torch.float32 and gs.numel() == 1 and gs.device == x.device,
        f"gs: {gs.dtype} {tuple(gs.shape)} on {gs.device}, expected one fp32 on {x.device}",
    )
    _require_operand("q", q, (g * padded_t, d // 2), (torch.uint8,))
    _require_operand("sf", sf, (g * padded_t, d // 16), _SF_DTYPES)
    kernels.quant(x3, gs, padded_t, q, sf)


def gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor,
    *,
    m_a: int,
    k: int,
    offs: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    kernels: Kernels = CUTEDSL,
) -> None:
    """Launch `Sm100Nvfp4GemmKernel` on raw operands; the arguments and what it writes are those
    of `emulate.emulate_gemm`. Raises ValueError for an operand the kernel would misread (shape,
    dtype, not contiguous) or a shape it cannot take (`Sm100Nvfp4GemmKernel.can_implement`)."""
    from cutedsl.sm100.kernels import gemm as g

    m_c, n_out, lc = out.shape
    grouped = offs is not None
    require(
        alpha.dtype == torch.float32 and alpha.ndim == 1 and alpha.is_contiguous(),
        f"alpha: {alpha.dtype} shape {tuple(alpha.shape)}, expected contiguous float32 (L,) / (E,)",
    )
    l_b = alpha.shape[0]
    require(l_b >= 1 and b.shape[0] % l_b == 0, f"b: {b.shape[0]} rows for {l_b} alphas")
    n = b.shape[0] // l_b
    require(out.dtype == torch.bfloat16 and out.stride(1) == 1, "out: expected bf16, N contiguous")
    require(
        out.stride(0) % 8 == 0 and (lc == 1 or out.stride(2) % 8 == 0),
        f"out: strides {out.stride()}, expected row/group strides divisible by 8 (16 B)",
    )
    if grouped:
        require(lc == 1, f"out: {lc} groups, a grouped GEMM writes one (M_c, N_out, 1)")
        _require_operand("offs", offs, (l_b,), (torch.int32,))
    else:
        require(l_b == lc, f"alpha: {l_b} values, expected one per output group ({lc})")
    require(n_out == (n // 2 if swiglu_limit is not None else n), f"out: N_out = {n_out}, N = {n}")
    l_a = 1 if grouped else lc
    _require_operand("a", a, (l_a * m_a, k // 2), (torch.uint8,))
    _require_operand("a_sf", a_sf, (l_a * formats.round_up(m_a, TILE_M), k // 16), _SF_DTYPES)
    _require_operand("b", b, (l_b * n, k // 2), (torch.uint8,))
    _require_operand("b_sf", b_sf, (l_b * n, k // 16), _SF_DTYPES)
    require(g.Sm100Nvfp4GemmKernel.can_implement(
        m_a, m_c, n, k, grouped=grouped, swiglu=swiglu_limit is not None, e=l_b
    ), f"gemm: unsupported shape m_a={m_a} m_c={m_c} n={n} k={k} e={l_b}")  # fmt: skip
    kernels.gemm(a, a_sf, b, b_sf, alpha, out, m_a=m_a, k=k, offs=offs, swiglu_limit=swiglu_limit)


# --------------------------------------------------------------------------- runner steps


def linear(
    x: torch.Tensor,
    w: Weight,
    input_scale: torch.Tensor,
    alpha: torch.Tensor,
    swiglu_limit: float | None = None,
    out: torch.Tensor | None = None,
    ws: Workspace | None = None,
    kernels: Kernels = CUTEDSL,
) -> torch.Tensor:
    """y = alpha * quant(x) . W^T (W4A4). x: bf16 (M, K), rows 16 B aligned; w: one group
    (`prepare_weight`); input_scale, alpha: fp32 (1,) device. Returns bf16 (M, N), or (M, N//2)
    with the fused SwiGLU (w13 interleaved, `interleave_w13`), in `out` if given. The quantized
    x ("q", "sf") lives in `ws` if given (`quant_reserve`), else is allocated."""
    m, k = x.shape
    n = w.n
    n_out = n // 2 if swiglu_limit is not None else n
    if out is None:
        out = x.new_empty((m, n_out))
    if m == 0:
        return out
    pm = formats.round_up(m, TILE_M)
    q, sf = _quant_bufs(x, ws, pm, k)
    quantize_act(x, input_scale, pm, q, sf, kernels)
    gemm(
        q, sf, w.w, w.sf, alpha, out[:, :, None], m_a=pm, k=k, swiglu_limit=swiglu_limit,
        kernels=kernels,
    )  # fmt: skip
    return out


def grouped(
    x: torch.Tensor,
    w: Weight,
    input_scale: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor | None = None,
    ws: Workspace | None = None,
    kernels: Kernels = CUTEDSL,
) -> torch.Tensor:
    """wo_a: out[t, g] = alpha[g] * quant(x[t, g]) . W_g^T. x: bf16 (T, G, D), read in place;
    w: G groups of R rows (`prepare_weight(..., groups=G)`, R % 128 == 0); input_scale fp32 (1,);
    alpha fp32 (G,) or (1,) (expanded). Returns bf16 (T, G, R), written in place through
    `oproj_out_view` (no permute), in `out` if given. The quantized x lives in `ws` if given."""
    t, g, d = x.shape
    require(w.groups == g, f"x: {g} groups, the weight has {w.groups}")
    r = w.n
    if out is None:
        out = x.new_empty((t, g, r))
    if t == 0:
        return out
    pt = oproj_padded_t(t)
    q, sf = _quant_bufs(x, ws, g * pt, d)
    quantize_act(x, input_scale, pt, q, sf, kernels)
    alpha = alpha.expand(g).contiguous()
    gemm(q, sf, w.w, w.sf, alpha, oproj_out_view(out), m_a=pt, k=d, kernels=kernels)
    return out


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Weight,
    w2: Weight,
    a13_scale: torch.Tensor,
    a2_scale: torch.Tensor,
    alpha13: torch.Tensor,
    alpha2: torch.Tensor,
    limit: float = 10.0,
    ws: Workspace | None = None,
    kernels: Kernels = CUTEDSL,
) -> torch.Tensor:
    """Routed experts, W4A4: gather -> quant -> grouped L1 + fused clamped SwiGLU (`limit`) ->
    quant -> grouped L2 -> weighted combine. x: bf16 (M, H); topk_ids int32/int64 (M, topk), -1 =
    not a local expert; topk_weights (M, topk). w13: E groups of 2I interleaved rows
    (`interleave_w13`, then `prepare_weight`), K = H; w2: E groups of H rows, K = I;
    a13_scale / a2_scale fp32 (1,); alpha13 = a13_scale * w13_gs (E,), alpha2 = a2_scale * w2_gs
    (E,). Returns fp32 (M, H). With `ws` (`moe_reserve`) every intermediate and the result are
    views of it (the result is valid until the next call); a too-large M raises
    `cutedsl.workspace.WorkspaceError` before any launch."""
    m, hid = x.shape
    e, i2 = w13.groups, w13.n
    topk = topk_ids.shape[1]
    rows = moe_max_rows(m, topk, e)
    if ws is None:
        ws = Workspace(x.device, "moe")
        moe_reserve(ws, m, topk, e, hid, i2 // 2)
    ws.get("combine.acc", (m, hid), torch.float32)  # a too-large M fails before any launch
    offs, dest = moe_layout(topk_ids, e, ws)
    a = moe_gather(x, dest, topk, rows, ws, out=ws.get("a", (rows, hid), torch.bfloat16))
    q, sf = _quant_bufs(x, ws, rows, hid)
    quantize_act(a, a13_scale, rows, q, sf, kernels)
    h = ws.get("h", (rows, i2 // 2), torch.bfloat16).zero_()
    gemm(
        q, sf, w13.w, w13.sf, alpha13, h[:, :, None], m_a=rows, k=hid, offs=offs,
        swiglu_limit=limit, kernels=kernels,
    )  # fmt: skip
    q2, sf2 = _quant_bufs(x, ws, rows, i2 // 2)
    quantize_act(h, a2_scale, rows, q2, sf2, kernels)
    y = ws.get("a", (rows, hid), torch.bfloat16).zero_()  # a is dead: y reuses its memory
    gemm(
        q2, sf2, w2.w, w2.sf, alpha2, y[:, :, None], m_a=rows, k=i2 // 2, offs=offs,
        kernels=kernels,
    )  # fmt: skip
    return moe_combine(y, dest, topk_weights, ws)


# --------------------------------------------------------------------------- workspace


def quant_reserve(ws: Workspace, rows: int, k: int) -> None:
    """Warm-up: the NVFP4 activation buffers ("q" (rows, K//2), "sf" (rows, K//16) uint8)."""
    ws.reserve("q", (rows, k // 2), torch.uint8)
    ws.reserve("sf", (rows, k // 16), torch.uint8)


def _quant_bufs(
    x: torch.Tensor, ws: Workspace | None, rows: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if ws is None:
        return (x.new_empty((rows, k // 2), dtype=torch.uint8),
                x.new_empty((rows, k // 16), dtype=torch.uint8))  # fmt: skip
    return ws.get("q", (rows, k // 2), torch.uint8), ws.get("sf", (rows, k // 16), torch.uint8)


def moe_reserve(ws: Workspace, m: int, topk: int, e: int, hid: int, i: int) -> None:
    """Warm-up: every buffer `moe` takes from `ws` for up to m tokens (H = hid, intermediate
    size I = i)."""
    rows = moe_max_rows(m, topk, e)
    moe_layout_reserve(ws, m, topk, e)
    moe_combine_reserve(ws, m, topk, hid)
    ws.reserve("a", (rows, hid), torch.bfloat16)
    ws.reserve("h", (rows, i), torch.bfloat16)
    quant_reserve(ws, rows, max(hid, i))
