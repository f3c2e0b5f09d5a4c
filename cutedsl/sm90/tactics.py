"""Which SM90 GEMM variant runs a launch: the `Tactic`, the GPU it runs on, and the choice.

A `Tactic` is the compile-time tiling of `cutedsl.sm90.kernels.gemm` (with the MoE flag, the whole
compile key): tile_n weight rows x tile_m tokens per CTA, split over split_k CTAs along K.
`choose_tactic` takes, in order: the tuned table of the GPU (`cutedsl/tuned/sm90/<device name>.json`,
measured by `python -m cutedsl.bench.gemm_sm90 --sweep grid` and built by
`python -m cutedsl.bench.tune_sm90`; an entry may name a `StreamTactic`, the streaming decode
kernel, where that was the fastest), then a rule written in terms of the GPU's SM count.
`launch_tactic` is what a launch with no forced tactic uses, and so what `warmup` compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

BK = 64  # logical K per kernel K tile
# Token tiles the GPU tests cover (tests/test_gemm_sm90.py); others are refused before compiling:
# tile_m 8 gave wrong results and 24 aborted in cute.compile (H200, nvidia-cutlass-dsl 4.4.2).
TILE_M_VERIFIED = (16, 32, 64, 128, 192, 256)
MAX_SPLIT_K = 8  # split-K CTAs form one thread-block cluster (the portable cluster size)
MAX_GRID_Y = 65535
TUNED_DIR = Path(__file__).resolve().parent.parent / "tuned" / "sm90"


@dataclass(frozen=True, order=True)
class Tactic:
    """tile_n (64 | 128) weight rows x tile_m (TILE_M_VERIFIED) tokens per CTA, K split over
    split_k (1..MAX_SPLIT_K) CTAs of one cluster (dense / grouped only)."""

    tile_n: int
    tile_m: int
    split_k: int = 1

    def __str__(self) -> str:
        return f"{self.tile_n}x{self.tile_m}x{self.split_k}"


@dataclass(frozen=True, order=True)
class StreamTactic:
    """A configuration of the streaming decode kernel (`cutedsl.sm90.kernels.stream`): `rows`
    (16 | 32) weight rows per warp and CTA, up to `tokens` (8 | 16 | 32) tokens, K split over
    `warps` warps, a `depth`-stage copy ring per warp. Dense / grouped launches of at most
    `tokens` rows, MoE launches in tiles of `tokens` rows per expert; `ctas` > 0: the persistent
    grid of at most that many CTAs per group (MoE: per expert tile), each streaming several row
    blocks; `res` > 0 (persistent only): each warp keeps its K tiles' activations resident, in
    `res` slots (launches of at most `res` K tiles per warp).
    Taken where a tuned table names it (dense / grouped) or when forced (`gemm.linear / grouped /
    moe(..., tactic=...)`)."""

    rows: int
    tokens: int
    warps: int
    depth: int
    ctas: int = 0
    res: int = 0

    def __str__(self) -> str:
        grid = f"p{self.ctas}" if self.ctas else ""
        grid += f"r{self.res}" if self.res else ""
        return f"s{self.rows}x{self.tokens}w{self.warps}d{self.depth}{grid}"


@dataclass(frozen=True)
class GpuSpec:
    """What the choice reads of the GPU: its name (selects the tuned table) and SM count."""

    name: str
    num_sms: int

    @property
    def table_file(self) -> Path:
        return TUNED_DIR / (self.name.replace(" ", "_") + ".json")


@functools.cache
def _cuda_spec(index: int) -> GpuSpec:
    p = torch.cuda.get_device_properties(index)
    return GpuSpec(p.name, p.multi_processor_count)


def gpu_spec(device: torch.device) -> GpuSpec:
    """The GpuSpec of a CUDA device (cached per device)."""
    if device.type != "cuda":
        raise ValueError(f"device: {device}, the sm90 backend runs on a CUDA device")
    return _cuda_spec(device.index if device.index is not None else torch.cuda.current_device())


AnyTactic = Tactic | StreamTactic
TableRows = list[tuple[int, AnyTactic]]


def parse_tactic(name: str) -> AnyTactic:
    """The tactic of its `str`: "64x16x4" (Tactic), "s32x8w16d2", "s32x8w16d2p264" or
    "s32x16w8d2p132r2" (StreamTactic)."""
    if name.startswith("s"):
        rows, rest = name[1:].split("x")
        tokens, rest = rest.split("w")
        warps, rest = rest.split("d")
        depth, _, rest = rest.partition("p")
        ctas, _, res = rest.partition("r")
        return StreamTactic(
            int(rows), int(tokens), int(warps), int(depth), int(ctas or 0), int(res or 0)
        )
    return Tactic(*(int(x) for x in name.split("x")))


def tactic_entry(t: AnyTactic) -> dict:
    """The tuned-table fields of a tactic (what `table_tactic` reads back)."""
    fields = list(dataclasses.astuple(t))
    if isinstance(t, StreamTactic):  # [rows, tokens, warps, depth(, ctas(, res))]
        fields = fields[: 6 if t.res else 5 if t.ctas else 4]
    return (
        {"kernel": "stream", "tactic": fields}
        if isinstance(t, StreamTactic)
        else {"tactic": fields}
    )


def table_tactic(entry: dict, m: int) -> AnyTactic:
    """The tactic of one tuned-table entry for M = m: {"tactic": [tile_n, tile_m, split_k]}, or
    {"kernel": "stream", "tactic": [rows, tokens, warps, depth(, ctas(, res))]} holding at
    least m tokens."""
    if entry.get("kernel", "tiled") == "stream":
        t = StreamTactic(*entry["tactic"])
        if t.tokens < m:
            raise ValueError(f"tuned table: {t} at M = {m} takes at most {t.tokens} tokens")
        return t
    if entry.get("kernel", "tiled") != "tiled":
        raise ValueError(f"tuned table: kernel {entry['kernel']!r}, expected 'tiled' or 'stream'")
    return Tactic(*entry["tactic"])


@functools.cache
def tuned_table(spec: GpuSpec) -> dict[tuple[int, int, int], TableRows]:
    """(N, K, groups) -> [(measured M, tactic)] ascending, from the GPU's tuned table ({} when
    there is none for this GPU)."""
    if not spec.table_file.exists():
        return {}
    with open(spec.table_file) as f:
        table = json.load(f)
    num_sms = table["meta"].get("num_sms")
    if num_sms is not None and num_sms != spec.num_sms:
        return {}  # same name, another SM count (a partitioned GPU): the rule fits it better
    out = {}
    for key, per_m in table["dense"].items():
        n, k, g = (int(x) for x in key.split(","))
        rows = [(int(m), table_tactic(e, int(m))) for m, e in per_m.items()]
        out[(n, k, g)] = sorted(rows, key=lambda r: r[0])
    return out


def _split_k(ctas: int, kt: int, tile_m: int, cap: int) -> int:
    """The largest power-of-two K split with ctas * split <= cap that the kernel takes (a cluster
    of <= MAX_SPLIT_K CTAs, dividing tile_m / 2) and leaves every split >= 8 K tiles."""
    s = 1
    while (
        ctas * s * 2 <= cap
        and kt % (s * 2) == 0
        and kt // (s * 2) >= 8
        and s * 2 <= MAX_SPLIT_K
        and (tile_m // 2) % (s * 2) == 0
    ):
        s *= 2
    return s


def choose_tactic(
    m: int, n: int, k: int, groups: int, moe: bool = False, *, spec: GpuSpec, stream: bool = True
) -> AnyTactic:
    """The Tactic for m rows of an N x K weight with `groups` groups on the GPU `spec`.

    Dense / grouped shapes in the GPU's tuned table take the fastest tactic of the smallest
    measured M >= m (a `StreamTactic` where the streaming kernel was the fastest; with
    `stream=False` such entries are passed over: the tiled kernel's choice). Otherwise a rule,
    fitted to the H200 grid sweep (2026-12-03: within 2 % of the fastest tactic on its geomean there, 1.49x at worst: wo_a at M = 128):
    - m <= 32 (decode): token tile 16 / 32; a grid of >= num_sms 128-row weight tiles takes
      128 x tile_m unsplit, else 64-row tiles split K while the grid is under two waves;
    - larger m, a grid of >= num_sms 128-row weight tiles: 128 x (64 | 128 | 256) covering m (up to
      256), unsplit;
    - larger m, a smaller grid: 128 x (64 for m <= 128, 128 for m <= 256, else 256), split K up to
      one wave (num_sms CTAs);
    split-K never drops a split under 8 K tiles (`_split_k`).
    MoE (rows per expert unknown on the host, m = the launch's sizing): tile 16/32/64/128 covering
    m, else 192 (H200 2026-12-04: routed w13 / w2 at M = 4096 1.18x / 1.17x, at M = 16384
    1.03x / 1.01x faster than 256); 128 weight rows from tile 64 up and at tile 16 (H200
    2026-12-03, routed w13 / w2 at M = 16, 64, 256: 2-3 % faster than 64), 64 at tile 32; never
    split.
    """
    kt = k // BK
    if moe:
        tile_m = next((t for t in (16, 32, 64, 128) if m <= t), 192)
        return Tactic(64 if tile_m == 32 or n % 128 else 128, tile_m)
    for m_max, tactic in tuned_table(spec).get((n, k, groups), ()):
        if m <= m_max and (stream or isinstance(tactic, Tactic)):
            return tactic
    num_sms = spec.num_sms
    wide = n % 128 == 0 and (n // 128) * groups >= num_sms  # 128-row tiles fill the GPU
    if m <= 32:
        tile_m = 16 if m <= 16 else 32
        if wide:
            return Tactic(128, tile_m)
        # split while the grid is under two waves: the doubled grid stays under four
        return Tactic(64, tile_m, _split_k((n // 64) * groups, kt, tile_m, 4 * num_sms - 1))
    tile_n = 128 if n % 128 == 0 else 64
    if wide:
        return Tactic(tile_n, 64 if m <= 64 else 128 if m <= 128 else 256)
    tile_m = 64 if m <= 128 else 128 if m <= 256 else 256
    ctas = (n // tile_n) * -(-m // tile_m) * groups
    return Tactic(tile_n, tile_m, _split_k(ctas, kt, tile_m, num_sms))


def launch_tactic(m: int, n: int, k: int, groups: int, moe: bool, spec: GpuSpec) -> AnyTactic:
    """The tactic a launch of m rows uses when none is forced (what `warmup` must compile).
    MoE: rows per expert are unknown on the host; size tiles for 2x the uniform share. When even
    min(E, m) experts in 128-row tiles give under two CTAs per SM (m = 6: one decode token), take
    64-row tiles (H200 2026-12-03: routed w13 / w2 at M = 1 1.11x / 1.09x faster; at M = 4, 736
    CTAs, 0.95x / 0.97x, so not there)."""
    m_eff = max(1, 2 * -(-m // groups)) if moe else m
    t = choose_tactic(m_eff, n, k, groups, moe, spec=spec)
    if (
        moe
        and isinstance(t, Tactic)
        and t.tile_n == 128
        and min(groups, m) * (n // 128) < 2 * spec.num_sms
    ):
        return Tactic(64, t.tile_m, t.split_k)
    return t


def _interval_starts(
    n: int, k: int, groups: int, moe: bool, max_rows: int, spec: GpuSpec
) -> set[int]:
    """The first row count of each interval of 1..max_rows on which `launch_tactic` is constant.
    Dense / grouped: every m <= 256 (the token-tile thresholds 16 / 32 / 64 / 128 / 256), then one
    m per 256-row tile count (the split-K rule reads the CTA count), and each tuned-table bucket's
    end + 1. MoE: every m <= groups (the 64-row rule reads min(E, m)), then the m where the sizing
    2 * ceil(m / E) crosses a token tile (16 / 32 / 64 / 128)."""
    if moe:
        starts = set(range(1, groups + 1)) | {groups * t // 2 + 1 for t in (16, 32, 64, 128)}
    else:
        starts = set(range(1, 257)) | set(range(257, max_rows + 1, 256))
        starts |= {m + 1 for m, _ in tuned_table(spec).get((n, k, groups), ())}
    return {m for m in starts if 1 <= m <= max_rows}


def reachable_tactics(
    n: int, k: int, groups: int, moe: bool, max_rows: int, spec: GpuSpec
) -> frozenset[AnyTactic]:
    """Every tactic `launch_tactic` returns for some 1 <= m <= max_rows on `spec`: what a
    warm-up must compile so that no launch of up to max_rows rows compiles (tests/test_tactics.py
    checks it against every m)."""
    if max_rows < 1:
        return frozenset()
    starts = _interval_starts(n, k, groups, moe, max_rows, spec)
    return frozenset(launch_tactic(m, n, k, groups, moe, spec) for m in starts)


def moe_tile_bound(rows: int, experts: int, tile_m: int) -> int:
    """The MoE kernel's grid.y: an upper bound on sum_e ceil(rows_e / tile_m) over any routing
    of `rows` rows to `experts` experts (each expert with rows adds at most one partial tile)."""
    return min(experts, rows) + rows // tile_m
