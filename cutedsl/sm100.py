"""Host side of the SM100 (Blackwell) native NVFP4 kernels: compile cache, argument packing,
layouts, and launch functions taking torch tensors.

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), E experts, G o-proj
groups, T tokens of the o-projection, D = K of one group, R = out rows of one group, I the
intermediate size, topk experts per token.

Two halves:
1. Pure torch, importable and testable on a CPU (no `cutlass` import): weight preparation
   (blocked scales, interleaved w13), the o-projection layout ((T, G, D) -> (G, T, D) at padded
   offsets and back), the MoE layout (per-expert padded segments and their device offsets),
   gather/combine, and `emulate_gemm` / `expected_quant`, torch statements of exactly what the
   kernels compute on exactly the buffers they are given.
2. GPU launchers (`quantize_act`, `gemm`, `nvfp4_linear_sm100`, `nvfp4_grouped_oproj_sm100`,
   `nvfp4_moe_sm100`): import `cutlass` lazily, compile once per compile-time key
   (`compile_key`), never key on shapes or addresses (every extent is a runtime argument), and
   make no host sync and no host tensor per call (scales stay on the device; sizes come from
   tensor shapes). Compile before CUDA-graph capture (`warmup`). Given a `cutedsl.workspace`
   (`ws=`, reserved by `quant_reserve` / `moe_reserve` at warm-up) every intermediate is a view
   of it (the MoE layout, gathered rows, NVFP4 activations, h, y, the fp32 combine
   accumulator); only the outputs not given are allocated. Without one they are allocated.

Conventions: global scales are dequant multipliers (checkpoint `weight_scale_2`, `input_scale`),
so alpha = input_scale * weight_scale_2, an fp32 device tensor ((1,), (G,) or (E,)).
The SM100 MoE path quantizes all routed tokens with ONE a13 input scale and ONE a2 input scale
(vLLM collapses per-expert input scales to their max the same way); w13/w2 global scales are
per expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from cutedsl import formats
from cutedsl.workspace import Workspace

TILE_M = 128  # GEMM M tile = row padding of groups and experts
TILE_N = 128
TILE_K = 256

# --------------------------------------------------------------------------- checks


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    _check(
        t.dtype == dtype and t.ndim == ndim,
        f"{name}: {t.dtype} with shape {tuple(t.shape)}, expected {dtype} with {ndim} dims",
    )


# --------------------------------------------------------------------------- weights (CPU ok)


def blocked_scale_offset(row: torch.Tensor, blk: torch.Tensor, kb: int) -> torch.Tensor:
    """Byte offset of scale (row, blk) in the 128x4 blocked layout of a (rows, kb) matrix.

    The same expression the quant kernel uses to place each scale byte (kb % 4 == 0)."""
    rr = row % 128
    return ((row // 128) * (kb // 4) + blk // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + blk % 4


def prepare_weight(w_packed: torch.Tensor, w_sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint NVFP4 weight -> kernel operands.

    w_packed: uint8 [..., N, K//2]; w_sf: e4m3 [..., N, K//16] linear. Returns (packed, contiguous;
    blocked scales e4m3 [..., N, K//16], each leading index swizzled on its own). N % 128 == 0 and
    K % 256 == 0 (the kernel's constraints), so the blocked layout needs no padding.
    """
    *_, n, kh = w_packed.shape
    _check(n % TILE_N == 0, f"w_packed: N = {n}, expected a multiple of {TILE_N}")
    _check((2 * kh) % TILE_K == 0, f"w_packed: K = {2 * kh}, expected a multiple of {TILE_K}")
    _check(
        tuple(w_sf.shape) == (*w_packed.shape[:-1], 2 * kh // 16),
        f"w_sf: shape {tuple(w_sf.shape)}, expected {(*w_packed.shape[:-1], 2 * kh // 16)}",
    )
    return w_packed.contiguous(), formats.swizzle_scales(w_sf.view(torch.float8_e4m3fn))


def interleave_w13(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with rows (w1/gate 0..I-1, w3/up 0..I-1) -> rows (g0, u0, g1, u1, ...).

    Applied to the packed weight and its LINEAR scales before `prepare_weight`; the fused SwiGLU
    epilogue reads accumulator column 2i as gate i and 2i+1 as up i."""
    *lead, r2, x = t.shape
    _check(r2 % 2 == 0, f"w13: shape {tuple(t.shape)}, expected an even row count 2I")
    i = r2 // 2
    return t.reshape(*lead, 2, i, x).transpose(-3, -2).reshape(*lead, r2, x).contiguous()


def deinterleave_w13(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_w13`."""
    *lead, r2, x = t.shape
    i = r2 // 2
    return t.reshape(*lead, i, 2, x).transpose(-3, -2).reshape(*lead, r2, x).contiguous()


# --------------------------------------------------------------------------- o-proj layout


def oproj_padded_t(t: int) -> int:
    """Rows per group of the grouped wo_a operand: round_up(max(T, 1), 128)."""
    return formats.round_up(max(t, 1), TILE_M)


def oproj_to_groups(x: torch.Tensor, padded_t: int) -> torch.Tensor:
    """(T, G, D) -> (G*padded_T, D): group g's tokens at rows [g*padded_T, g*padded_T + T), zeros
    after. Reference layout of what the quant kernel reads in place (the kernel itself never
    materialises this permute: it reads x with strides (G*D, 1, D))."""
    t, g, d = x.shape
    out = x.new_zeros((g, padded_t, d))
    out[:, :t] = x.permute(1, 0, 2)
    return out.reshape(g * padded_t, d)


def oproj_from_groups(y: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """(G*padded_T, R) -> (T, G, R): the inverse extraction (drops the pad rows)."""
    r = y.shape[-1]
    return y.reshape(g, -1, r)[:, :t].permute(1, 0, 2).contiguous()


def oproj_out_view(out: torch.Tensor) -> torch.Tensor:
    """(T, G, R) output -> the (T, R, G) strided view the GEMM epilogue writes in place."""
    return out.permute(0, 2, 1)


def expected_quant(
    x: torch.Tensor, gs: torch.Tensor, padded_t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `quantize_act` writes for x (T, G, D) (or (T, D): G = 1): (codes uint8
    (G*padded_T, D//2), blocked scales e4m3 (G*padded_T, D//16)), from `cutedsl.formats`."""
    if x.ndim == 2:
        x = x[:, None]
    t, g, d = x.shape
    q, sf, _ = formats.quantize_nvfp4(x.permute(1, 0, 2).float(), gs.reshape(()))
    q_out = torch.zeros((g, padded_t, d // 2), dtype=torch.uint8, device=x.device)
    q_out[:, :t] = q
    return q_out.reshape(g * padded_t, d // 2), formats.assemble_group_scales(sf, padded_t)


# --------------------------------------------------------------------------- MoE layout


def moe_max_rows(m: int, topk: int, e: int) -> int:
    """Upper bound of the padded rows of all experts: sum_e round_up(c_e, 128) with
    sum_e c_e <= M*topk. Sizing buffers with it keeps the grid routing-independent."""
    return formats.round_up(m * topk + e * (TILE_M - 1), TILE_M)


def moe_layout_reserve(ws: Workspace, m: int, topk: int, e: int) -> None:
    """Warm-up: reserve the index buffers of `moe_layout`, `moe_gather` and `moe_combine` in `ws`
    for up to m tokens (`moe_combine_reserve` adds its (M, H)-sized ones)."""
    t, rows = m * topk, moe_max_rows(m, topk, e)
    for name in ("key", "sorted", "order", "rank", "ar", "kc", "dest", "tok", "dc"):
        ws.reserve(f"layout.{name}", (t,), torch.int64)
    ws.reserve("layout.inv", (t,), torch.bool)
    for name in ("bounds", "lt"):
        ws.reserve(f"layout.{name}", (e + 1,), torch.int64)
    for name in ("counts", "offs64", "spad"):
        ws.reserve(f"layout.{name}", (e,), torch.int64)
    ws.reserve("layout.offs", (e,), torch.int32)
    ws.reserve("gather.src", (rows + 1,), torch.int64)
    ws.reserve("gather.pad", (rows + 1,), torch.bool)
    ws.reserve("combine.w", (t,), torch.float32)


def moe_layout(
    topk_ids: torch.Tensor, e: int, ws: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing -> (offs int32 (E,), dest int64 (M*topk,)), device ops only (no host sync).

    Expert e owns rows [offs[e-1], offs[e]) of the grouped A (offs[-1] = 0), a segment of
    round_up(count_e, 128) rows; its tokens come first in (token, slot) order. dest[j] is the row
    of assignment j = m*topk + slot, or -1 where topk_ids is -1 (not a local expert).
    With `ws` (`moe_layout_reserve`) both results and all scratch are views of it.
    """
    _check(
        topk_ids.ndim == 2 and topk_ids.dtype in (torch.int32, torch.int64),
        f"topk_ids: {topk_ids.dtype} {tuple(topk_ids.shape)}, expected int32/int64 [M, topk]",
    )
    m, topk = topk_ids.shape
    t = m * topk
    if ws is None:  # CPU / reference callers: scratch for this call only
        ws = Workspace(topk_ids.device, "moe_layout")
        moe_layout_reserve(ws, m, topk, e)
    i64 = torch.int64
    key, inv = ws.get("layout.key", (t,), i64), ws.get("layout.inv", (t,), torch.bool)
    key.view(m, topk).copy_(topk_ids)
    torch.lt(key, 0, out=inv)
    key.masked_fill_(inv, e)  # -1 -> bucket e (dropped)
    srt, order = ws.get("layout.sorted", (t,), i64), ws.get("layout.order", (t,), i64)
    torch.sort(key, stable=True, out=(srt, order))
    # lt[x] = #keys < x: starts_raw = lt[:e], counts = lt[1:] - lt[:e] (searchsorted, not
    # bincount: CUDA bincount reads max() on the host, a sync, not capturable).
    bounds, lt = ws.get("layout.bounds", (e + 1,), i64), ws.get("layout.lt", (e + 1,), i64)
    torch.arange(e + 1, out=bounds)
    torch.searchsorted(srt, bounds, out=lt)
    padded = ws.get("layout.counts", (e,), i64)
    torch.sub(lt[1:], lt[:e], out=padded)
    padded.add_(TILE_M - 1).floor_divide_(TILE_M).mul_(TILE_M)
    offs64, spad = ws.get("layout.offs64", (e,), i64), ws.get("layout.spad", (e,), i64)
    torch.cumsum(padded, 0, out=offs64)
    torch.sub(offs64, padded, out=spad)  # padded start of each expert
    rank, ar = ws.get("layout.rank", (t,), i64), ws.get("layout.ar", (t,), i64)
    torch.arange(t, out=ar)
    rank.index_copy_(0, order, ar)  # rank[order[i]] = i
    kc, dest = ws.get("layout.kc", (t,), i64), ws.get("layout.dest", (t,), i64)
    torch.clamp(key, max=e - 1, out=kc)
    torch.index_select(spad, 0, kc, out=dest)
    dest.add_(rank)
    torch.index_select(lt[:e], 0, kc, out=ar)  # ar: raw start of each assignment's expert
    dest.sub_(ar)
    dest.masked_fill_(inv, -1)
    offs = ws.get("layout.offs", (e,), torch.int32)
    offs.copy_(offs64)
    return offs, dest


def moe_gather(
    x: torch.Tensor,
    dest: torch.Tensor,
    topk: int,
    rows: int,
    ws: Workspace | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, H) -> grouped A input (rows, H): row dest[m*topk+s] = x[m]; other rows zero.
    With `ws`, scratch comes from it; `out` (rows, H) receives the result (allocated if None)."""
    t = dest.numel()
    i64 = torch.int64
    if ws is None:
        ws = Workspace(x.device, "moe_gather")
        moe_gather_reserve(ws, t, rows)
    src, pad = ws.get("gather.src", (rows + 1,), i64), ws.get("gather.pad", (rows + 1,), torch.bool)
    dc, inv = ws.get("layout.dc", (t,), i64), ws.get("layout.inv", (t,), torch.bool)
    tok = ws.get("layout.tok", (t,), i64)
    torch.lt(dest, 0, out=inv)
    dc.copy_(dest)
    dc.masked_fill_(inv, rows)  # the extra row `rows` absorbs the -1 (not local) entries
    torch.arange(t, out=tok)
    tok.floor_divide_(topk)
    src.zero_()
    pad.fill_(True)
    src.index_copy_(0, dc, tok)  # src[row] = token feeding it
    pad.index_fill_(0, dc, False)
    if out is None:
        out = x.new_empty((rows, x.shape[1]))
    torch.index_select(x, 0, src[:rows], out=out)
    out.masked_fill_(pad[:rows, None], 0)
    return out


# Rows per chunk of `moe_combine`'s fp32 scratch (bounds it to COMBINE_CHUNK x H fp32).
COMBINE_CHUNK = 4096


def moe_combine(
    y: torch.Tensor, dest: torch.Tensor, topk_weights: torch.Tensor, ws: Workspace | None = None
) -> torch.Tensor:
    """Grouped output y (rows, H) -> (M, H) fp32: out[m] = sum_s w[m, s] * y[dest[m*topk+s]].
    With `ws`, the result is its "combine.acc" view (valid until the next call)."""
    m, topk = topk_weights.shape
    t, hid = m * topk, y.shape[1]
    if ws is None:
        ws = Workspace(y.device, "moe_combine")
        moe_gather_reserve(ws, t, 0)
        ws.reserve("combine.w", (t,), torch.float32)
        moe_combine_reserve(ws, m, topk, hid, y.dtype)
    i64 = torch.int64
    dc, inv = ws.get("layout.dc", (t,), i64), ws.get("layout.inv", (t,), torch.bool)
    tok, w = ws.get("layout.tok", (t,), i64), ws.get("combine.w", (t,), torch.float32)
    torch.lt(dest, 0, out=inv)
    torch.clamp(dest, min=0, out=dc)
    torch.arange(t, out=tok)
    tok.floor_divide_(topk)
    w.view(m, topk).copy_(topk_weights)
    acc = ws.get("combine.acc", (m, hid), torch.float32).zero_()
    c = min(t, COMBINE_CHUNK)
    rows, prod = ws.get("combine.rows", (c, hid), y.dtype), ws.get("f32", (c, hid), torch.float32)
    for r0 in range(0, t, c):
        r1 = min(t, r0 + c)
        g, p = rows[: r1 - r0], prod[: r1 - r0]
        torch.index_select(y, 0, dc[r0:r1], out=g)
        p.copy_(g)
        p.mul_(w[r0:r1, None])
        p.masked_fill_(inv[r0:r1, None], 0.0)  # masked, not a 0-weight product: pad rows may be NaN
        acc.index_add_(0, tok[r0:r1], p)
    return acc


def moe_gather_reserve(ws: Workspace, t: int, rows: int) -> None:
    """The scratch of `moe_gather` for t = M*topk assignments into `rows` grouped rows."""
    for name in ("dc", "tok"):
        ws.reserve(f"layout.{name}", (t,), torch.int64)
    ws.reserve("layout.inv", (t,), torch.bool)
    ws.reserve("gather.src", (rows + 1,), torch.int64)
    ws.reserve("gather.pad", (rows + 1,), torch.bool)


def moe_combine_reserve(
    ws: Workspace, m: int, topk: int, hid: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Warm-up: the (M, H)-sized buffers of `moe_combine` (y rows of `dtype`)."""
    c = min(m * topk, COMBINE_CHUNK)
    ws.reserve("combine.acc", (m, hid), torch.float32)
    ws.reserve("combine.rows", (c, hid), dtype)
    ws.reserve("f32", (c, hid), torch.float32)


# --------------------------------------------------------------------------- kernel contract


def emulate_gemm(
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
) -> None:
    """Torch statement of `Sm100Nvfp4GemmKernel` on the very buffers `gemm` passes it.

    a: uint8 (L*M_a, K//2); a_sf: blocked e4m3 (L*pad128(M_a), K//16); b: uint8 (L_b*N, K//2);
    b_sf: blocked e4m3 (L_b*N, K//16); alpha fp32 (L_b,); out: bf16 (M_c, N_out, L) view.
    Batched (offs None): L = out.shape[2], L_b = L, rows >= M_c untouched. Grouped: L = 1,
    offs (E,) segment ends, L_b = E, rows past offs[-1] untouched.
    """
    m_c, _, lc = out.shape
    kb = k // 16
    m_sf = formats.round_up(m_a, TILE_M)
    l_b = alpha.shape[0]
    n = b.shape[0] // l_b
    a_f = formats.dequantize_nvfp4(
        a.reshape(-1, m_a, k // 2),
        formats.unswizzle_scales(a_sf, a_sf.shape[0], k).reshape(-1, m_sf, kb)[:, :m_a],
        1.0,
        torch.float32,
    )
    b_f = formats.dequantize_nvfp4(
        b.reshape(l_b, n, k // 2),
        torch.stack([formats.unswizzle_scales(s, n, k) for s in b_sf.reshape(l_b, n, kb)]),
        1.0,
        torch.float32,
    )
    if offs is None:
        acc = torch.einsum("lmk,lnk->lmn", a_f[:, :m_c], b_f) * alpha[:, None, None]
        segs = [(lidx, 0, m_c, lidx) for lidx in range(lc)]
    else:
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        acc = torch.empty((1, m_a, n), dtype=torch.float32, device=a.device)
        for ex, (s, en) in enumerate(zip(starts, ends)):
            acc[0, s:en] = (a_f[0, s:en] @ b_f[ex].T) * alpha[ex]
        segs = [(0, s, en, 0) for s, en in zip(starts, ends)]
    if swiglu_limit is not None:
        lim = swiglu_limit
        g = acc[..., 0::2].clamp(max=lim)
        u = acc[..., 1::2].clamp(min=-lim, max=lim)
        acc = torch.nn.functional.silu(g) * u
    for lidx, s, en, li in segs:
        out[s:en, :, li] = acc[lidx, s:en].to(out.dtype)


# --------------------------------------------------------------------------- compile cache


def compile_key(kind: str, **codegen) -> tuple:
    """Compile-cache key: the kernel kind, its codegen arguments, the arch and the DSL version.
    Never shapes, strides or addresses (those are runtime arguments)."""
    import os

    try:
        from importlib.metadata import version

        dsl = version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - metadata missing only in odd installs
        dsl = "unknown"
    arch = os.environ.get("CUTE_DSL_ARCH", "sm_100a")
    return (kind, tuple(sorted(codegen.items())), arch, dsl)


_CACHE: dict[tuple, object] = {}


def _compiled(kind: str, build: Callable[[], object], **codegen) -> object:
    key = compile_key(kind, **codegen)
    fn = _CACHE.get(key)
    if fn is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{key}: not compiled before CUDA-graph capture; call warmup()")
        fn = _CACHE[key] = build()
    return fn


def get_gemm(grouped: bool = False, swiglu_limit: float | None = None) -> object:
    from cutedsl.kernels import gemm_sm100

    return _compiled(
        "gemm",
        functools.partial(gemm_sm100.compile_gemm, grouped, swiglu_limit, TILE_N),
        grouped=grouped,
        swiglu_limit=swiglu_limit,
        tile_n=TILE_N,
    )


def get_quant() -> object:
    from cutedsl.kernels import quant_sm100

    return _compiled("quant", quant_sm100.compile_quant)


def warmup(swiglu_limit: float | None = 10.0) -> None:
    """Compile every variant the launchers use (before any CUDA-graph capture)."""
    get_quant()
    for grouped in (False, True):
        get_gemm(grouped)
        if swiglu_limit is not None:
            get_gemm(grouped, swiglu_limit)


# --------------------------------------------------------------------------- GPU launchers


def _ptr(dtype, t: torch.Tensor, align: int = 16):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def quantize_act(
    x: torch.Tensor, gs: torch.Tensor, padded_t: int, q: torch.Tensor, sf: torch.Tensor
) -> None:
    """Quantize x (T, D) or (T, G, D) bf16 (D contiguous, read in place) into q uint8
    (G*padded_T, D//2) and sf e4m3 (G*padded_T, D//16) blocked; gs fp32 (1,) or 0-dim device."""
    import cutlass

    x3 = x[:, None] if x.ndim == 2 else x
    t, g, d = x3.shape
    _check(x3.dtype == torch.bfloat16 and x3.stride(2) == 1, "x: expected bf16, D contiguous")
    _check(
        x3.stride(0) % 8 == 0 and (g == 1 or x3.stride(1) % 8 == 0) and x3.data_ptr() % 16 == 0,
        f"x: strides {x3.stride()}, expected 16 B aligned rows and groups",
    )
    _check(d % 64 == 0, f"x: D = {d}, expected a multiple of 64")
    _check(padded_t % TILE_M == 0 and padded_t >= t, f"padded_t: {padded_t}, expected >= {t}")
    _check(tuple(q.shape) == (g * padded_t, d // 2), f"q: shape {tuple(q.shape)}")
    _check(tuple(sf.shape) == (g * padded_t, d // 16), f"sf: shape {tuple(sf.shape)}")
    get_quant()(
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
) -> None:
    """Launch `Sm100Nvfp4GemmKernel`; the arguments are those of :func:`emulate_gemm`."""
    import cutlass

    from cutedsl.kernels import gemm_sm100 as g

    m_c, n_out, lc = out.shape
    l_b = alpha.shape[0]
    n = b.shape[0] // l_b
    _check(out.dtype == torch.bfloat16 and out.stride(1) == 1, "out: expected bf16, N contiguous")
    _check(
        out.stride(0) % 8 == 0 and (lc == 1 or out.stride(2) % 8 == 0),
        f"out: strides {out.stride()}, expected row/group strides divisible by 8 (16 B)",
    )
    _check(n_out == (n // 2 if swiglu_limit is not None else n), f"out: N_out = {n_out}, N = {n}")
    grouped = offs is not None
    _check(g.Sm100Nvfp4GemmKernel.can_implement(
        m_a, m_c, n, k, grouped=grouped, swiglu=swiglu_limit is not None, e=l_b
    ), f"gemm: unsupported shape m_a={m_a} m_c={m_c} n={n} k={k} e={l_b}")  # fmt: skip
    _check(alpha.dtype == torch.float32, f"alpha: dtype {alpha.dtype}, expected float32")
    fn = get_gemm(grouped, swiglu_limit)
    fn(
        _ptr(g.AB_DTYPE, a),
        _ptr(g.AB_DTYPE, b),
        _ptr(g.SF_DTYPE, a_sf),
        _ptr(g.SF_DTYPE, b_sf),
        _ptr(g.C_DTYPE, out),
        _ptr(cutlass.Float32, alpha, 4),
        _ptr(cutlass.Int32, offs if grouped else alpha, 4),
        m_a,
        m_c,
        n,
        k,
        1 if grouped else lc,
        l_b,
        out.stride(0),
        out.stride(2) if lc > 1 else 0,  # a size-1 mode's stride is never used
        _stream(),
    )


def nvfp4_linear_sm100(
    x: torch.Tensor,
    w: torch.Tensor,
    w_sf: torch.Tensor,
    input_scale: torch.Tensor,
    alpha: torch.Tensor,
    swiglu_limit: float | None = None,
    out: torch.Tensor | None = None,
    ws: Workspace | None = None,
) -> torch.Tensor:
    """y = alpha * quant(x) . w^T (W4A4). x: bf16 (M, K); w, w_sf from `prepare_weight`
    ((N, K//2), blocked (N, K//16)); input_scale, alpha: fp32 (1,) device. Returns bf16 (M, N),
    or (M, N//2) with the fused SwiGLU (w13 interleaved). The quantized x ("q", "sf") lives in
    `ws` if given (`quant_reserve`), else is allocated."""
    m, k = x.shape
    n = w.shape[0]
    n_out = n // 2 if swiglu_limit is not None else n
    if out is None:
        out = x.new_empty((m, n_out))
    if m == 0:
        return out
    pm = formats.round_up(m, TILE_M)
    q, sf = _quant_bufs(x, ws, pm, k)
    quantize_act(x, input_scale, pm, q, sf)
    gemm(q, sf, w, w_sf, alpha, out[:, :, None], m_a=pm, k=k, swiglu_limit=swiglu_limit)
    return out


def nvfp4_grouped_oproj_sm100(
    x: torch.Tensor,
    w: torch.Tensor,
    w_sf: torch.Tensor,
    input_scale: torch.Tensor,
    alpha: torch.Tensor,
    out: torch.Tensor | None = None,
    ws: Workspace | None = None,
) -> torch.Tensor:
    """wo_a: out[t, g] = alpha[g] * quant(x[t, g]) . W_g^T. x: bf16 (T, G, D), read in place;
    w: uint8 (G*R, D//2) and w_sf blocked (G*R, D//16) from `prepare_weight` (R % 128 == 0);
    alpha fp32 (G,) (or (1,) expanded). Returns bf16 (T, G, R), written in place (no permute)."""
    t, g, d = x.shape
    r = w.shape[0] // g
    if out is None:
        out = x.new_empty((t, g, r))
    if t == 0:
        return out
    pt = oproj_padded_t(t)
    q, sf = _quant_bufs(x, ws, g * pt, d)
    quantize_act(x, input_scale, pt, q, sf)
    gemm(q, sf, w, w_sf, alpha.expand(g).contiguous(), oproj_out_view(out), m_a=pt, k=d)
    return out


def nvfp4_moe_sm100(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_sf: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    a13_scale: torch.Tensor,
    a2_scale: torch.Tensor,
    alpha13: torch.Tensor,
    alpha2: torch.Tensor,
    limit: float = 10.0,
    ws: Workspace | None = None,
) -> torch.Tensor:
    """Routed experts, W4A4: gather -> quant -> grouped L1 + fused clamped SwiGLU -> quant ->
    grouped L2 -> weighted combine. With `ws` (`moe_reserve`) every intermediate and the result
    are views of it (the result is valid until the next call). w13: uint8 (E*2I, H//2) interleaved (`interleave_w13`), w13_sf
    blocked (E*2I, H//16); w2 (E*H, I//2), w2_sf (E*H, I//16); a13/a2_scale fp32 (1,);
    alpha13 = a13_scale*w13_gs (E,), alpha2 = a2_scale*w2_gs (E,). Returns fp32 (M, H)."""
    m, hid = x.shape
    e = alpha13.shape[0]
    i2 = w13.shape[0] // e
    topk = topk_ids.shape[1]
    rows = moe_max_rows(m, topk, e)
    if ws is None:
        ws = Workspace(x.device, "moe")
        moe_reserve(ws, m, topk, e, hid, i2 // 2)
    ws.get("combine.acc", (m, hid), torch.float32)  # a too-large M fails before any launch
    offs, dest = moe_layout(topk_ids, e, ws)
    a = moe_gather(x, dest, topk, rows, ws, out=ws.get("a", (rows, hid), torch.bfloat16))
    q, sf = _quant_bufs(x, ws, rows, hid)
    quantize_act(a, a13_scale, rows, q, sf)
    h = ws.get("h", (rows, i2 // 2), torch.bfloat16).zero_()
    gemm(q, sf, w13, w13_sf, alpha13, h[:, :, None], m_a=rows, k=hid, offs=offs, swiglu_limit=limit)
    q2, sf2 = _quant_bufs(x, ws, rows, i2 // 2)
    quantize_act(h, a2_scale, rows, q2, sf2)
    y = ws.get("a", (rows, hid), torch.bfloat16).zero_()  # a is dead: y reuses its memory
    gemm(q2, sf2, w2, w2_sf, alpha2, y[:, :, None], m_a=rows, k=i2 // 2, offs=offs)
    return moe_combine(y, dest, topk_weights, ws)


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
    """Warm-up: every buffer `nvfp4_moe_sm100` takes from `ws` for up to m tokens (H = hid,
    intermediate size I = i)."""
    rows = moe_max_rows(m, topk, e)
    moe_layout_reserve(ws, m, topk, e)
    moe_combine_reserve(ws, m, topk, hid)
    ws.reserve("a", (rows, hid), torch.bfloat16)
    ws.reserve("h", (rows, i), torch.bfloat16)
    quant_reserve(ws, rows, max(hid, i))
