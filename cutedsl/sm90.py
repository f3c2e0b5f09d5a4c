"""Host side of the Hopper (sm_90a) NVFP4 W4A16 GEMM family (kernels/gemm_sm90.py).

Legend: M tokens, N out features, K in features (logical; packed bytes K//2), G groups (wo_a),
E experts, T routed rows (MoE).

Public functions (torch tensors in, torch tensors out; BF16 activations and outputs):
  prepare_nvfp4_weight(b_packed, b_sf, b_gs, groups=None) -> Sm90Nvfp4Weight   (once, at load)
  sm90_nvfp4_gemm(a[M, K], b_packed[N, K/2], b_sf[N, K/16], b_gs) -> [M, N]     (convenience)
  sm90_nvfp4_gemm_prepared(a[M, K], wp) -> [M, N]                               (hot path)
  sm90_nvfp4_grouped_gemm(a[G, M, K], wp(G groups)) -> [G, M, N]                (wo_a)
  sm90_nvfp4_moe_gemm(a[T, K], offs[E+1] int32 device, wp(E groups)) -> [T, N]  (experts)

Weight prep: the packed bytes stay as they are ([L, N, K/2], element 2i in the low nibble); the
e4m3 block scales are transposed to [L, K/16, N] (N-contiguous, so one TMA box of tile_n bytes
carries a K tile's scales); the global scale becomes an fp32 [L] vector.

Compile cache: keyed on compile-time values only (tile_n, tile_m, split_k, moe, out dtype); M, N,
K, the group count, strides and addresses are runtime values (fake tensors with symbolic extents),
so one compile serves every token count and routing. CUDA graphs: call `warmup()` (or each launch
function once) before capture; the launch path allocates only outputs not given (and the fp32
split-K buffer unless a `workspace` is given), never syncs with the host and never compiles once
warm.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cutedsl.workspace import Workspace

_BK = 64
# Token tiles verified on the H200 (2026-12-02); others are refused before compiling.
TILE_M_VERIFIED = (16, 32, 64, 128, 256)
_NUM_SMS_H200 = 132


@dataclass(frozen=True)
class Sm90Nvfp4Weight:
    """NVFP4 weight prepared for the sm_90a kernels.

    w:  uint8 [L, N, K//2] (e2m1 pairs, element 2i in the low nibble), contiguous
    sf: uint8 [L, K//16, N] (e4m3 codes, transposed block scales), contiguous
    gs: float32 [L] global scale (weight_scale_2) per group
    """

    w: torch.Tensor
    sf: torch.Tensor
    gs: torch.Tensor
    n: int
    k: int
    groups: int


def prepare_nvfp4_weight(
    b_packed: torch.Tensor,  # [N, K//2] | [L, N, K//2] | [L*N, K//2] with groups=L; uint8
    b_sf: torch.Tensor,  # same leading shape, [.., N, K//16] float8_e4m3fn linear (not swizzled)
    b_gs: torch.Tensor | float,  # fp32 0-dim or [L]
    groups: int | None = None,
) -> Sm90Nvfp4Weight:
    """Repack an NVFP4 weight once for the sm_90a kernels (see Sm90Nvfp4Weight)."""
    if b_packed.dtype != torch.uint8:
        raise ValueError(f"b_packed: dtype {b_packed.dtype}, expected torch.uint8")
    if b_sf.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"b_sf: dtype {b_sf.dtype}, expected torch.float8_e4m3fn")
    if b_packed.ndim == 2 and groups is not None:
        if b_packed.shape[0] % groups:
            raise ValueError(f"b_packed: {b_packed.shape[0]} rows not divisible by groups={groups}")
        b_packed = b_packed.reshape(groups, b_packed.shape[0] // groups, b_packed.shape[1])
        b_sf = b_sf.reshape(groups, b_sf.shape[0] // groups, b_sf.shape[1])
    if b_packed.ndim == 2:
        b_packed, b_sf = b_packed.unsqueeze(0), b_sf.unsqueeze(0)
    if b_packed.ndim != 3:
        raise ValueError(
            f"b_packed: shape {tuple(b_packed.shape)}, expected [N, K//2] or [L, N, K//2]"
        )
    L, N, KH = b_packed.shape
    K = 2 * KH
    if tuple(b_sf.shape) != (L, N, K // 16):
        raise ValueError(f"b_sf: shape {tuple(b_sf.shape)}, expected {(L, N, K // 16)} (linear)")
    if N % 64 or K % _BK:
        raise ValueError(f"weight: N={N} must be a multiple of 64 and K={K} of {_BK}")
    gs = torch.as_tensor(b_gs, dtype=torch.float32, device=b_packed.device).reshape(-1)
    if gs.numel() == 1:
        gs = gs.expand(L)
    if gs.numel() != L:
        raise ValueError(f"b_gs: {gs.numel()} values, expected 1 or {L}")
    return Sm90Nvfp4Weight(
        w=b_packed.contiguous(),
        sf=b_sf.view(torch.uint8).transpose(1, 2).contiguous(),
        gs=gs.contiguous(),
        n=N,
        k=K,
        groups=L,
    )


# ------------------------------------------------------------------------------ compile cache

_CACHE: dict[tuple, object] = {}
_LOCK = threading.Lock()
_COMPILES = [0]


def _compiled(tile_n: int, tile_m: int, split_k: int, moe: bool) -> object:
    key = (tile_n, tile_m, split_k, moe)  # compile-time values only
    fn = _CACHE.get(key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                from cutedsl.kernels.gemm_sm90 import compile_kernel

                fn = compile_kernel(tile_n, tile_m, split_k, moe)
                _CACHE[key] = fn
                _COMPILES[0] += 1
    return fn


def cache_keys() -> list[tuple]:
    """Keys of the compiled variants: (tile_n, tile_m, split_k, moe)."""
    return list(_CACHE)


def compile_count() -> int:
    """How many times this process ran cute.compile for this family."""
    return _COMPILES[0]


# ------------------------------------------------------------------------------ tactics


def _tile_m_for(m: int) -> int:
    # 256-wide token tiles (128 x 256 CTA tiles) hung on the H200 in the first run (2026-12-02,
    # not yet understood); they stay out of the heuristic until fixed.
    for t in (16, 32, 64):
        if m <= t:
            return t
    return 128


def choose_tactic(
    m: int, n: int, k: int, groups: int, moe: bool = False, num_sms: int = _NUM_SMS_H200
) -> tuple[int, int, int]:
    """(tile_n, tile_m, split_k) heuristic. Decode sizes get tile_n 64 and split-K until the
    grid covers about two waves of SMs; larger M gets 128 x 128 tiles."""
    tile_m = _tile_m_for(m)
    tile_n = 64 if tile_m <= 32 else 128
    if n % tile_n:
        tile_n = 64
    split_k = 1
    if not moe and tile_m <= 64:
        ctas = (n // tile_n) * ((m + tile_m - 1) // tile_m) * groups
        kt = k // _BK
        while (
            ctas * split_k * 2 <= 2 * num_sms
            and kt % (split_k * 2) == 0
            and kt // (split_k * 2) >= 4
        ):
            split_k *= 2
    return tile_n, tile_m, split_k


# ------------------------------------------------------------------------------ launch


def _check_a(a: torch.Tensor, k: int, name: str = "a") -> None:
    if a.dtype != torch.bfloat16:
        raise ValueError(f"{name}: dtype {a.dtype}, expected torch.bfloat16")
    if a.shape[-1] != k:
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected last dim K={k}")
    if not a.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (row-major, K innermost)")


_DUMMY: dict[torch.device, torch.Tensor] = {}


def _dummy_offs(device: torch.device) -> torch.Tensor:
    t = _DUMMY.get(device)
    if t is None:
        t = _DUMMY[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def launch_tactic(m: int, n: int, k: int, groups: int, moe: bool) -> tuple[int, int, int]:
    """The tactic a launch of m rows uses when none is forced (what `warmup` must compile).
    MoE: rows per expert are unknown on the host; size tiles for 2x the uniform share."""
    m_eff = max(1, 2 * -(-m // groups)) if moe else m
    return choose_tactic(m_eff, n, k, groups, moe)


def _launch(
    a3: torch.Tensor,  # (La, M, K) bf16 contiguous
    wp: Sm90Nvfp4Weight,
    out3: torch.Tensor,  # (La, M, N) bf16 contiguous
    offs: torch.Tensor | None,
    tactic: tuple[int, int, int] | None,
    workspace: Workspace | None = None,
) -> None:
    """Launch one GEMM. Split-K tactics accumulate in an fp32 (La, M, N) buffer, zeroed per call:
    the view "splitk" of `workspace` (reserved at warm-up), else a fresh allocation."""
    la, m, k = a3.shape
    moe = offs is not None
    if tactic is None:
        tactic = launch_tactic(m, wp.n, k, wp.groups, moe)
    tile_n, tile_m, split_k = tactic
    if tile_m not in TILE_M_VERIFIED:
        # H200, 2026-12-02: tile_m 8 gave wrong results and tile_m 24 aborted the process in
        # cute.compile (bench/results/logs/h200_2026-12-02_test_gemm_sm90_every_tactic_abort.log).
        raise ValueError(
            f"tactic {tactic}: tile_m {tile_m} not in {TILE_M_VERIFIED} (verified on H200)"
        )
    if moe and split_k != 1:
        raise NotImplementedError("split-K with MoE offsets is not wired on the host")
    fn = _compiled(tile_n, tile_m, split_k, moe)
    a_v = a3.permute(1, 2, 0)  # (M, K, La)
    w_v = wp.w.permute(1, 2, 0)  # (N, K/2, L)
    sf_v = wp.sf.permute(2, 1, 0)  # (N, K/16, L)
    offs_t = offs if moe else _dummy_offs(a3.device)
    if split_k == 1:
        fn(a_v, w_v, sf_v, wp.gs, out3.permute(2, 1, 0), offs_t)
    else:
        if workspace is None:
            ws = torch.zeros(out3.shape, dtype=torch.float32, device=out3.device)
        else:
            ws = workspace.get("splitk", tuple(out3.shape), torch.float32).zero_()
        fn(a_v, w_v, sf_v, wp.gs, ws.permute(2, 1, 0), offs_t)
        out3.copy_(ws)


def sm90_nvfp4_gemm_prepared(
    a: torch.Tensor,  # (M, K) bf16
    wp: Sm90Nvfp4Weight,  # one group
    out: torch.Tensor | None = None,  # (M, N) bf16
    tactic: tuple[int, int, int] | None = None,
    workspace: Workspace | None = None,  # split-K scratch ("splitk"); None allocates it
) -> torch.Tensor:
    """out = a @ dequant(wp)^T, fp32 accumulation, BF16 out. M may be 0."""
    if wp.groups != 1:
        raise ValueError(f"wp: {wp.groups} groups, expected 1 (use sm90_nvfp4_grouped_gemm)")
    _check_a(a, wp.k)
    if a.ndim != 2:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [M, K]")
    m = a.shape[0]
    if out is None:
        out = a.new_empty((m, wp.n))
    if m == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, m, wp.n), None, tactic, workspace)
    return out


def sm90_nvfp4_gemm(
    a: torch.Tensor,  # (M, K) bf16
    b_packed: torch.Tensor,  # (N, K//2) uint8
    b_sf: torch.Tensor,  # (N, K//16) e4m3 linear
    b_gs: torch.Tensor | float,  # fp32 0-dim
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Convenience form that prepares the weight on every call (tests; not the hot path)."""
    return sm90_nvfp4_gemm_prepared(a, prepare_nvfp4_weight(b_packed, b_sf, b_gs), out)


def sm90_nvfp4_grouped_gemm(
    a: torch.Tensor,  # (G, M, K) bf16, per-group contiguous
    wp: Sm90Nvfp4Weight,  # G groups
    out: torch.Tensor | None = None,  # (G, M, N) bf16
    tactic: tuple[int, int, int] | None = None,
    workspace: Workspace | None = None,  # split-K scratch ("splitk"); None allocates it
) -> torch.Tensor:
    """out[g] = a[g] @ dequant(wp[g])^T for G equal groups (wo_a)."""
    _check_a(a, wp.k)
    if a.ndim != 3 or a.shape[0] != wp.groups:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [G={wp.groups}, M, K={wp.k}]")
    g, m, _ = a.shape
    if out is None:
        out = a.new_empty((g, m, wp.n))
    if m == 0:
        return out
    _launch(a, wp, out, None, tactic, workspace)
    return out


def sm90_nvfp4_moe_gemm(
    a: torch.Tensor,  # (T, K) bf16, rows grouped by expert
    offs: torch.Tensor,  # (E+1,) int32 on the device: expert e owns rows [offs[e], offs[e+1])
    wp: Sm90Nvfp4Weight,  # E groups
    out: torch.Tensor | None = None,  # (T, N) bf16
    tactic: tuple[int, int, int] | None = None,
    workspace: Workspace | None = None,  # split-K scratch ("splitk"); None allocates it
) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ dequant(wp[e])^T. One compile serves every routing; rows
    outside [offs[0], offs[E]) are not written."""
    _check_a(a, wp.k)
    if a.ndim != 2:
        raise ValueError(f"a: shape {tuple(a.shape)}, expected [T, K]")
    if offs.dtype != torch.int32 or offs.shape != (wp.groups + 1,):
        raise ValueError(
            f"offs: {offs.dtype} {tuple(offs.shape)}, expected int32 ({wp.groups + 1},)"
        )
    t = a.shape[0]
    if out is None:
        out = a.new_empty((t, wp.n))
    if t == 0:
        return out
    _launch(a.unsqueeze(0), wp, out.view(1, t, wp.n), offs, tactic, workspace)
    return out


def warmup(tactics: list[tuple[int, int, int, bool]]) -> None:
    """Compile (tile_n, tile_m, split_k, moe) variants before CUDA-graph capture."""
    for tn, tm, sk, moe in tactics:
        _compiled(tn, tm, sk, moe)
