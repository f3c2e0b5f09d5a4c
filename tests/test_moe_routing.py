"""`cutedsl.sm90.routing.route` / `combine`: the contract on the CPU (torch path), and on a CUDA GPU the
CuTeDSL kernels of `cutedsl.sm90.kernels.moe_routing` against it (any arch: SIMT kernels).

The route checker below states the contract independently of either implementation: every local
assignment owns exactly one sorted row inside its expert's segment, offs is the exclusive prefix
sum of the per-expert counts, tok names each row's token (non-local assignments fill the rows
past offs[E]), inv is -1 exactly for the non-local assignments. The combine reference sums
w[m, s] * y[inv[s, m]] in float64; the fp32 slot-order statement must match it to bf16 rounding and
the kernel must match the CPU statement bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import fresh_gen

from cutedsl.sm90.routing import MAX_E, combine, route, route_reserve
from cutedsl.workspace import Workspace


def check_route(ids: torch.Tensor, e: int, offs, tok, inv) -> None:
    """The route contract (vectorized, so it also runs for ~100k assignments)."""
    ids, offs, tok, inv = (t.cpu().long() for t in (ids, offs, tok, inv))
    m, k = ids.shape
    local = (ids >= 0) & (ids < e)
    n = int(local.sum())
    assert inv.shape == (k, m) and tok.shape == (m * k,) and offs.shape == (e + 1,)
    counts = torch.bincount(ids[local], minlength=e)
    assert offs.tolist() == [0, *torch.cumsum(counts, 0).tolist()], "offs"
    rows = inv.T[local]  # the rows of the local assignments, (m, s) order
    assert torch.equal(torch.sort(rows).values, torch.arange(n)), "a row twice or missing"
    assert (inv.T[~local] == -1).all(), "non-local assignment with a row"
    expert_of_row = torch.searchsorted(offs, rows, right=True) - 1
    assert torch.equal(expert_of_row, ids[local]), "row outside its expert's segment"
    token = torch.arange(m)[:, None].expand(m, k)
    assert torch.equal(tok[rows], token[local]), "tok of a local row"
    assert torch.equal(torch.sort(tok[n:]).values, torch.sort(token[~local]).values), "non-local"


def _ids(case: str, m: int, k: int, e: int, g: torch.Generator) -> torch.Tensor:
    if case == "random":  # -1 and >= E are both "not local"
        return torch.randint(-1, e + 3, (m, k), generator=g).int()
    if case == "distinct":  # vLLM's shape: k distinct experts per token, some dropped
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
        ids[torch.rand(m, k, generator=g) < 0.2] = -1
        return ids
    if case == "one_expert":
        return torch.full((m, k), e - 1, dtype=torch.int32)
    if case == "empty_experts":  # only the first and the last expert get rows
        return torch.where(torch.rand(m, k, generator=g) < 0.5, 0, e - 1).int()
    if case == "none_local":
        return torch.full((m, k), -1, dtype=torch.int32)
    raise ValueError(case)


CASES = ["random", "distinct", "one_expert", "empty_experts", "none_local"]


# ------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("m", "k", "e"), [(1, 1, 1), (1, 6, 8), (37, 6, 16), (200, 8, 300)])
def test_route_cpu_contract(case: str, m: int, k: int, e: int) -> None:
    g = fresh_gen()
    ids = _ids(case, m, k, e, g)
    check_route(ids, e, *route(ids, e))


def test_route_rejects_too_many_experts() -> None:
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"1..{MAX_E}"):
        route(ids, MAX_E + 1)
    check_route(ids, MAX_E, *route(ids, MAX_E))


def _combine_ref64(y, inv, w) -> torch.Tensor:
    """float64 Σ_s w[m, s] · y[inv[s, m]] over the local slots, by explicit loops."""
    k, m = inv.shape
    out = torch.zeros(m, y.shape[1], dtype=torch.float64)
    for t in range(m):
        for s in range(k):
            r = int(inv[s, t])
            if r >= 0:
                out[t] += float(w[t, s]) * y[r].double()
    return out


@pytest.mark.parametrize(("m", "k", "h"), [(1, 1, 8), (9, 6, 64), (33, 8, 520)])
def test_combine_cpu_matches_float64_reference(m: int, k: int, h: int) -> None:
    """Route random ids, fill y's routed rows with expert outputs and every other row with NaN
    (never read), then combine: within bf16 rounding of the float64 sum, and NaN-free."""
    g = fresh_gen()
    e = 5
    ids = _ids("random", m, k, e, g)
    offs, tok, inv = route(ids, e)
    y = torch.full((m * k, h), float("nan"), dtype=torch.bfloat16)
    n = int(offs[-1])
    y[:n] = (torch.randn(n, h, generator=g) * 3).bfloat16()
    w = torch.rand(m, k, generator=g)
    out = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    assert combine(y, inv, w, out) is out
    want = _combine_ref64(y, inv, w)
    assert torch.isfinite(out).all()
    err = (out.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-6).all(), err.max()  # one bf16 rounding (+ fp32 sum)
    dropped = ~((ids >= 0) & (ids < e)).any(1)
    assert (out[dropped] == 0).all()


def test_combine_cpu_is_slot_order_fp32() -> None:
    """The exact fp32 statement: acc = acc + fl(w·y), s = 0, 1, ... (what the kernel computes)."""
    g = fresh_gen()
    m, k, h = 7, 6, 16
    ids = _ids("distinct", m, k, 8, g)
    _, _, inv = route(ids, 8)
    y = (torch.randn(m * k, h, generator=g) * 100).bfloat16()
    w = torch.rand(m, k, generator=g)
    out = combine(y, inv, w, torch.empty(m, h, dtype=torch.bfloat16))
    for t in range(m):
        acc = torch.zeros(h)
        for s in range(k):
            if inv[s, t] >= 0:
                acc = acc + w[t, s] * y[inv[s, t]].float()
        assert torch.equal(out[t], acc.bfloat16())


def test_route_then_combine_is_the_moe_sum() -> None:
    """End to end on toy experts: expert x maps a row r to (x + 1) · r; the grouped-by-expert
    y through combine equals Σ_s w[m, s] · (ids[m, s] + 1) · x[m] (float64)."""
    g = fresh_gen()
    m, k, e, h = 29, 6, 11, 32
    ids = _ids("distinct", m, k, e, g)
    x = torch.randn(m, h, generator=g).bfloat16()
    w = torch.rand(m, k, generator=g)
    offs, tok, inv = route(ids, e)
    a = x[tok.long()]  # the gather of the runner
    scale = torch.searchsorted(offs, torch.arange(m * k), right=True) - 1 + 1.0  # expert + 1
    y = (a.double() * scale[:, None]).bfloat16()  # rows past offs[E]: garbage, never read
    out = combine(y, inv, w, torch.empty(m, h, dtype=torch.bfloat16))
    local = (ids >= 0) & (ids < e)
    coef = torch.where(local, w.double() * (ids + 1).double(), 0.0)
    want = coef.sum(1)[:, None] * x.double()
    err = (out.double() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err


# ------------------------------------------------------------------------------ GPU


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    ("m", "k", "e"),
    [(1, 1, 1), (1, 6, 256), (24, 6, 16), (4096, 8, 384), (16667, 6, 256), (20000, 6, 1024)],
)
def test_route_kernel_contract(case: str, m: int, k: int, e: int) -> None:
    """The route kernel on fresh ids (T = 1 .. ~120k, E up to 1024), against the contract and the
    CPU path's offs (the order inside an expert may differ)."""
    g = fresh_gen()
    ids = _ids(case, m, k, e, g)
    ws = Workspace("cuda", "t")
    route_reserve(ws, m * k, e)
    for b in ws._bufs.values():
        b.fill_(0x7F)  # poison: every output entry must be written
    offs, tok, inv = route(ids.cuda(), e, ws)
    torch.cuda.synchronize()
    check_route(ids, e, offs, tok, inv)
    assert torch.equal(offs.cpu(), route(ids, e)[0])
    # int64 ids go through the int32 copy
    got = route(ids.long().cuda(), e, ws)
    check_route(ids, e, *got)


