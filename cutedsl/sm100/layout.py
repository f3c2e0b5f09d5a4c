"""Pure-torch layouts of the SM100 launchers: what rows of the GEMM's A operand hold, and how
results come back. Runs on a CPU and never imports `cutlass`.

Legend: M tokens, H hidden size, E experts, topk experts per token, G o-proj groups, T tokens of
the o-projection, D = K of one group, R = out rows of one group.

O-projection (wo_a): group g's T tokens are rows [g*padded_T, g*padded_T + T) of A, padded_T =
round_up(max(T, 1), 128); the quant kernel reads the (T, G, D) input in place (no permute) and
writes zeros to the pad rows; the GEMM writes the (T, G, R) output in place through
`oproj_out_view`. `oproj_to_groups` / `oproj_from_groups` are the materialised reference forms.

MoE: expert e owns rows [offs[e-1], offs[e]) of one grouped A (offs[-1] = 0), a segment of
round_up(count_e, 128) rows, sized by `moe_max_rows` so the grid never depends on the routing.
`moe_layout` computes (offs, dest) on the device with no host sync; `moe_gather` fills A;
`moe_combine` sums each token's weighted expert rows in fp32. Each takes an optional
`cutedsl.workspace.Workspace` holding its scratch and result (reserved at warm-up by the
`*_reserve` functions); without one it allocates.
"""

from __future__ import annotations

import torch

from cutedsl import formats
from cutedsl.validate import check_tensor
from cutedsl.workspace import Workspace

TILE_M = 128  # the GEMM's M tile: row padding of o-proj groups and MoE experts

# Rows per chunk of `moe_combine`'s fp32 scratch (bounds it to COMBINE_CHUNK x H fp32).
COMBINE_CHUNK = 4096

# --------------------------------------------------------------------------- o-proj


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


# --------------------------------------------------------------------------- MoE


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
    check_tensor("topk_ids", topk_ids, (None, None), (torch.int32, torch.int64))
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
