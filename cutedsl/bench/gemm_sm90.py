"""sm_90a NVFP4 W4A16 GEMMs (`cutedsl.sm90.gemm`) vs cuBLAS BF16, Marlin and DeepGEMM FP8 per shape.

python -m cutedsl.bench.gemm_sm90 [--model flash|pro|all] [--ms 1,4,...] [--shapes a,b]
    [--impls ours,cublas,...] [--quack-env FILE] [--sweep [neighbours|grid]] [--time-budget S]
    [--json PATH] [--md PATH] [--list-shapes] [--dense NxK,NxK,...]

Shapes (per model, from its config; see FLASH_CONFIG / PRO_CONFIG): fused_wqa_wkv, wq_b, wo_a
(G equal groups, a[G, M, K]), wo_b, shared expert L1/L2 (dense), routed experts L1/L2 ("moe": the
M*topk routed rows grouped by per-expert offsets from `routing()`, a seeded top-k routing with
per-expert popularity skew, distinct experts per token).

--dense NxK,...: time these dense shapes (model "custom") instead of the models' shapes. With
three or more of them the report adds, per implementation and M, the least-squares line
time = fixed + bytes / rate over them (`fit_cost`): the fixed cost of one call (launch, prologue,
pipeline fill, epilogue, tail) apart from its streaming rate, next to the same-bytes copy's.

Timing: each implementation is captured in a CUDA graph of `reps` back-to-back calls that cycle
through enough weight copies (dense, wo_a) or routings (moe: different experts active each call)
to exceed 3x the 60 MB L2, so weights are cold every call, as in decode where each layer's weights
are read once; the graph is replayed 5 times (after 3 warm-up calls) and the median replay time is
divided by `reps`, CUDA events around each replay (`cutedsl.bench.common.graph_time_us`). Host
launch overhead is excluded (as under vLLM's CUDA graphs). Where one copy of the weights is
already > 3x L2 a single copy is used.

Bytes (one place, `weight_bytes`): NVFP4 weight + e4m3 scales = N*K*(0.5 + 1/16) per group or per
*active* expert; cuBLAS BF16 reads N*K*2; DeepGEMM FP8 N*K*(1 + 4/128^2). Activations/outputs are
not counted in GB/s. FLOPs = 2*rows*N*K per group. Copy bandwidth: the faster of a 1 GiB
device-to-device copy and a 1 GiB bf16 elementwise kernel, read + write bytes / time (the copy
alone reads low: 2.77 TB/s on the H200, 2026-12-03). `pct_copy_bw` = our weight GB/s / copy
bandwidth (the MD shows it for M <= 32 only, where the GEMM should be weight-bandwidth bound).
For M <= 32 also `copy_us`: the same elementwise copy kernel moving the row's weight + scale bytes
(read + write), timed like the GEMMs, so with the launch and pipeline-fill latency that a 1 GiB
stream hides; `pct_copy_time` = copy_us / ours us.

Columns:
- ours: `cutedsl.sm90.gemm` linear / grouped / moe (BF16 activations, no activation quantization
  at all), the tactic a launch takes on this GPU (`cutedsl.sm90.tactics.launch_tactic`; where the
  GPU's tuned table names the streaming decode kernel for a decode row, that kernel, its
  `tactic` recorded by name, e.g. s32x8w16d2).
- cuBLAS: torch.matmul (dense) / torch.bmm (wo_a), BF16; routed experts: torch._grouped_mm (BF16,
  CUTLASS in torch, not cuBLAS; named in `cublas_impl`).
- Marlin: vLLM 0.21.0 NVFP4 W4A16. Dense: `apply_fp4_marlin_linear`. Routed experts: one
  `ops.moe_wna16_marlin_gemm` call as vLLM's `fused_marlin_moe` makes it (its block_size_m rule,
  fp32 reduce, no atomics), on weights and scales repacked per expert as
  `prepare_nvfp4_moe_layer_for_marlin` does; L1 reads the M token rows through top_k, L2 the
  M*topk rows with top_k 1, without the routing-weight multiply vLLM's L2 does (ours is timed
  without it too). `moe_align_block_size` (once per batch in vLLM, shared by L1 and L2) is outside
  the timed graph, as our offsets are. wo_a: n/a.
- copy (M <= 32): `bench_copy`, the same-bytes copy above.
- swiglu (asked for by name; routed w13 rows only): the routed w13 GEMM followed by the clamped
  SwiGLU kernel (`swiglu_sep_us`, the default path) against the same GEMM with the SwiGLU fused
  into its epilogue (`swiglu_fused_us`, `CUTEDSL_SM90_FUSED_SWIGLU=1`), limit 10, same routings
  and timing; `x_swiglu_fused` = sep / fused.
- stream (asked for by name; rows with M <= 32): the streaming decode kernel
  (`cutedsl.sm90.kernels.stream`, forced with a `StreamTactic`) in every `stream_candidates`
  configuration (the persistent grid too, sized by the GPU's SM count), same weight copies /
  routings and timing as ours: `stream_us` the fastest, `stream_tactic`
  its configuration, `stream_sweep_us` each; `x_stream` = ours us / stream_us (> 1: the streaming
  kernel is faster), `pct_copy_time_stream` = copy_us / stream_us.
- quack (asked for by name, with --quack-env FILE): quack-kernels' CuTeDSL `gemm_w4a16` (NVFP4)
  on the dense shapes, in the Python environment FILE sets up (quack 0.6.x needs a newer
  nvidia-cutlass-dsl than ours), run once before our measurements by `cutedsl.bench.quack_anchor`
  (same timing, its result checked against torch math first); grouped and routed: n/a (quack has
  no such kernel).
- DeepGEMM: vLLM 0.21.0's bundled DeepGEMM (vllm.third_party.deep_gemm, through the wrappers in
  vllm.utils.deep_gemm, as vLLM calls them) on FP8 e4m3 block weights (128x128 blocks, fp32
  scales) and FP8 activations (1x128 groups, fp32 scales, MN-major TMA-aligned, pre-transformed):
  dense `fp8_gemm_nt((a, sa), (w, sw), out)`; wo_a `fp8_einsum("bhr,hdr->bhd", (a, sa), (w, sw),
  z, recipe=(1, 128, 128))` (vLLM's SM90 o-proj recipe); routed experts
  `m_grouped_fp8_gemm_nt_contiguous((a, sa), (w, sw), out, m_indices)` on rows padded per expert
  to get_mk_alignment_for_contiguous_layout() (padding rows -1; vLLM itself only takes this path
  when the batch has >= that many tokens, `_valid_deep_gemm_shape`, and uses Triton below).
  `deepgemm_us` EXCLUDES activation quantization; `deepgemm_quant_us` is vLLM's
  per_token_group_quant_fp8(x, 128, column_major_scales=True) on the A rows the GEMM consumes,
  timed alone (wo_a: on [M*G, K]; vLLM fuses that with inverse RoPE instead); `deepgemm_total_us`
  = the sum. Rows where DeepGEMM does not apply say "n/a: ..." in `deepgemm_error`; a DeepGEMM
  failure (no JIT, unsupported shape) is recorded there and never stops the run.
Ratios are speedups of ours: x_<impl> = t_<impl> / t_ours (> 1: ours is faster).
--sweep also times other tactics of ours: the launch tactic's neighbours, or (grid) every tactic
`candidate_tactics` lists; `python -m cutedsl.bench.tune_sm90` turns grid sweeps into the GPU's
tuned table.
--time-budget S: stop starting new measurements when they would not finish before S seconds;
JSON/MD are rewritten after every shape, so whatever finished is always on disk.
"""

# ruff: noqa: B023  (the lambdas are captured into a graph within the same iteration)

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cutedsl import jit
from cutedsl.bench.common import gpu_problem, graph_time_us, make_parser
from cutedsl.sm90.tactics import (
    BK,
    TILE_M_VERIFIED,
    GpuSpec,
    StreamTactic,
    Tactic,
    choose_tactic,
    gpu_spec,
    launch_tactic,
)

L2_BYTES = 60 * 2**20
M_LIST = [1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
MODELS = ("flash", "pro")

# Config keys as in cutedsl/tools/tiny_model.py (native DeepSeek names).
# Flash: = tiny_model PRESETS["flash-layers"] + _BASE (head_dim 512, top-6, 1 shared expert);
# /work/shared/research/anchors.md §3.1 and vllm021_dsv4.md §1.2 agree.
FLASH_CONFIG = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
}
# Pro: /work/shared/research/anchors.md §3.1 "Sizes (config.json values)", whose source is the
# config mirror https://huggingface.co/SinterForge/DeepSeek-V4-Pro/blob/main/config.json [S] and
# DeepGEMM PR #316 (expert dims) [P]; vllm021_dsv4.md §1.2 agrees (H 7168, NH 128, Q 1536, G 16).
PRO_CONFIG = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "head_dim": 512,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 3072,
    "n_shared_experts": 1,
}
CONFIGS = {"flash": FLASH_CONFIG, "pro": PRO_CONFIG}