@gpu
@pytest.mark.parametrize(
    ("m", "k", "h"),
    [
        (1, 6, 512),
        (37, 6, 2048),
        (300, 8, 4096),
        (64, 6, 7168),
        (2, 1, 8),
        (5, 3, 1032),
        (3, 9, 520),
        (4, 17, 64),
    ],
)
def test_combine_kernel_is_bitwise_the_cpu_statement(m: int, k: int, h: int) -> None:
    """Routed ids with drops, y with NaN in every row not named by inv: the kernel's output equals
    the CPU torch statement bit for bit, and two launches agree. topk below, at and past the
    kernel's slot group (8), H whose column vectors do not fill the last CTA."""
    g = fresh_gen()
    e = 32
    ids = _ids("random", m, k, e, g)
    offs, _, inv = route(ids, e)
    n = int(offs[-1])
    y = torch.full((m * k, h), float("nan"), dtype=torch.bfloat16)
    y[:n] = (torch.randn(n, h, generator=g) * 4).bfloat16()
    w = torch.rand(m, k, generator=g)
    want = combine(y, inv, w, torch.empty(m, h, dtype=torch.bfloat16))
    yc, ic, wc = y.cuda(), inv.cuda(), w.cuda()
    outs = []
    for _ in range(2):
        out = torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        combine(yc, ic, wc, out)
        outs.append(out.cpu())
    assert torch.equal(outs[0], want)
    assert torch.equal(outs[1], want)


@gpu
def test_route_and_combine_capture_and_allocate_nothing() -> None:
    """Route + combine on workspace buffers: no caching-allocator allocation once compiled, and a
    captured CUDA graph replays correctly on fresh ids and weights written into the same inputs."""
    from cutedsl.sm90.routing import precompile

    g = fresh_gen()
    m, k, e, h = 96, 6, 64, 1024
    precompile()
    ws = Workspace("cuda", "t")
    route_reserve(ws, m * k, e)
    ids = _ids("distinct", m, k, e, g).cuda()
    w = torch.rand(m, k, generator=g).cuda()
    y = torch.randn(m * k, h, device="cuda").bfloat16()
    out = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")

    def step():
        _, _, inv = route(ids, e, ws)
        combine(y, inv, w, out)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after == before, f"{after - before} allocations"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in ("distinct", "one_expert", "none_local"):
        fresh = _ids(case, m, k, e, g)
        ids.copy_(fresh)
        w.copy_(torch.rand(m, k, generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # the replay's own results (routing again could order the rows differently)
        offs = ws.get("route.offs", (e + 1,), torch.int32)
        tok = ws.get("route.tok", (m * k,), torch.int32)
        inv = ws.get("route.inv", (k, m), torch.int32)
        check_route(fresh, e, offs, tok, inv)
        want = combine(y.cpu(), inv.cpu(), w.cpu(), torch.empty(m, h, dtype=torch.bfloat16))
        assert torch.equal(out.cpu(), want)
