"""Tensor/expert-parallel slicing of NVFP4 checkpoint tensors, on the CPU.

vLLM shards a column-parallel NVFP4 linear along N (packed rows and their block-scale rows), a
row-parallel one along K (packed bytes K/2 and block-scale columns K/16, so a shard's K must be a
multiple of 32), keeps the per-tensor global scales whole, and gives each EP rank a subset of
experts. A rank's runner then sees only its slice. These tests check that each slice dequantizes
to the slice of the dequantized full weight, and that runners on the slices reassemble the full
result (concatenation for column shards, sum of partial products for row shards, sum over EP
ranks with non-local experts as -1).
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_data import fresh_gen

from cutedsl import formats
from cutedsl.linear import Nvfp4Linear
from cutedsl.moe import Nvfp4MoE


def _column_shard(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n]


def _row_shard(packed: torch.Tensor, sf: torch.Tensor, rank: int, tp: int):
    k = packed.shape[1] * 2
    ks = k // tp
    if ks % 32:
        raise ValueError(f"K shard {ks} is not a multiple of 32 (16-element blocks, 2 per byte)")
    return (
        packed[:, rank * ks // 2 : (rank + 1) * ks // 2],
        sf[:, rank * ks // 16 : (rank + 1) * ks // 16],
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_dequantize_to_slices(tp: int) -> None:
    g = fresh_gen()
    n, k = 256, 512
    packed, sf, gs = formats.quantize_nvfp4(torch.randn(n, k, generator=g))
    full = formats.dequantize_nvfp4(packed, sf, gs, torch.float32)
    for r in range(tp):
        col = formats.dequantize_nvfp4(
            _column_shard(packed, r, tp), _column_shard(sf, r, tp), gs, torch.float32
        )
        assert torch.equal(col, _column_shard(full, r, tp))
        p, s = _row_shard(packed, sf, r, tp)
        row = formats.dequantize_nvfp4(p, s, gs, torch.float32)
        assert torch.equal(row, full[:, r * k // tp : (r + 1) * k // tp])


def test_row_shard_refuses_split_blocks() -> None:
    packed, sf, _ = formats.quantize_nvfp4(torch.randn(16, 48))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        _row_shard(packed, sf, 0, 3)


# A rank's slice through a real backend on one GPU.
BACKENDS = ["reference", pytest.param("sm90", marks=pytest.mark.sm90)]


def _dev(backend: str) -> torch.device:
    return torch.device("cpu" if backend == "reference" else "cuda")


def _warm(runner, max_tokens: int):
    """GPU backends compile and reserve their workspaces here (a call without it raises
    WorkspaceError, as on the H200 run of 2026-12-02 before this was added)."""
    runner.warmup(max_tokens)
    return runner


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [2])
def test_linear_runners_on_shards_reassemble(tp: int, backend: str) -> None:
    g, dev = fresh_gen(), _dev(backend)
    n, k, m = 256, 512, 7
    wq = [t.to(dev) for t in formats.quantize_nvfp4(torch.randn(n, k, generator=g))]
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
    # The full, unsharded weight through the torch reference: what every rank must add up to.
    want = Nvfp4Linear(*[t.cpu() for t in wq], backend="reference")(x.cpu()).float()
    col = torch.cat(
        [
            _warm(
                Nvfp4Linear(
                    _column_shard(wq[0], r, tp).contiguous(),
                    _column_shard(wq[1], r, tp).contiguous(),
                    wq[2],
                    backend=backend,
                ),
                m,
            )(x).cpu()
            for r in range(tp)
        ],
        dim=1,
    )
    if backend == "reference":
        assert torch.equal(col.float(), want)  # disjoint outputs: bit-identical
    else:
        torch.testing.assert_close(
            col.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item()
        )
    parts = []
    for r in range(tp):
        p, s = (t.contiguous() for t in _row_shard(wq[0], wq[1], r, tp))
        xs = x[:, r * k // tp : (r + 1) * k // tp].contiguous()
        kw = {"out_dtype": torch.float32} if backend == "reference" else {}
        lin = _warm(Nvfp4Linear(p, s, wq[2], backend=backend, **kw), m)
        parts.append(lin(xs).float().cpu())
    torch.testing.assert_close(sum(parts), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_parallel_ranks_sum_to_the_full_moe(backend: str) -> None:
    g, dev = fresh_gen(), _dev(backend)
    e, ep, h, i, m, k = 8, 2, 128, 128, 9, 3
    w = torch.randn(e, 2 * i, h, generator=g)
    w13 = formats.quantize_nvfp4(w, formats.global_scale_from_amax(w.abs().amax(dim=(1, 2))))
    w2_ = torch.randn(e, h, i, generator=g) * 0.5
    w2 = formats.quantize_nvfp4(w2_, formats.global_scale_from_amax(w2_.abs().amax(dim=(1, 2))))
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    tw = torch.rand(m, k, generator=g)
    full = torch.empty(m, h, dtype=torch.bfloat16)
    Nvfp4MoE(*w13, None, *w2, None, backend="reference")(x, ids, tw, full)
    total = torch.zeros(m, h)
    per = e // ep
    for r in range(ep):
        sl = slice(r * per, (r + 1) * per)
        local = torch.where((ids >= sl.start) & (ids < sl.stop), ids - sl.start, -1).int()
        moe = Nvfp4MoE(
            *(t[sl].contiguous().to(dev) for t in w13),
            None,
            *(t[sl].contiguous().to(dev) for t in w2),
            None,
            backend=backend,
        )
        _warm(moe, m)
        out = torch.full((m, h), float("nan"), dtype=torch.bfloat16, device=dev)
        moe(x.to(dev), local.to(dev), tw.to(dev), out)
        total += out.float().cpu()
    torch.testing.assert_close(
        total, full.float(), rtol=2e-2, atol=2e-2 * full.float().abs().max().item()
    )