@dataclass(frozen=True)
class Shape:
    """One GEMM of a layer. kind: "dense" (a[M, K] @ W[N, K]^T), "grouped" (wo_a: G equal
    groups, a[G, M, K] @ W[g][N, K]^T) or "moe" (E experts; M*topk routed rows, grouped by
    expert offsets, row block of expert e times W[e][N, K]^T)."""

    name: str
    kind: str
    n: int
    k: int
    groups: int = 1  # G for "grouped", E for "moe", 1 for "dense"
    topk: int = 0  # "moe" only
    gate_up: bool = False  # "moe" L1: vLLM's Marlin reads the M token rows through top_k

    def rows(self, m: int) -> int:
        """Rows of A for m tokens: m (dense), m per group (grouped), m*topk (moe)."""
        return m * self.topk if self.kind == "moe" else m


def shapes_from_config(cfg: dict) -> list[Shape]:
    """The benchmarked GEMMs of one DSv4 layer from its config (native keys)."""
    h, nh, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, g, r = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    e, topk, i = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    i_s = i * cfg.get("n_shared_experts", 1)
    return [
        Shape("fused_wqa_wkv", "dense", q + d, h),  # wq_a [Q, H] ++ wkv [D, H]
        Shape("wq_b", "dense", nh * d, q),
        Shape(f"wo_a(G={g})", "grouped", r, nh * d // g, groups=g),
        Shape("wo_b", "dense", h, g * r),
        Shape("shared_w13", "dense", 2 * i_s, h),
        Shape("shared_w2", "dense", h, i_s),
        Shape(f"routed_w13(E={e})", "moe", 2 * i, h, groups=e, topk=topk, gate_up=True),
        Shape(f"routed_w2(E={e})", "moe", h, i, groups=e, topk=topk),
    ]


SHAPES: dict[str, list[Shape]] = {m: shapes_from_config(c) for m, c in CONFIGS.items()}


def weight_bytes(groups: int, n: int, k: int) -> float:
    """NVFP4 weight + e4m3 block-scale bytes of `groups` [N, K] matrices (0.5625 B/param)."""
    return groups * n * k * (0.5 + 1 / 16)


def fp8_weight_bytes(groups: int, n: int, k: int) -> float:
    """FP8 e4m3 weight + fp32 128x128 block-scale bytes."""
    return groups * n * k * (1 + 4 / 128**2)


# ------------------------------------------------------------------------------ routing


def routing(m: int, e: int, topk: int, seed: int = 0, skew: float = 1.0) -> torch.Tensor:
    """Seeded top-k routing, int64 [m, topk] on the CPU, distinct experts per token.

    Expert popularity is fixed (log-normal weights, sigma=`skew`, from a generator seeded 1234) so
    routings with different `seed` share the same load imbalance, as consecutive batches do; each
    token draws topk experts without replacement (Gumbel top-k)."""
    if not 0 < topk <= e:
        raise ValueError(f"topk={topk}: expected 0 < topk <= E={e}")
    pop = torch.randn(e, generator=torch.Generator().manual_seed(1234)) * skew
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(m, e, generator=g).clamp_(1e-12, 1 - 1e-7)
    return (pop - torch.log(-torch.log(u))).topk(topk, dim=1).indices


def expert_counts(topk_ids: torch.Tensor, e: int) -> torch.Tensor:
    """Rows per expert, int64 [E]; sums to topk_ids.numel()."""
    return torch.bincount(topk_ids.reshape(-1), minlength=e)


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 [E+1]: expert e owns rows [offs[e], offs[e+1]); offs[0] = 0, offs[E] = sum."""
    offs = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return offs


def contiguous_m_indices(counts: torch.Tensor, align: int) -> torch.Tensor:
    """DeepGEMM contiguous layout, int32 [sum(round_up(c, align))]: expert id per row, -1 on the
    padding rows that round each expert's block up to `align` (zero-row experts get no rows)."""
    parts = []
    for ex, c in enumerate(counts.tolist()):
        pad = -(-c // align) * align
        if pad:
            blk = torch.full((pad,), -1, dtype=torch.int32)
            blk[:c] = ex
            parts.append(blk)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


# ------------------------------------------------------------------------------ timing


def _reps(flops: float) -> int:
    return int(max(3, min(200, 2e5 / max(1.0, flops / 5e8))))  # ~<=200 calls, long shapes fewer


def _copies(nbytes: float) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / max(1.0, nbytes))))


def _streams_gbps() -> dict[str, float]:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    xb, yb = x.view(torch.bfloat16).normal_(), y.view(torch.bfloat16)
    return {
        "memcpy": 2 * x.numel() / graph_time_us([lambda: y.copy_(x)], 10) / 1e3,
        "elementwise": 2 * x.numel() / graph_time_us([lambda: torch.mul(xb, 2, out=yb)], 10) / 1e3,
    }


def copy_time_us(nbytes: float, reps: int = 100) -> float:
    """Time of the elementwise copy kernel (bf16 x 2) moving `nbytes` (read half, write half: the
    read + write bytes of the copy bandwidth), over rotated input and output buffers (> 3x L2
    together), timed like the GEMMs: the same-bytes anchor of a decode GEMM."""
    elems = max(1, int(nbytes / 4))
    xs = [torch.randn(elems, device="cuda", dtype=torch.bfloat16)
          for _ in range(_copies(4 * elems))]  # fmt: skip
    ys = [torch.empty_like(x) for x in xs]
    return graph_time_us([lambda x=x, y=y: torch.mul(x, 2, out=y) for x, y in zip(xs, ys)], reps)


def stream_bandwidths_gbps() -> dict[str, float]:
    """Read + write GB/s of two 1 GiB -> 1 GiB streams: the device-to-device copy (cudaMemcpy) and
    a vectorized elementwise kernel (bf16 x 2). The copy alone reads low (H200, 2026-12-03: 2.77
    TB/s, while the SwiGLU kernel streamed 4.3 TB/s), so the bandwidth anchor is the faster."""
    out = _streams_gbps()
    torch.cuda.empty_cache()  # the 2 GiB buffers go back before the weights are made
    return out


