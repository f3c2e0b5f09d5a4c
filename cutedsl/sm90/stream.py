"""Launch the SM90 streaming NVFP4 W4A16 decode GEMM (`cutedsl.sm90.kernels.stream`) on torch
tensors, and the torch statement of its schedule and math.

Legend: M tokens (M <= 32), N out features, K in features, G groups (wo_a).

  linear(a[M, K], sw) -> [M, N]                 (attention projections, MLPs)
  grouped(a[G, M, K], sw(G groups)) -> [G, M, N]  (wo_a)

`sw` is a `cutedsl.sm90.stream_weight.StreamWeight`. BF16 activations and outputs, fp32
accumulation. A `StreamTactic` is the compile-time shape of the kernel (warpgroups, tile_m) plus the
CTAs per SM the grid takes (which sets the ring depth, so it is part of the compile key too).
Scratch (`Scratch`: the fp32 partials and the zeroed per-tile counters the kernel leaves zeroed) is
made once per (device, tactic, grid, row tiles) by `scratch_for` and kept: after the first launch
of a shape, a launch allocates nothing but an output not given, never syncs with the host and never
compiles, so it can be captured in a CUDA graph. Launches that may run concurrently (two streams)
must not share a `Scratch`: pass one each.

`emulate` is the torch statement of what the kernel computes, unit by unit in its schedule
(`unit_start`, `cta_of`, `slot`: the same integer arithmetic as the kernel), on the stream layout's
words through the host model of the register decode.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from cutedsl import jit
from cutedsl.sm90.stream_weight import KPAIR, StreamWeight, dequantize_stream
from cutedsl.sm90.tactics import gpu_spec
from cutedsl.validate import check_tensor

MAX_M = 32  # the decode design's token bound (one token tile)


@dataclass(frozen=True, order=True)
class StreamTactic:
    """warpgroups (1 | 2: R = 64 * warpgroups weight rows per unit), tile_m (16 | 32 tokens),
    ctas_per_sm (1 | 2: the grid is ctas_per_sm * SMs CTAs, each with its share of shared
    memory as the ring)."""

    warpgroups: int = 2
    tile_m: int = 16
    ctas_per_sm: int = 1

    def __str__(self) -> str:
        return f"stream{self.warpgroups}x{self.tile_m}x{self.ctas_per_sm}"

    @property
    def rows(self) -> int:
        return 64 * self.warpgroups


def tactics_for(m: int, n: int) -> list[StreamTactic]:
    """Every tactic that takes m tokens of an N-row weight (the bench's sweep). Two CTAs per SM
    only with one warpgroup: two CTAs of 288 threads at the two-warpgroup kernel's 120-128
    registers do not fit an SM's 64 K registers."""
    return [
        StreamTactic(w, tm, c)
        for w, c in ((1, 1), (1, 2), (2, 1))
        for tm in (16, 32)
        if m <= tm and n % (64 * w) == 0
    ]


def default_tactic(m: int, n: int) -> StreamTactic:
    """The tactic a launch takes when none is given: the smallest token tile covering m, two
    warpgroups (128 rows a unit: the activation tile is read once per 9 KiB of weight) where N
    allows, one CTA per SM (the deepest ring)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"m={m}: the streaming decode GEMM takes 1 <= M <= {MAX_M}")
    return StreamTactic(2 if n % 128 == 0 else 1, 16 if m <= 16 else 32, 1)


# ------------------------------------------------------------------------------ schedule


def unit_start(c: int, units: int, ctas: int) -> int:
    """First unit of CTA c (the kernel's `_unit_start`): floor(c * U / G)."""
    return c * units // ctas


def cta_of(u: int, units: int, ctas: int) -> int:
    """The CTA whose units hold unit u (the kernel's `_cta_of`)."""
    return ((u + 1) * ctas - 1) // units


def slot(c: int, tile: int, kp: int, units: int, ctas: int) -> int:
    """Partial slot of CTA c for row tile `tile` (the kernel's `_slot`)."""
    return 0 if unit_start(c, units, ctas) // kp == tile else 1


# ------------------------------------------------------------------------------ compile, scratch


def _build(warpgroups: int, tile_m: int, ctas_per_sm: int, no_jit_engine: bool = False) -> object:
    from cutedsl.sm90.kernels.stream import compile_kernel, default_stages

    stages = default_stages(warpgroups, tile_m, ctas_per_sm)
    return compile_kernel(warpgroups, tile_m, stages, no_jit_engine=no_jit_engine)


def kernel(tactic: StreamTactic) -> object:
    """The compiled kernel of one tactic (compiled or loaded on first use; `jit`)."""
    return jit.compiled(_build, tactic.warpgroups, tactic.tile_m, tactic.ctas_per_sm)


def jobs(tactics: Iterable[StreamTactic]) -> list[jit.Job]:
    """The `jit.Job` of each tactic, in a stable order."""
    return [jit.Job(_build, (t.warpgroups, t.tile_m, t.ctas_per_sm)) for t in sorted(set(tactics))]


def precompile(tactics: Iterable[StreamTactic]) -> None:
    """Compile (or load) tactics before CUDA-graph capture."""
    jit.ensure(jobs(tactics))


@dataclass(frozen=True)
class Scratch:
    """partial: fp32 [G, 2, R * tile_m] (CTA c's split row tiles, slots 0 / 1); counters: int32
    [tiles], zero between launches."""

    partial: torch.Tensor
    counters: torch.Tensor


_SCRATCH: dict[tuple, Scratch] = {}


def scratch_for(device: torch.device, tactic: StreamTactic, ctas: int, tiles: int) -> Scratch:
    """The kept `Scratch` of (device, tactic, grid, row tiles); made (zeroed) on first use."""
    key = (device, tactic.rows * tactic.tile_m, ctas, tiles)
    s = _SCRATCH.get(key)
    if s is None:
        s = _SCRATCH[key] = Scratch(
            partial=torch.empty(
                (ctas, 2, tactic.rows * tactic.tile_m), dtype=torch.float32, device=device
            ),  # fmt: skip
            counters=torch.zeros((tiles,), dtype=torch.int32, device=device),
        )
    return s


def grid_ctas(device: torch.device, tactic: StreamTactic) -> int:
    """The launch's CTA count: ctas_per_sm per SM of the device."""
    return tactic.ctas_per_sm * gpu_spec(device).num_sms


def _check_tactic(tactic: StreamTactic, m: int, sw: StreamWeight) -> None:
    if m > tactic.tile_m:
        raise ValueError(f"tactic {tactic}: M={m} exceeds its token tile {tactic.tile_m}")
    if sw.n % tactic.rows:
        raise ValueError(f"tactic {tactic}: N={sw.n} is not a multiple of {tactic.rows} rows")
    if tactic.warpgroups not in (1, 2) or tactic.tile_m not in (16, 32):
        raise ValueError(f"tactic {tactic}: warpgroups 1 | 2 and tile_m 16 | 32")
    if tactic.ctas_per_sm not in (1, 2):
        raise ValueError(f"tactic {tactic}: ctas_per_sm 1 | 2")


def _launch(
    a3: torch.Tensor,  # (L, M, K) bf16 contiguous
    sw: StreamWeight,
    out3: torch.Tensor,  # (L, M, N) bf16 contiguous
    tactic: StreamTactic | None,
    scratch: Scratch | None,
) -> None:
    m = a3.shape[1]
    if tactic is None:
        tactic = default_tactic(m, sw.n)
    _check_tactic(tactic, m, sw)
    tiles = sw.groups * sw.n // tactic.rows
    # at most one CTA per unit: then every CTA holds >= 1 unit and arrives on its split tiles
    ctas = min(grid_ctas(a3.device, tactic), tiles * (sw.k // KPAIR))
    if scratch is None:
        scratch = scratch_for(a3.device, tactic, ctas, tiles)
    check_tensor("scratch.partial", scratch.partial, (None, 2, tactic.rows * tactic.tile_m),
                 (torch.float32,), contiguous=True)  # fmt: skip
    check_tensor("scratch.counters", scratch.counters, (None,), (torch.int32,), contiguous=True)
    if scratch.partial.shape[0] < ctas:
        raise ValueError(f"scratch.partial: {scratch.partial.shape[0]} < {ctas} CTAs")
    if scratch.counters.shape[0] < tiles:
        raise ValueError(f"scratch.counters: {scratch.counters.shape[0]} < {tiles} row tiles")
    kernel(tactic)(
        a3.permute(1, 2, 0),
        sw.blob.reshape(-1),
        sw.gs,
        out3.permute(2, 1, 0),
        scratch.partial[:ctas].permute(2, 1, 0),
        scratch.counters,
    )


def linear(
    a: torch.Tensor,  # (M, K) bf16, contiguous, M <= 32
    sw: StreamWeight,  # one group
    out: torch.Tensor | None = None,  # (M, N) bf16
    tactic: StreamTactic | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """out = a @ dequant(sw)^T, fp32 accumulation, BF16 out. M may be 0."""
    if sw.groups != 1:
        raise ValueError(f"sw: {sw.groups} groups, expected 1 (use grouped)")
    check_tensor("a", a, (None, sw.k), (torch.bfloat16,), contiguous=True)
    m = a.shape[0]
    if m > MAX_M:
        raise ValueError(f"a: {m} rows, the streaming decode GEMM takes at most {MAX_M}")
    if out is None:
        out = a.new_empty((m, sw.n))
    if m == 0:
        return out
    _launch(a.unsqueeze(0), sw, out.view(1, m, sw.n), tactic, scratch)
    return out


def grouped(
    a: torch.Tensor,  # (G, M, K) bf16, contiguous, M <= 32
    sw: StreamWeight,  # G groups
    out: torch.Tensor | None = None,  # (G, M, N) bf16
    tactic: StreamTactic | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """out[g] = a[g] @ dequant(sw[g])^T for G equal groups (wo_a)."""
    check_tensor("a", a, (sw.groups, None, sw.k), (torch.bfloat16,), contiguous=True)
    g, m, _ = a.shape
    if m > MAX_M:
        raise ValueError(f"a: {m} rows per group, the streaming decode GEMM takes at most {MAX_M}")
    if out is None:
        out = a.new_empty((g, m, sw.n))
    if m == 0:
        return out
    _launch(a, sw, out, tactic, scratch)
    return out


# ------------------------------------------------------------------------------ torch statement


def emulate(a3: torch.Tensor, sw: StreamWeight, tactic: StreamTactic, ctas: int) -> torch.Tensor:
    """What the kernel computes for a3 (L, M, K) bf16 on `ctas` CTAs, in fp32 (L, M, N) before the
    output's bf16 rounding: each CTA accumulates its units in order per row tile (fp32), a row
    tile held by one CTA is scaled by gs, a split one is the sum of its contributors' partials in
    CTA order (each contributor's slot read back as the kernel's last arrival does), then scaled.
    Checks the schedule's invariants as it goes (each unit once, at most the two slots per CTA).
    `ctas` <= the unit count L * N / R * K / 128, as `_launch` takes it."""
    L, M, K = a3.shape
    R, kp = tactic.rows, K // KPAIR
    n_tiles = sw.n // R
    units = L * n_tiles * kp
    if not 1 <= ctas <= units:
        raise ValueError(f"ctas={ctas}: expected 1..{units} (one unit per CTA at least)")
    wdec = dequantize_stream(sw) / sw.gs[:, None, None]  # e2m1 x block scale (exact in fp32)
    a = a3.float()
    out = torch.zeros((L, M, sw.n), dtype=torch.float32, device=a3.device)
    partial: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
    seen = 0
    for c in range(ctas):
        u, u1 = unit_start(c, units, ctas), unit_start(c + 1, units, ctas)
        assert u1 > u, f"CTA {c} holds no unit"
        while u < u1:
            tile = u // kp
            end = min(u1, (tile + 1) * kp)
            grp, t = divmod(tile, n_tiles)
            rows = slice(t * R, (t + 1) * R)
            acc = torch.zeros((M, R), dtype=torch.float32, device=a3.device)
            for uu in range(u, end):  # unit by unit, as the kernel's K loop
                ks = slice((uu % kp) * KPAIR, (uu % kp + 1) * KPAIR)
                acc += a[grp, :, ks] @ wdec[grp, rows, ks].T
            seen += end - u
            first, last = cta_of(tile * kp, units, ctas), cta_of(tile * kp + kp - 1, units, ctas)
            if first == last:
                out[grp, :, rows] = acc * sw.gs[grp]
            else:
                key = (c, slot(c, tile, kp, units, ctas))
                assert key not in partial, f"CTA {c} parks two row tiles in slot {key[1]}"
                partial[key] = (tile, acc)
                if c == last:  # every contributor has parked: the ordered sum (any arrival order)
                    tot = torch.zeros_like(acc)
                    for src in range(first, last + 1):
                        src_tile, p = partial[(src, slot(src, tile, kp, units, ctas))]
                        assert src_tile == tile, (src, src_tile, tile)
                        tot += p
                    out[grp, :, rows] = tot * sw.gs[grp]
            u = end
    assert seen == units, f"{seen} units streamed, expected {units}"
    return out