def random_prepared_weight(g: int, n: int, k: int) -> object:
    """Random NVFP4 codes and positive e4m3 scales for g groups of [n, k], as a
    `cutedsl.sm90.weight.Weight` (the bench times bytes, not values)."""
    from cutedsl.sm90.weight import prepare_weight

    packed = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8, device="cuda")
    sf = (torch.rand(g, n, k // 16, device="cuda") * 4 + 2**-7).to(torch.float8_e4m3fn)
    return prepare_weight(packed, sf, torch.full((g,), 0.01, device="cuda"))


class Budget:
    """Wall-clock budget: `fits()` says whether another measurement may start."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.t0 = time.monotonic()
        self.longest = 0.0
        self.stopped = ""

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.monotonic() - self.t0)

    def fits(self, what: str) -> bool:
        """True when 3x the longest measurement so far (at least 10 s) is still left."""
        if self.stopped:
            return False
        if self.left() < max(10.0, 3 * self.longest):
            self.stopped = f"time budget {self.seconds}s reached before {what}"
            print(f"[bench] {self.stopped}; stopping", flush=True)
            return False
        return True

    def measure(self, fn: Callable[[], float]) -> float:
        t = time.monotonic()
        try:
            return fn()
        finally:
            self.longest = max(self.longest, time.monotonic() - t)


def _err(e: BaseException) -> str:
    """One-line error string for a record: "error: Type: first line of the message"."""
    lines = str(e).strip().splitlines()
    return f"error: {type(e).__name__}: {lines[0][:200] if lines else ''}".rstrip()


def _rand_fp8(shape: tuple, device: str = "cuda") -> torch.Tensor:
    # bytes < 0x70: finite e4m3 values (no NaN encodings); timing does not depend on the values
    return torch.randint(0, 0x70, shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


def _routings(shape: Shape, m: int) -> list[torch.Tensor]:
    """Expert counts (int64 [E] each) of enough routings (seeds 0, 1, ...) that the NVFP4 bytes of
    the experts they touch exceed 3x L2 in total (at most 8). Every implementation gets the same
    list (NVFP4 is the smallest format, so the others are at least as cold)."""
    active_bytes_per_expert = weight_bytes(1, shape.n, shape.k)
    out = []
    touched = 0.0
    for seed in range(8):
        c = expert_counts(routing(m, shape.groups, shape.topk, seed=seed), shape.groups)
        out.append(c)
        touched += int((c > 0).sum()) * active_bytes_per_expert
        if touched >= 3 * L2_BYTES:
            break
    return out


def active_experts(counts: list[torch.Tensor]) -> float:
    """Mean number of experts with at least one row over the routings."""
    return round(sum(int((c > 0).sum()) for c in counts) / len(counts), 1)


# ------------------------------------------------------------------------------ rows


def new_row(model: str, shape: Shape, m: int) -> dict:
    """An empty record for (shape, m); every measured field None until filled."""
    r = dict(
        model=model,
        shape=f"{model}.{shape.name}",
        kind=shape.kind,
        G=shape.groups if shape.kind == "grouped" else 1,
        E=shape.groups if shape.kind == "moe" else None,
        topk=shape.topk or None,
        M=m,
        rows=shape.rows(m),
        N=shape.n,
        K=shape.k,
        active_experts=None,
        tactic=None,
    )
    for key in (
        "us tflops weight_GBps pct_copy_bw copy_us pct_copy_time cublas_us cublas_tflops cublas_weight_GBps cublas_impl "
        "marlin_us marlin_tflops marlin_weight_GBps deepgemm_us deepgemm_tflops deepgemm_quant_us "
        "deepgemm_total_us deepgemm_rows deepgemm_weight_GBps x_cublas x_marlin x_deepgemm "
        "x_deepgemm_total quack_us quack_rel_err quack_tactic x_quack ours_error cublas_error "
        "marlin_error deepgemm_error copy_error quack_error sweep_us best_tactic best_us "
        "swiglu_sep_us swiglu_fused_us x_swiglu_fused swiglu_error stream_us stream_tactic "
        "stream_sweep_us pct_copy_time_stream x_stream stream_error"
    ).split():
        r[key] = None
    return r


def finalize_row(r: dict, copy_bw: float | None) -> dict:
    """Fill the derived columns (TF/s, GB/s, % copy bandwidth, speedups) from the times."""
    groups = r["G"] if r["kind"] == "grouped" else (r["active_experts"] or 1)
    flops = 2.0 * r["rows"] * r["N"] * r["K"] * (r["G"] if r["kind"] == "grouped" else 1)
    wb = weight_bytes(groups, r["N"], r["K"])

    def rnd(x, p):
        return None if x is None else round(x, p)

    def tf(t):
        return rnd(flops / t / 1e6, 1) if t else None

    t = r["us"]
    r["tflops"] = tf(t)
    r["weight_GBps"] = rnd(wb / t / 1e3, 0) if t else None
    r["pct_copy_bw"] = rnd(100 * wb / t / 1e3 / copy_bw, 1) if t and copy_bw else None
    r["pct_copy_time"] = rnd(100 * r["copy_us"] / t, 1) if t and r["copy_us"] else None
    r["cublas_tflops"] = tf(r["cublas_us"])
    r["cublas_weight_GBps"] = (
        rnd(groups * r["N"] * r["K"] * 2 / r["cublas_us"] / 1e3, 0) if (r["cublas_us"]) else None
    )
    r["marlin_tflops"] = tf(r["marlin_us"])
    r["marlin_weight_GBps"] = rnd(wb / r["marlin_us"] / 1e3, 0) if r["marlin_us"] else None
    r["deepgemm_tflops"] = tf(r["deepgemm_us"])
    r["deepgemm_weight_GBps"] = (
        rnd(fp8_weight_bytes(groups, r["N"], r["K"]) / r["deepgemm_us"] / 1e3, 0)
        if r["deepgemm_us"]
        else None
    )
    if r["deepgemm_us"] is not None and r["deepgemm_quant_us"] is not None:
        r["deepgemm_total_us"] = round(r["deepgemm_us"] + r["deepgemm_quant_us"], 2)
    for key, col in (
        ("x_cublas", "cublas_us"),
        ("x_marlin", "marlin_us"),
        ("x_deepgemm", "deepgemm_us"),
        ("x_deepgemm_total", "deepgemm_total_us"),
        ("x_quack", "quack_us"),
    ):
        r[key] = round(r[col] / t, 2) if t and r[col] else None
    st = r.get("stream_us")
    r["x_stream"] = round(t / st, 2) if t and st else None
    r["pct_copy_time_stream"] = rnd(100 * r["copy_us"] / st, 1) if st and r["copy_us"] else None
    sep, fused = r["swiglu_sep_us"], r["swiglu_fused_us"]
    r["x_swiglu_fused"] = round(sep / fused, 2) if sep and fused else None
    return r


def summarize(rows: list[dict]) -> dict:
    dec = [r for r in rows if r["M"] <= 32 and r["pct_copy_bw"]]
    pre = [r for r in rows if r["M"] >= 4096 and r["x_cublas"]]

    def col(rs, k):
        return [r[k] for r in rs if r[k]]

    return {
        "decode_pct_copy_bw_min": min(col(dec, "pct_copy_bw"), default=None),
        "decode_pct_copy_bw_geomean": _geo(col(dec, "pct_copy_bw")),
        "decode_pct_copy_time_min": min(col(dec, "pct_copy_time"), default=None),
        "decode_pct_copy_time_geomean": _geo(col(dec, "pct_copy_time")),
        "prefill_x_cublas_min": min(col(pre, "x_cublas"), default=None),
        "prefill_x_cublas_geomean": _geo(col(pre, "x_cublas")),
        "x_marlin_geomean": _geo(col(rows, "x_marlin")),
        "x_marlin_min": min(col(rows, "x_marlin"), default=None),
        "x_deepgemm_geomean": _geo(col(rows, "x_deepgemm")),
        "x_deepgemm_total_geomean": _geo(col(rows, "x_deepgemm_total")),
        "x_quack_geomean": _geo(col(rows, "x_quack")),
        "x_quack_min": min(col(rows, "x_quack"), default=None),
    }


def _geo(xs: list[float]):
    xs = [x for x in xs if x and x > 0]
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None


# ------------------------------------------------------------------------------ implementations


def _set(rows_by_m: dict[int, dict], ms: list[int], key: str, value) -> None:
    for m in ms:
        rows_by_m[m][key] = value


def candidate_tactics(
    m: int, n: int, k: int, groups: int, moe: bool, *, spec: GpuSpec, grid: bool = False
) -> list[Tactic]:
    """The launch tactic on the GPU `spec` first, then the tactics worth timing (--sweep).
    Neighbours: the other tile_n, the next token tile up and down, half / double the K split.
    Grid (dense / grouped): every tile_n, every verified token tile from the one covering m
    (m <= 32) or from min(m, 256) / 4 up to 2x m, every split 1..8 the kernel takes (1, 2 from
    m = 1024). All valid for the shape."""
    from cutedsl.sm90.kernels.gemm import Sm90Nvfp4W4A16GemmKernel as Kern  # imports cutlass

    t0 = launch_tactic(m, n, k, groups, moe, spec)
    cands: list = [t0]
    if isinstance(t0, StreamTactic):  # a tuned table's decode row: the tiled kernel's tactics too
        t0 = choose_tactic(m, n, k, groups, moe, spec=spec, stream=False)
        cands.append(t0)
    tn, tm, sk = t0.tile_n, t0.tile_m, t0.split_k
    tiles = list(TILE_M_VERIFIED)
    if grid and not moe:
        if m <= 32:
            tms = [next(t for t in tiles if t >= m)]
        else:
            tms = [t for t in tiles if min(m, 256) / 4 <= t <= 2 * m]
        splits = (1, 2, 4, 8) if m < 1024 else (1, 2)
        cands += [Tactic(n_, t, s) for t in tms for n_ in (64, 128) for s in splits]
    else:
        i = tiles.index(tm)
        cands += [Tactic(192 - tn, tm, sk)]
        cands += [Tactic(tn, tiles[j], sk if tiles[j] <= 64 else 1) for j in (i - 1, i + 1)
                  if 0 <= j < len(tiles)]  # fmt: skip
        if not moe:
            cands += [Tactic(tn, tm, max(1, sk // 2)), Tactic(tn, tm, sk * 2)]
    out: list = []
    kt = k // BK
    for c in cands:
        if isinstance(c, StreamTactic):
            out.append(c)
            continue
        if c in out or not Kern.can_implement(n, k, c.tile_n, c.split_k) or kt // c.split_k < 2:
            continue
        if Kern.split_error(c.tile_m, c.split_k, moe):
            continue
        out.append(c)
    return out


def tactic_list(t: Tactic | StreamTactic) -> list[int] | str:
    """A tactic as the rows record it: a Tactic as [tile_n, tile_m, split_k], a StreamTactic as
    its name (s<rows>x<tokens>w<warps>d<depth>, a key of "stream_sweep_us")."""
    if isinstance(t, StreamTactic):
        return str(t)
    return [t.tile_n, t.tile_m, t.split_k]


def gemm_calls(shape: Shape, m: int, wps: list) -> tuple[Callable, list | None]:
    """(make, routings) for m tokens of `shape` on fresh operands: make(tactic) gives the calls of
    one timed graph through `cutedsl.sm90.gemm` (one per weight copy in `wps`; MoE: one per
    routing, on wps[0]); routings are the MoE's expert row counts (None otherwise)."""
    from cutedsl.sm90 import gemm

    g, n, k = shape.groups, shape.n, shape.k
    if shape.kind == "moe":
        cs = _routings(shape, m)
        offs = [expert_offsets(c).to("cuda") for c in cs]
        rows = shape.rows(m)
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

        def make(t, w0=wps[0]):
            return [lambda o=o: gemm.moe(a, o, w0, out=out, tactic=t) for o in offs]

        return make, cs
    if shape.kind == "grouped":
        a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(g, m, n, device="cuda", dtype=torch.bfloat16)
        call = gemm.grouped
    else:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        call = gemm.linear

    def make(t):
        return [lambda wp=wp: call(a, wp, out=out, tactic=t) for wp in wps]

    return make, None


def bench_ours(
    shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget, sweep: str = ""
) -> None:
    """Time `cutedsl.sm90.gemm` on `shape` for each m into rows_by_m[m]["us"] (errors into
    ours_error). With `sweep`, also every `candidate_tactics` into "sweep_us" {"TNxTMxSK": us} and
    "best_tactic"."""
    try:
        from cutedsl.sm90 import gemm

        spec = gpu_spec(torch.device("cuda"))
        g, n, k = shape.groups, shape.n, shape.k
        n_copies = 1 if shape.kind == "moe" else _copies(weight_bytes(g, n, k))
        wps = [random_prepared_weight(g, n, k) for _ in range(n_copies)]
        moe = shape.kind == "moe"
        swept = {m: candidate_tactics(shape.rows(m) if moe else m, n, k, g, moe, spec=spec,
                                      grid=sweep == "grid") for m in ms} if sweep else {}  # fmt: skip
        # every tactic the sweep times compiles in parallel, not one by one
        jit.prefetch(gemm.jobs({(t, moe) for cands in swept.values() for t in cands}))
    except Exception as e:  # noqa: BLE001 - one implementation failing never stops the run
        _set(rows_by_m, ms, "ours_error", _err(e))
        return
    for m in ms:
        if not budget.fits(f"ours {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            rows = shape.rows(m)
            make, cs = gemm_calls(shape, m, wps)
            if cs is not None:
                r["active_experts"] = active_experts(cs)
            tac = launch_tactic(rows, n, k, g, moe, spec)
            r["tactic"] = tactic_list(tac)
            flops = 2.0 * rows * n * k * (g if shape.kind == "grouped" else 1)
            cands = swept.get(m, [tac])
            times = {}
            for t in cands:
                if t != tac and not budget.fits(f"ours {shape.name} M={m} tactic {t}"):
                    break
                fns = make(t)
                fns[0]()  # compile outside capture
                times[t] = round(budget.measure(lambda: graph_time_us(fns, _reps(flops))), 2)
            r["us"] = times[tac]
            if sweep:
                r["sweep_us"] = {str(t): us for t, us in times.items()}
                best = min(times, key=times.get)
                r["best_tactic"], r["best_us"] = tactic_list(best), times[best]
        except Exception as e:  # noqa: BLE001
            r["ours_error"] = _err(e)
        print(f"  ours     {shape.name:20s} M={m:6d} us={r['us']} {r['ours_error'] or ''}")
    del wps
    torch.cuda.empty_cache()


SWIGLU_LIMIT = 10.0  # DSv4's


def bench_swiglu(shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget) -> None:
    """Routed w13 rows: "swiglu_sep_us" = `gemm.moe` then `swiglu.swiglu_clamp` over the routed
    rows, "swiglu_fused_us" = `gemm.moe(..., swiglu=True)` (w13 in `swiglu_row_order`), both at
    the launch tactic, on the routings `bench_ours` uses; other shapes "n/a"."""
    if not (shape.kind == "moe" and shape.gate_up):
        _set(rows_by_m, ms, "swiglu_error", "n/a: routed w13 only")
        return
    try:
        from cutedsl.sm90 import gemm, swiglu
        from cutedsl.sm90.weight import interleave_swiglu

        g, n, k = shape.groups, shape.n, shape.k
        wp = random_prepared_weight(g, n, k)
        wpf = interleave_swiglu(random_prepared_weight(g, n, k))
    except Exception as e:  # noqa: BLE001 - one implementation failing never stops the run
        _set(rows_by_m, ms, "swiglu_error", _err(e))
        return
    for m in ms:
        if not budget.fits(f"swiglu {shape.name} M={m}"):
            break
        r = rows_by_m[m]
        try:
            rows = shape.rows(m)
            spec = gpu_spec(torch.device("cuda"))
            r["tactic"] = r["tactic"] or tactic_list(launch_tactic(rows, n, k, g, True, spec))
            offs = [expert_offsets(c).to("cuda") for c in _routings(shape, m)]
            a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            h = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, n // 2, device="cuda", dtype=torch.bfloat16)
            sep = [lambda o=o, w=wp: (gemm.moe(a, o, w, out=h),
                                      swiglu.swiglu_clamp(h, SWIGLU_LIMIT, out))
                   for o in offs]  # fmt: skip
            fused = [lambda o=o, w=wpf: gemm.moe(a, o, w, out=out, swiglu=True,
                                                 swiglu_limit=SWIGLU_LIMIT)
                     for o in offs]  # fmt: skip
            reps = _reps(2.0 * rows * n * k)
            for key, fns in (("swiglu_sep_us", sep), ("swiglu_fused_us", fused)):
                fns[0]()  # compile outside capture
                r[key] = round(budget.measure(lambda fns=fns: graph_time_us(fns, reps)), 2)
        except Exception as e:  # noqa: BLE001
            r["swiglu_error"] = _err(e)
        print(f"  swiglu   {shape.name:20s} M={m:6d} sep={r['swiglu_sep_us']} "
              f"fused={r['swiglu_fused_us']} {r['swiglu_error'] or ''}")  # fmt: skip
    del wp, wpf
    torch.cuda.empty_cache()


def stream_candidates(m: int, moe: bool = False, sms: int = 0, groups: int = 1, k: int = 0) -> list:
    """The streaming decode configurations timed for M tokens (--impls stream), in this order
    (a time budget cuts the last): the narrowest token width that holds M (MoE: 8, an expert's
    rows at decode) and each row block throughout; with the GPU's SM count `sms`, first the
    persistent grid at 8 / 16 warps and 2 stages, sms and 2 sms CTAs in all (a grouped launch of
    `groups` groups: that over groups per group; MoE: 8 and 32 per expert tile), each also with
    resident activations when K (`k`) is given (one slot per K tile of the busiest warp); then
    one CTA per row block at 4 / 8 / 16 warps and 2 / 4 stages; where they fit shared memory."""
    from cutedsl.sm90.kernels.stream import ROWS, TOKENS, Sm90Nvfp4StreamGemmKernel

    tokens = 8 if moe else min(t for t in TOKENS if t >= m)
    cfgs = []
    if sms:
        grids = (8, 32) if moe else (max(1, sms // groups), max(1, 2 * sms // groups))
        cfgs += [(r, tokens, w, 2, p) for r in ROWS for w in (8, 16) for p in grids]
        if k:
            cfgs += [(*c, -(-(k // 64) // c[2])) for c in cfgs]
    cfgs += [(r, tokens, w, d) for r in ROWS for w in (4, 8, 16) for d in (2, 4)]
    return [StreamTactic(*c) for c in cfgs if Sm90Nvfp4StreamGemmKernel.config_error(*c) is None]


def bench_stream(shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget) -> None:
    """Rows with M <= 32: every `stream_candidates` configuration of the streaming decode kernel
    on the weight copies (dense, wo_a) or routings (routed experts) `bench_ours` uses;
    "stream_us" the fastest, "stream_tactic" its configuration, "stream_sweep_us" all of them."""
    from cutedsl.sm90.kernels.stream import TOKENS

    todo = [m for m in ms if m <= TOKENS[-1]]
    for m in ms:
        if m > TOKENS[-1]:
            rows_by_m[m]["stream_error"] = "n/a: M <= 32"
    if not todo:
        return
    moe = shape.kind == "moe"
    try:
        from cutedsl.sm90 import gemm

        g, n, k = shape.groups, shape.n, shape.k
        n_copies = 1 if moe else _copies(weight_bytes(g, n, k))
        wps = [random_prepared_weight(g, n, k) for _ in range(n_copies)]
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        per = g if shape.kind == "grouped" else 1
        cands = {m: stream_candidates(m, moe, sms, per, k) for m in todo}
        jit.prefetch(gemm.stream_jobs({t for ts in cands.values() for t in ts}, moe))
    except Exception as e:  # noqa: BLE001 - one implementation failing never stops the run
        _set(rows_by_m, todo, "stream_error", _err(e))
        return
    for m in todo:
        r = rows_by_m[m]
        try:
            rows = shape.rows(m)
            make, _ = gemm_calls(shape, m, wps)
            flops = 2.0 * rows * n * k * (g if shape.kind == "grouped" else 1)
            times = {}
            for t in cands[m]:
                if not budget.fits(f"stream {shape.name} M={m} {t}"):
                    break
                fns = make(t)
                fns[0]()  # compile outside capture
                times[str(t)] = round(budget.measure(lambda: graph_time_us(fns, _reps(flops))), 2)
            if times:
                best = min(times, key=times.get)
                r["stream_us"], r["stream_tactic"], r["stream_sweep_us"] = times[best], best, times
        except Exception as e:  # noqa: BLE001
            r["stream_error"] = _err(e)
        print(f"  stream   {shape.name:20s} M={m:6d} us={r['stream_us']} {r['stream_tactic']} "
              f"{r['stream_error'] or ''}")  # fmt: skip
    del wps
    torch.cuda.empty_cache()


def bench_copy(shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget) -> None:
    """Decode anchor (M <= 32): "copy_us" = `copy_time_us` of the row's weight + scale bytes (the
    elementwise kernel, the faster of the two stream kernels). It holds the launch and fill
    latency a GEMM reading those bytes cannot avoid either, unlike the 1 GiB stream;
    `pct_copy_time` = copy_us / ours us."""
    for m in [m for m in ms if m <= 32]:
        if not budget.fits(f"copy {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            groups = shape.groups
            if shape.kind == "moe":
                groups = r["active_experts"] or active_experts(_routings(shape, m))
            elif shape.kind == "dense":
                groups = 1
            nbytes = weight_bytes(groups, shape.n, shape.k)
            r["copy_us"] = round(budget.measure(lambda: copy_time_us(nbytes)), 2)
        except Exception as e:  # noqa: BLE001
            r["copy_error"] = _err(e)
        print(f"  copy     {shape.name:20s} M={m:6d} us={r['copy_us']} {r['copy_error'] or ''}")
    torch.cuda.empty_cache()


def bench_cublas(shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget) -> None:
    """BF16 baseline: torch.matmul / torch.bmm (cuBLAS), torch._grouped_mm for routed experts."""
    g, n, k = shape.groups, shape.n, shape.k
    impl = {
        "dense": "torch.matmul (cuBLAS)",
        "grouped": "torch.bmm (cuBLAS)",
        "moe": "torch._grouped_mm",
    }
    _set(rows_by_m, ms, "cublas_impl", impl[shape.kind])
    try:
        n_copies = 1 if shape.kind == "moe" else _copies(g * n * k * 2)
        ws = [torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies)]
    except Exception as e:  # noqa: BLE001
        _set(rows_by_m, ms, "cublas_error", _err(e))
        return
    for m in ms:
        if not budget.fits(f"cuBLAS {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            rows = shape.rows(m)
            if shape.kind == "moe":
                cs = _routings(shape, m)
                r["active_experts"] = active_experts(cs)
                ends = [expert_offsets(c)[1:].to("cuda") for c in cs]
                a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                wt = ws[0].transpose(1, 2)  # [E, K, N], column-major as _grouped_mm wants
                fns = [lambda e=e: torch._grouped_mm(a, wt, offs=e) for e in ends]
            elif shape.kind == "grouped":
                a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(g, m, n, device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w: torch.bmm(a, w.transpose(1, 2), out=out) for w in ws]
            else:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w: torch.matmul(a, w[0].t(), out=out) for w in ws]
            flops = 2.0 * rows * n * k * (g if shape.kind == "grouped" else 1)
            r["cublas_us"] = round(budget.measure(lambda: graph_time_us(fns, _reps(flops))), 2)
        except Exception as e:  # noqa: BLE001
            r["cublas_error"] = _err(e)
        print(f"  bf16     {shape.name:20s} M={m:6d} us={r['cublas_us']} {r['cublas_error'] or ''}")
    del ws
    torch.cuda.empty_cache()


def load_marlin():
    """((apply, rand_like, workspace), note) or (None, why not)."""
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_workspace_new,
        )
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            apply_fp4_marlin_linear,
            rand_marlin_weight_nvfp4_like,
        )

        ws = marlin_make_workspace_new(torch.device("cuda"))
    except Exception as e:  # noqa: BLE001 - report why Marlin is absent, never fail the bench
        return None, f"unavailable ({_err(e)})"
    return (apply_fp4_marlin_linear, rand_marlin_weight_nvfp4_like, ws), "vllm 0.21.0 Marlin"


def marlin_moe_weights(e: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random NVFP4 experts [E, N, K] (uniform bytes, e4m3 block scales in [0.5, 1), fp32
    global scales in [0.5, 1.5)) repacked for vLLM's Marlin MoE GEMM the way
    `prepare_nvfp4_moe_layer_for_marlin` repacks a checkpoint: (weight, scales, global scales)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        _nvfp4_compute_scale_factor,
        nvfp4_marlin_process_global_scale,
        nvfp4_marlin_process_scales,
    )

    dt = torch.bfloat16
    scales = (torch.rand(e, n, k // 16, device="cuda") * 0.5 + 0.5).to(torch.float8_e4m3fn).to(dt)
    factor = _nvfp4_compute_scale_factor(scales, dt)  # one for all experts, as vLLM
    perm = torch.empty(0, dtype=torch.int, device="cuda")
    qw, qs = [], []
    for i in range(e):
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        qw.append(
            ops.gptq_marlin_repack(
                b_q_weight=q.view(torch.int32).T.contiguous(),
                perm=perm,
                size_k=k,
                size_n=n,
                num_bits=4,
                is_a_8bit=False,
            )
        )
        ms = marlin_permute_scales(s=scales[i].T, size_k=k, size_n=n, group_size=16)
        qs.append(nvfp4_marlin_process_scales(ms, scale_factor=factor, a_dtype=dt)[0])
    gs = nvfp4_marlin_process_global_scale(torch.rand(e, device="cuda") + 0.5, dt) / factor
    return torch.stack(qw), torch.stack(qs), gs.float()


def marlin_moe_block_size(m: int, topk: int, e: int) -> int:
    """vLLM 0.21.0 fused_marlin_moe's block_size_m rule."""
    for bs in (8, 16, 32, 48, 64):
        if m * topk / e / bs < 0.9:
            return bs
    return 64


def bench_marlin_moe(
    shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget
) -> None:
    """vLLM Marlin NVFP4 MoE GEMM (`ops.moe_wna16_marlin_gemm`), over the bench's routings."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_workspace_new,
    )
    from vllm.scalar_type import scalar_types

    e, n, k, topk = shape.groups, shape.n, shape.k, shape.topk
    try:
        # fused_marlin_moe's workspace: 4 thread blocks per SM (the dense GEMM's has 1)
        mws = marlin_make_workspace_new(torch.device("cuda"), 4)
        mw = list(marlin_moe_weights(e, n, k))  # weight, scales, global scales
    except Exception as ex:  # noqa: BLE001
        _set(rows_by_m, ms, "marlin_error", _err(ex))
        return
    for m in ms:
        if not budget.fits(f"Marlin {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            n_routings = len(_routings(shape, m))
            ids = [routing(m, e, topk, seed=i).to("cuda", torch.int32) for i in range(n_routings)]
            bs = marlin_moe_block_size(m, topk, e)
            aligned = [moe_align_block_size(i, bs, e, ignore_invalid_experts=True) for i in ids]
            size_m, top_k = (m, topk) if shape.gate_up else (m * topk, 1)
            x = torch.randn(size_m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m * topk, n, device="cuda", dtype=torch.bfloat16)
            tw = torch.rand(m, topk, device="cuda")
            fns = [
                lambda a=a: ops.moe_wna16_marlin_gemm(
                    x,
                    out,
                    mw[0],
                    None,
                    mw[1],
                    None,
                    mw[2],
                    None,
                    None,
                    None,
                    mws,
                    *a,
                    tw,
                    moe_block_size=bs,
                    top_k=top_k,
                    mul_topk_weights=False,
                    b_q_type=scalar_types.float4_e2m1f,
                    size_m=size_m,
                    size_n=n,
                    size_k=k,
                    is_k_full=True,
                    use_atomic_add=False,
                    use_fp32_reduce=True,
                    is_zp_float=False,
                )
                for a in aligned
            ]
            flops = 2.0 * m * topk * n * k
            r["marlin_us"] = round(budget.measure(lambda: graph_time_us(fns, _reps(flops))), 2)
        except Exception as ex:  # noqa: BLE001
            r["marlin_error"] = _err(ex)
        print(f"  marlin   {shape.name:20s} M={m:6d} us={r['marlin_us']} {r['marlin_error'] or ''}")
    mw.clear()
    torch.cuda.empty_cache()


def bench_marlin(
    shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget, marlin
) -> None:
    """vLLM Marlin NVFP4 W4A16: apply_fp4_marlin_linear (dense), the MoE GEMM (routed experts,
    `bench_marlin_moe`); wo_a has no Marlin form in vLLM."""
    if shape.kind == "grouped":
        _set(rows_by_m, ms, "marlin_error", "n/a: no Marlin grouped (wo_a) GEMM in vLLM")
        return
    if marlin[0] is None:
        _set(rows_by_m, ms, "marlin_error", f"n/a: {marlin[1]}")
        return
    apply, rand_like, mws = marlin[0]
    if shape.kind == "moe":
        bench_marlin_moe(shape, ms, rows_by_m, budget)
        return
    n, k = shape.n, shape.k
    try:
        mq = []
        for _ in range(_copies(weight_bytes(1, n, k))):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            _, qw, sc, gs = rand_like(w, 16)
            mq.append((qw, sc, gs))
            del w
    except Exception as e:  # noqa: BLE001
        _set(rows_by_m, ms, "marlin_error", _err(e))
        return
    for m in ms:
        if not budget.fits(f"Marlin {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fns = [
                lambda q=q: apply(
                    input=x,
                    weight=q[0],
                    weight_scale=q[1],
                    weight_global_scale=q[2],
                    workspace=mws,
                    size_n=n,
                    size_k=k,
                )
                for q in mq
            ]
            r["marlin_us"] = round(
                budget.measure(lambda: graph_time_us(fns, _reps(2.0 * m * n * k))), 2
            )
        except Exception as e:  # noqa: BLE001
            r["marlin_error"] = _err(e)
        print(f"  marlin   {shape.name:20s} M={m:6d} us={r['marlin_us']} {r['marlin_error'] or ''}")
    del mq
    torch.cuda.empty_cache()


@dataclass
class DeepGemm:
    """What `load_deepgemm` found: the vllm.utils.deep_gemm module (None when unusable), the
    per_token_group_quant_fp8 function, whether vLLM would use UE8M0 scales, and a note."""

    mod: object | None
    quant: Callable | None
    e8m0: bool
    note: str


QUACK_RUN = (
    '. "$1" || exit 3; PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" '
    'exec python3 -m cutedsl.bench.quack_anchor "$3" "$4" "$5"'
)


def run_quack(
    env_file: str, shapes: list[tuple[str, Shape]], ms: list[int], budget: Budget
) -> dict:
    """The quack column for the dense `shapes` ((row name, Shape)): `cutedsl.bench.quack_anchor`
    run in the environment `env_file` sets up (bash-sourced), on this GPU, now. Returns its
    {"meta", "rows"}; on any failure {"meta": {"error": ...}, "rows": []} (never raises)."""
    if not shapes:
        return {"meta": {"error": "no dense shape selected"}, "rows": []}
    left = budget.left()
    seconds = 900.0 if math.isinf(left) else max(30.0, left / 2)
    repo = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory(prefix="quack-anchor-") as tmp:
        spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump({"shapes": [{"name": nm, "n": s.n, "k": s.k} for nm, s in shapes],
                       "ms": ms}, f)  # fmt: skip
        cmd = ["bash", "-c", QUACK_RUN, "quack", env_file, repo, spec, out, str(seconds)]
        t = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
            log, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"{e.stdout or ''}{e.stderr or ''}", f"timed out after {seconds + 300:.0f} s"
        budget.longest = max(budget.longest, time.monotonic() - t)
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            tail = " | ".join(str(log).strip().splitlines()[-3:])
            return {
                "meta": {"error": f"quack worker exit {rc}, no result: {tail}"[:600]},
                "rows": [],
            }
    if rc != 0:
        res["meta"]["error"] = res["meta"].get("import_error") or f"quack worker exit {rc}"
    return res


def fill_quack(
    name: str, shape: Shape, ms: list[int], rows_by_m: dict[int, dict], quack: dict
) -> None:
    """The quack column of one shape's rows from `run_quack`'s result."""
    if shape.kind != "dense":
        _set(rows_by_m, ms, "quack_error", f"n/a: quack has no {shape.kind} W4A16 GEMM")
        return
    got = {r["M"]: r for r in quack.get("rows", []) if r.get("shape") == name}
    for m in ms:
        q = got.get(m)
        row = rows_by_m[m]
        if q is None:
            row["quack_error"] = quack.get("meta", {}).get("error") or "not measured"
            continue
        row["quack_us"], row["quack_rel_err"] = q.get("us"), q.get("rel_err")
        row["quack_tactic"], row["quack_error"] = q.get("tactic"), q.get("error")


def load_deepgemm() -> DeepGemm:
    """Import vLLM's DeepGEMM wrappers; never raises (a failure comes back in `note`)."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
        )
        from vllm.utils import deep_gemm as vdg

        if not vdg.is_deep_gemm_supported():
            return DeepGemm(
                None,
                None,
                False,
                "unavailable: vllm.utils.deep_gemm.is_deep_gemm_supported() "
                "is False (no Hopper/Blackwell GPU, VLLM_USE_DEEP_GEMM=0, or no deep_gemm)",
            )
        e8m0 = bool(vdg.is_deep_gemm_e8m0_used())
        dg = vdg._import_deep_gemm()
        ver = getattr(dg, "__version__", "?")
        src = getattr(dg, "__name__", "?")
        return DeepGemm(vdg, per_token_group_quant_fp8, e8m0, f"{src} {ver}, e8m0={e8m0}")
    except Exception as e:  # noqa: BLE001
        return DeepGemm(None, None, False, f"unavailable ({_err(e)})")


def deepgemm_applies(shape: Shape) -> str | None:
    """None when DeepGEMM FP8 covers the shape, else the reason (vLLM's own checks:
    should_use_deepgemm_for_fp8_linear N%64, K%128; MoE N%128, K%128; fp8_einsum 128 blocks)."""
    if shape.kind == "dense" and (shape.n % 64 or shape.k % 128):
        return f"n/a: N={shape.n} % 64 or K={shape.k} % 128 != 0"
    if shape.kind in ("grouped", "moe") and (shape.n % 128 or shape.k % 128):
        return f"n/a: N={shape.n} or K={shape.k} not a multiple of 128"
    return None


def bench_deepgemm(
    shape: Shape, ms: list[int], rows_by_m: dict[int, dict], budget: Budget, dg: DeepGemm
) -> None:
    """DeepGEMM FP8 (see the module docstring for the exact calls); never raises."""
    why = deepgemm_applies(shape)
    if why is None and dg.mod is None:
        why = f"n/a: DeepGEMM {dg.note}"
    if why is not None:
        _set(rows_by_m, ms, "deepgemm_error", why)
        return
    vdg = dg.mod
    g, n, k = shape.groups, shape.n, shape.k
    try:
        n_copies = 1 if shape.kind == "moe" else _copies(fp8_weight_bytes(g, n, k))
        ws = []
        for _ in range(n_copies):
            w = _rand_fp8((g, n, k))
            s = torch.rand(g, n // 128, k // 128, device="cuda") + 0.5
            ws.append((w[0], s[0]) if shape.kind == "dense" else (w, s))
        align = vdg.get_mk_alignment_for_contiguous_layout()[0] if shape.kind == "moe" else 1
    except Exception as e:  # noqa: BLE001
        _set(rows_by_m, ms, "deepgemm_error", _err(e))
        return
    for m in ms:
        if not budget.fits(f"DeepGEMM {shape.name} M={m}"):
            return
        r = rows_by_m[m]
        try:
            if shape.kind == "moe":
                cs = _routings(shape, m)
                r["active_experts"] = active_experts(cs)
                idx = [contiguous_m_indices(c, align).to("cuda") for c in cs]
                m_max = max(int(i.numel()) for i in idx)
                r["deepgemm_rows"] = round(sum(int(i.numel()) for i in idx) / len(idx), 1)
                a = _rand_fp8((m_max, k))
                sa = [
                    vdg.get_col_major_tma_aligned_tensor(
                        torch.rand(int(i.numel()), k // 128, device="cuda") + 0.5
                    )
                    for i in idx
                ]
                out = torch.empty(m_max, n, device="cuda", dtype=torch.bfloat16)
                w, s = ws[0]
                fns = [
                    lambda i=i, sa_i=sa_i: vdg.m_grouped_fp8_gemm_nt_contiguous(
                        (a[: i.numel()], sa_i), (w, s), out[: i.numel()], i
                    )
                    for i, sa_i in zip(idx, sa, strict=True)
                ]
                q_in = torch.randn(m_max, k, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * shape.rows(m) * n * k
            elif shape.kind == "grouped":
                # vLLM's SM90 o-proj layout: a [T, G, K] fp8 = transpose of [G, T, K]; scales
                # [T, G, K/128] fp32 = transpose of [G, T, K/128] with strides (S*Ta, 1, Ta).
                sk, ta = k // 128, -(-m // 4) * 4
                a = _rand_fp8((g, m, k)).transpose(0, 1)
                buf = torch.empty(g * sk * ta, device="cuda").as_strided(
                    (g, m, sk), (sk * ta, 1, ta)
                )
                buf.copy_(torch.rand(g, m, sk, device="cuda") + 0.5)
                sa = buf.transpose(0, 1)
                z = torch.empty(m, g, n, device="cuda", dtype=torch.bfloat16)
                fns = [
                    lambda w=w, s=s: vdg.fp8_einsum(
                        "bhr,hdr->bhd", (a, sa), (w, s), z, recipe=(1, 128, 128)
                    )
                    for w, s in ws
                ]
                q_in = torch.randn(m * g, k, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * g * m * n * k
                r["deepgemm_rows"] = m
            else:
                a = _rand_fp8((m, k))
                sa = vdg.get_col_major_tma_aligned_tensor(
                    torch.rand(m, k // 128, device="cuda") + 0.5
                )
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w, s=s: vdg.fp8_gemm_nt((a, sa), (w, s), out) for w, s in ws]
                q_in = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * m * n * k
                r["deepgemm_rows"] = m
            r["deepgemm_us"] = round(budget.measure(lambda: graph_time_us(fns, _reps(flops))), 2)
            qfn = [lambda: dg.quant(q_in, 128, column_major_scales=True, use_ue8m0=dg.e8m0)]
            r["deepgemm_quant_us"] = round(budget.measure(lambda: graph_time_us(qfn, 20)), 2)
        except Exception as e:  # noqa: BLE001 - JIT missing, unsupported shape, ...
            r["deepgemm_error"] = _err(e)
        print(
            f"  deepgemm {shape.name:20s} M={m:6d} us={r['deepgemm_us']} "
            f"quant_us={r['deepgemm_quant_us']} {r['deepgemm_error'] or ''}"
        )
    del ws
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ output

MD_COLS = [  # (header, key, format); the copy columns only for M <= 32
    ("shape", "shape", "s"),
    ("M", "M", "d"),
    ("rows", "rows", "d"),
    ("N", "N", "d"),
    ("K", "K", "d"),
    ("tactic", "tactic", "t"),
    ("ours us", "us", ".1f"),
    ("best tactic (--sweep)", "best_tactic", "t"),
    ("best us", "best_us", ".1f"),
    ("TF/s", "tflops", ".1f"),
    ("GB/s", "weight_GBps", ".0f"),
    ("% copy BW (M<=32)", "pct_copy_bw", ".1f"),
    ("same-bytes copy us", "copy_us", ".1f"),
    ("copy us / ours (%)", "pct_copy_time", ".1f"),
    ("cuBLAS us", "cublas_us", ".1f"),
    ("Marlin us", "marlin_us", ".1f"),
    ("DeepGEMM us (GEMM only)", "deepgemm_us", ".1f"),
    ("DG act-quant us", "deepgemm_quant_us", ".1f"),
    ("cuBLAS/ours", "x_cublas", ".2f"),
    ("Marlin/ours", "x_marlin", ".2f"),
    ("DG/ours", "x_deepgemm", ".2f"),
    ("(DG+quant)/ours", "x_deepgemm_total", ".2f"),
    ("quack us", "quack_us", ".1f"),
    ("quack/ours", "x_quack", ".2f"),
    ("stream us", "stream_us", ".1f"),
    ("stream tactic", "stream_tactic", "s"),
    ("copy us / stream (%)", "pct_copy_time_stream", ".1f"),
    ("ours/stream", "x_stream", ".2f"),
    ("notes", "notes", "s"),
]


def _cell(r: dict, key: str, fmt: str) -> str:
    if key == "notes":
        errs = [
            f"{w}: {r[f'{w}_error']}"
            for w in ("ours", "cublas", "marlin", "deepgemm", "copy", "quack", "swiglu", "stream")
            if r.get(f"{w}_error")
            and not str(r[f"{w}_error"]).startswith(
                (
                    "n/a: Marlin column",
                    "n/a: no Marlin",
                    "n/a: quack",
                    "n/a: routed w13",
                    "n/a: M <= 32",
                )
            )
        ]
        return "; ".join(errs).replace("|", "/")
    v = r.get(key)
    if key in ("pct_copy_bw", "copy_us", "pct_copy_time", "pct_copy_time_stream") and r["M"] > 32:
        return ""
    if v is None:
        if key == "deepgemm_us" and str(r.get("deepgemm_error") or "").startswith("n/a"):
            return "n/a"
        if key == "marlin_us" and str(r.get("marlin_error") or "").startswith("n/a"):
            return "n/a"
        if key == "quack_us" and str(r.get("quack_error") or "").startswith("n/a"):
            return "n/a"
        if key == "stream_us" and str(r.get("stream_error") or "").startswith("n/a"):
            return "n/a"
        return "-"
    if fmt == "t":
        return v if isinstance(v, str) else "x".join(str(x) for x in v)
    return format(v, fmt)


# (implementation, its time column) the fixed-cost fit is made for
FIT_COLS = (("ours", "us"), ("copy", "copy_us"), ("marlin", "marlin_us"), ("cublas", "cublas_us"),
            ("quack", "quack_us"))  # fmt: skip


def fit_cost(rows: list[dict]) -> list[dict]:
    """Per implementation and M, over the custom dense rows (3 or more shapes with a time): the
    least-squares line time_us = fixed_us + bytes / rate, bytes = the NVFP4 weight + scale bytes
    of the row (BF16 and FP8 implementations read more; their rate is per NVFP4 byte).
    Ours also per tactic timed by --sweep (impl "ours@<tactic>": one kernel configuration over
    the shapes, where the launch tactic changes with the shape).
    One record {impl, M, shapes, fixed_us, rate_GBps, max_resid_pct} each."""
    out = []
    custom = [r for r in rows if r["model"] == "custom"]
    for m in sorted({r["M"] for r in custom}):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in (r for r in custom if r["M"] == m):
            wb = weight_bytes(1, r["N"], r["K"])
            for impl, col in FIT_COLS:
                if r.get(col):
                    series.setdefault(impl, []).append((wb, r[col]))
            for tac, us in sorted((r.get("sweep_us") or {}).items()):
                series.setdefault(f"ours@{tac}", []).append((wb, us))
        for impl, pts in series.items():
            if len(pts) < 3:
                continue
            n = len(pts)
            mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            if sxx == 0:
                continue
            slope = sum((x - mx) * (y - my) for x, y in pts) / sxx  # us per byte
            fixed = my - slope * mx
            resid = max(abs(y - fixed - slope * x) / y for x, y in pts)
            out.append({
                "impl": impl, "M": m, "shapes": n, "fixed_us": round(fixed, 2),
                "rate_GBps": round(1e-3 / slope) if slope > 0 else None,
                "max_resid_pct": round(100 * resid, 1),
            })  # fmt: skip
    return out


def format_md(meta: dict, rows: list[dict]) -> str:
    """The readable report: header notes, one pipe table, the fixed-cost fit, the summary."""
    out = [f"# sm_90a NVFP4 W4A16 GEMM bench ({meta['date']})", "", f"`{meta['command']}`", ""]
    out += [f"- {h}" for h in meta["header"]]
    if meta.get("stopped_early"):
        out.append(f"- **stopped early**: {meta['stopped_early']}")
    out += ["", "| " + " | ".join(h for h, _, _ in MD_COLS) + " |"]
    out.append("|" + "|".join("---" for _ in MD_COLS) + "|")
    for r in rows:
        out.append("| " + " | ".join(_cell(r, k, f) for _, k, f in MD_COLS) + " |")
    fit = meta.get("fit") or []
    if fit:
        out += ["", "Fixed cost and streaming rate (least squares over the --dense shapes: "
                "time = fixed + NVFP4 bytes / rate):", "",
                "| impl | M | shapes | fixed us | rate GB/s | max residual % |",
                "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for f in fit:
            rate = "—" if f["rate_GBps"] is None else f"{f['rate_GBps']}"
            out.append(f"| {f['impl']} | {f['M']} | {f['shapes']} | {f['fixed_us']:.2f} | "
                       f"{rate} | {f['max_resid_pct']:.1f} |")  # fmt: skip
    sw = [r for r in rows if r.get("swiglu_sep_us") or r.get("swiglu_fused_us")]
    if sw:
        out += ["", f"Routed w13 with the clamped SwiGLU (limit {SWIGLU_LIMIT:g}): GEMM, then the "
                "SwiGLU kernel vs the SwiGLU fused into the GEMM's epilogue:", "",
                "| shape | M | rows | tactic | GEMM + SwiGLU us | fused us | sep / fused |",
                "|---|---:|---:|---|---:|---:|---:|"]  # fmt: skip
        for r in sw:
            cells = [_cell(r, key, fmt) for key, fmt in (
                ("tactic", "t"), ("swiglu_sep_us", ".1f"), ("swiglu_fused_us", ".1f"),
                ("x_swiglu_fused", ".2f"))]  # fmt: skip
            out.append(f"| {r['shape']} | {r['M']} | {r['rows']} | " + " | ".join(cells) + " |")
    out += ["", "summary: " + json.dumps(meta.get("summary", {})), ""]
    return "\n".join(out)


def write_outputs(json_path: str, md_path: str, meta: dict, rows: list[dict]) -> None:
    """JSON: meta (command, date, device, versions, ...) + rows (one record per row); MD."""
    meta = dict(meta, summary=summarize(rows), fit=fit_cost(rows), rows=rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(meta, f, indent=1)
    if md_path:
        with open(md_path, "w") as f:
            f.write(format_md(meta, rows))


def versions() -> dict:
    """Package versions from their metadata (no heavy imports)."""
    from importlib import metadata

    v = {"python": sys.version.split()[0], "torch": torch.__version__}
    for key, dist in (("cutlass_dsl", "nvidia-cutlass-dsl"), ("vllm", "vllm")):
        try:
            v[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            v[key] = None
    return v


# ------------------------------------------------------------------------------ main


IMPLS = ("ours", "cublas", "marlin", "deepgemm", "copy")  # the default
ALL_IMPLS = (*IMPLS, "quack", "swiglu", "stream")  # only by name: quack (--quack-env), ...
EXAMPLES = [
    "python -m cutedsl.bench.gemm_sm90 --json r/gemm.json --md r/gemm.md   # every shape and M",
    "python -m cutedsl.bench.gemm_sm90 --model flash --ms 1,16,4096 --shapes wq_b,wo_b "
    "--impls ours,cublas",
    "python -m cutedsl.bench.gemm_sm90 --model pro --list-shapes   # no GPU needed",
    "python -m cutedsl.bench.gemm_sm90 --model flash --impls ours --sweep grid "
    "--ms 1,16,32,64,128,256,512,1024,4096 --shapes fused_wqa_wkv,wq_b --json sweep.json",
    "python -m cutedsl.bench.tune_sm90 sweep.json   # -> cutedsl/tuned/sm90/<device>.json",
    "python -m cutedsl.bench.gemm_sm90 --time-budget 600 --json r.json --md r.md",
    "python -m cutedsl.bench.gemm_sm90 --model flash --ms 1,4,16,32 --impls ours,quack,copy "
    "--quack-env /opt/quack/env.sh   # quack-kernels in its own environment",
    "python -m cutedsl.bench.gemm_sm90 --dense 4096x1024,4096x2048,4096x4096,4096x8192 --ms 4 "
    "--impls ours,copy   # fixed cost vs streaming rate",
    "python -m cutedsl.bench.gemm_sm90 --model all --shapes 'routed_w13(E=256),routed_w13(E=384)' "
    "--ms 1,4,16,64,512,4096 --impls swiglu   # SwiGLU fused into w13 vs its own kernel",
    "python -m cutedsl.bench.gemm_sm90 --model all --ms 1,4,16,32 --impls ours,stream,copy "
    "   # the streaming decode kernel",
]


def _comma_list(kind: Callable[[str], object], allowed: tuple | None = None) -> Callable:
    def parse(text: str) -> list:
        try:
            items = [kind(x) for x in text.split(",") if x]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: " + (f"unknown {bad}, expected of {list(allowed)}" if bad else "empty")
            )
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options (argparse exits 2 on a bad one, before anything runs)."""
    p = make_parser("cutedsl.bench.gemm_sm90", __doc__.split("\n\n")[0], EXAMPLES)
    names = tuple(dict.fromkeys(s.name for m in MODELS for s in SHAPES[m]))
    p.add_argument("--model", default="all", choices=["flash", "pro", "all", "both"])
    p.add_argument(
        "--ms",
        type=_comma_list(int),
        default=list(M_LIST),
        help=f"comma list of token counts (default {','.join(map(str, M_LIST))})",
    )
    p.add_argument(
        "--shapes",
        type=_comma_list(str, names),
        default=[],
        help="comma list of shape names to keep, without the model prefix (--list-shapes)",
    )
    p.add_argument(
        "--impls",
        type=_comma_list(str, ALL_IMPLS),
        default=list(IMPLS),
        help=f"comma list of implementations to time (default {','.join(IMPLS)}; also quack)",
    )
    p.add_argument(
        "--quack-env",
        default="",
        metavar="FILE",
        help="for --impls quack: a bash file that, sourced, gives python3 quack-kernels >= 0.6 "
        "(with its own nvidia-cutlass-dsl); the quack column runs there",
    )
    p.add_argument(
        "--sweep",
        nargs="?",
        const="neighbours",
        default="",
        choices=["neighbours", "grid"],
        help="also time other tactics of ours (best_tactic): the launch tactic's neighbours, "
        "or a grid (the input of tune_sm90)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="stop cleanly (writing JSON/MD) before S seconds of wall time",
    )
    p.add_argument("--json", default="", metavar="PATH", help="write the rows and meta as JSON")
    p.add_argument("--md", default="", metavar="PATH", help="write the readable table")
    p.add_argument("--list-shapes", action="store_true", help="print the shape table and exit")
    p.add_argument(
        "--dense",
        type=_comma_list(_dense_shape),
        default=[],
        metavar="NxK,...",
        help="time these dense N x K shapes (multiples of 64) instead of the models' shapes; "
        "with 3 or more, also the fixed cost + streaming rate fit per implementation",
    )
    return p.parse_args(argv)


def _dense_shape(text: str) -> Shape:
    """'NxK' -> a dense Shape named 'NxK' (N and K multiples of 64, as our kernels need)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{text!r} is not NxK (e.g. 4096x1024)") from None
    if n <= 0 or k <= 0 or n % 64 or k % 64:
        raise ValueError(f"{text!r}: N and K must be positive multiples of 64")
    return Shape(f"{n}x{k}", "dense", n, k)


def selected_shapes(args: argparse.Namespace) -> list[tuple[str, Shape]]:
    if args.dense:
        return [("custom", s) for s in args.dense]
    models = list(MODELS) if args.model in ("all", "both") else [args.model]
    keep = set(args.shapes)
    return [(mdl, s) for mdl in models for s in SHAPES[mdl] if not keep or s.name in keep]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ms = args.ms
    todo = selected_shapes(args)
    if args.list_shapes:
        for mdl, s in todo:
            print(
                f"{mdl}.{s.name:20s} {s.kind:8s} groups={s.groups:4d} topk={s.topk} "
                f"N={s.n:6d} K={s.k:6d}"
            )
        return 0
    impls = set(args.impls)
    if "quack" in impls and not os.path.isfile(args.quack_env):
        print(
            f"cutedsl.bench.gemm_sm90: --impls quack needs --quack-env FILE (a bash file setting up "
            f"quack-kernels' environment); got {args.quack_env!r}",
            file=sys.stderr,
        )
        return 2
    problem = gpu_problem()
    if problem:
        print(f"cutedsl.bench.gemm_sm90: {problem}", file=sys.stderr)
        return 1
    budget = Budget(args.time_budget)
    marlin = load_marlin() if "marlin" in impls else (None, "not requested")
    dg = load_deepgemm() if "deepgemm" in impls else DeepGemm(None, None, False, "not requested")
    streams = stream_bandwidths_gbps()
    copy_bw = max(streams.values())
    dev = torch.cuda.get_device_properties(0)
    cmd = "python -m cutedsl.bench.gemm_sm90 " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    header = [
        f"device: {dev.name}, {dev.multi_processor_count} SMs; "
        + ", ".join(f"{k} {v}" for k, v in versions().items()),
        "timing: CUDA graph of back-to-back calls over rotated weight copies / routings "
        "(>3x L2), median of 5 replays, CUDA events",
        f"measured copy bandwidth (1 GiB -> 1 GiB, read+write, the faster of memcpy "
        f"{streams['memcpy']:.0f} and a bf16 elementwise kernel {streams['elementwise']:.0f}): "
        f"{copy_bw:.0f} GB/s",
        "GB/s = NVFP4 weight+scale bytes (0.5625 B/param; routed: active experts) / time",
        f"Marlin: {marlin[1]}; DeepGEMM: {dg.note}",
        "DeepGEMM us excludes activation quantization (FP8 1x128, timed alone in 'DG act-quant "
        "us': vLLM per_token_group_quant_fp8 on the A rows the GEMM reads); weights FP8 128x128",
        "ratios X/ours = t_X / t_ours (> 1: ours faster); routed cuBLAS = torch._grouped_mm",
    ]
    print("\n".join(header), flush=True)
    meta = dict(
        command=cmd,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=dev.name,
        sms=dev.multi_processor_count,
        versions=versions(),
        torch=torch.__version__,
        cutlass_dsl=versions()["cutlass_dsl"],
        vllm=versions()["vllm"],
        marlin=marlin[1],
        deepgemm=dg.note,
        copy_bw_GBps=round(copy_bw),
        stream_GBps={k: round(v) for k, v in streams.items()},
        copy_bw_anchor="max(memcpy, elementwise)",
        time_budget_s=args.time_budget,
        header=header,
        stopped_early="",
    )
    quack: dict = {}
    if "quack" in impls:
        qshapes = [(f"{mdl}.{s.name}", s) for mdl, s in todo if s.kind == "dense"]
        quack = run_quack(args.quack_env, qshapes, ms, budget)
        meta["quack"] = quack.get("meta")
        print(f"quack: {quack.get('meta')}", flush=True)
    rows: list[dict] = []
    for mdl, shape in todo:
        if not budget.fits(f"{mdl}.{shape.name}"):
            break
        rows_by_m = {m: new_row(mdl, shape, m) for m in ms}
        print(f"== {mdl}.{shape.name} {shape}", flush=True)
        if "ours" in impls:
            bench_ours(shape, ms, rows_by_m, budget, sweep=args.sweep)
        if "cublas" in impls:
            bench_cublas(shape, ms, rows_by_m, budget)
        if "marlin" in impls:
            bench_marlin(shape, ms, rows_by_m, budget, marlin)
        if "deepgemm" in impls:
            bench_deepgemm(shape, ms, rows_by_m, budget, dg)
        if "copy" in impls:
            bench_copy(shape, ms, rows_by_m, budget)
        if "quack" in impls:
            fill_quack(f"{mdl}.{shape.name}", shape, ms, rows_by_m, quack)
        if "swiglu" in impls:
            bench_swiglu(shape, ms, rows_by_m, budget)
        if "stream" in impls:
            bench_stream(shape, ms, rows_by_m, budget)
        rows += [finalize_row(rows_by_m[m], copy_bw) for m in ms]
        meta["stopped_early"] = budget.stopped
        write_outputs(args.json, args.md, meta, rows)
    meta["stopped_early"] = budget.stopped
    write_outputs(args.json, args.md, meta, rows)
    print("summary:", json.dumps(summarize(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
