#!/usr/bin/env python3
"""Fill DeepGEMM's JIT cache for upstream vLLM 0.21.0's FP8 linear layers of a DeepSeek V4 checkpoint,
with several processes at once.

    python bench/deepgemm_prewarm.py CKPT_DIR [--max-tokens 8192] [--jobs 12]

At start-up vLLM 0.21.0 calls DeepGEMM's `fp8_gemm_nt` once per (weight shape, M) of its warm-up
list (VLLM_DEEP_GEMM_WARMUP=relax) in one process, and each call whose kernel is not in the cache
compiles it: on a fresh machine that is about 1,700 calls and 10 minutes for the flash-layers
checkpoint. This makes the same calls, with the same weight preparation
(`deepgemm_post_process_fp8_weight_block`) and the same M values, spread over --jobs processes that
share DeepGEMM's cache directory (DG_JIT_CACHE_DIR, by default under VLLM_CACHE_ROOT as vLLM sets
it), so the server's own warm-up, which still runs unchanged, finds its kernels compiled.
--max-tokens must be the server's max_num_batched_tokens. Only CKPT_DIR/config.json is read.
A benchmark helper for the upstream baseline; it needs a Hopper or Blackwell GPU and DeepGEMM.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

# DeepGEMM's block-scaled FP8 alignment of N and K (get_mk_alignment_for_contiguous_layout)
BLOCK = 128
CHUNK = 32  # warm-up calls per task: neighbouring M values mostly share a kernel


def fp8_linear_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(layer, N, K) of the 2-D FP8 block-scaled linear weights of upstream's DeepseekV4 model that
    DeepGEMM's warm-up visits, one per distinct (N, K) with both multiples of 128, in model order.
    wo_a is a grouped einsum (a 3-D weight after loading); the compressors and the indexer's
    weights_proj are BF16; the routed experts are MXFP4."""
    h, q, d = cfg["hidden_size"], cfg["q_lora_rank"], cfg["head_dim"]
    shapes = [
        ("attn.fused_wqa_wkv", q + d, h),
        ("attn.wq_b", cfg["num_attention_heads"] * d, q),
        ("attn.wo_b", h, cfg["o_groups"] * cfg["o_lora_rank"]),
    ]
    # the lightning indexer sits in the layers that compress by 4
    if 4 in cfg.get("compress_ratios", [])[: cfg["num_hidden_layers"]]:
        shapes.append(("attn.indexer.wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], q))
    if cfg.get("n_shared_experts", 0):
        inter = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
        shapes += [("ffn.shared_experts.gate_up_proj", 2 * inter, h),
                   ("ffn.shared_experts.down_proj", h, inter)]  # fmt: skip
    seen: set[tuple[int, int]] = set()
    out = []
    for name, n, k in shapes:
        if n % BLOCK == 0 and k % BLOCK == 0 and (n, k) not in seen:
            seen.add((n, k))
            out.append((name, n, k))
    return out


def chunks(
    work: list[tuple[int, int, list[int]]], size: int = CHUNK
) -> list[tuple[int, int, list[int]]]:
    """Split each (N, K, M values) into tasks of at most `size` consecutive M values."""
    return [(n, k, ms[i : i + size]) for n, k, ms in work for i in range(0, len(ms), size)]


def _check_config(cfg: dict, path: Path) -> None:
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise SystemExit(
            f"deepgemm_prewarm: {path}: quantization_config is not block-scaled FP8 with "
            f"weight_block_size [{BLOCK}, {BLOCK}] (got {qc or 'none'}): DeepGEMM serves no layer of it"
        )


_WEIGHTS: dict = {}  # per worker process: (N, K) -> prepared weight, scales and activation buffers


def _task(args: tuple[int, int, list[int], int]) -> int:
    """Run DeepGEMM's fp8_gemm_nt as vLLM's warm-up does, for one weight shape and some M values."""
    import torch
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        deepgemm_post_process_fp8_weight_block,
    )
    from vllm.utils.deep_gemm import (
        fp8_gemm_nt,
        get_mk_alignment_for_contiguous_layout,
        is_deep_gemm_e8m0_used,
    )

    n, k, ms, max_tokens = args
    if (n, k) not in _WEIGHTS:
        w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(n // BLOCK, k // BLOCK, device="cuda") + 0.5
        w, ws = deepgemm_post_process_fp8_weight_block(
            wq=w, ws=ws, quant_block_shape=(BLOCK, BLOCK), use_e8m0=is_deep_gemm_e8m0_used()
        )
        a = torch.empty(max_tokens, k, device="cuda", dtype=torch.float8_e4m3fn)
        block_m = get_mk_alignment_for_contiguous_layout()[0]  # as vLLM's warm-up sizes them
        a_s = torch.empty(max_tokens, k // block_m, device="cuda", dtype=torch.float32)
        out = torch.empty(max_tokens, n, device="cuda", dtype=torch.bfloat16)
        _WEIGHTS[(n, k)] = (w, ws, a, a_s, out)
    w, ws, a, a_s, out = _WEIGHTS[(n, k)]
    for m in ms:
        fp8_gemm_nt((a[:m], a_s[:m]), (w, ws), out[:m])
    torch.cuda.synchronize()
    return len(ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path, help="checkpoint directory (its config.json is read)")
    ap.add_argument(
        "--max-tokens", type=int, default=8192, help="the server's max_num_batched_tokens"
    )
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    args = ap.parse_args(argv)
    path = args.ckpt / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"deepgemm_prewarm: {path}: {e}") from None
    _check_config(cfg, path)
    if (cfg["quantization_config"].get("scale_fmt") == "ue8m0"
            and "VLLM_USE_DEEP_GEMM_E8M0" not in os.environ):  # fmt: skip
        # as vLLM's config loading does for this checkpoint
        os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "1"

    import torch
    from vllm import envs
    from vllm.model_executor.warmup.deep_gemm_warmup import _get_fp8_gemm_nt_m_values

    shapes = fp8_linear_shapes(cfg)
    work = []
    for _, n, k in shapes:
        w = torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn)
        work.append((n, k, _get_fp8_gemm_nt_m_values(w, args.max_tokens)))
    tasks = chunks(work)
    total = sum(len(ms) for _, _, ms in work)
    cache = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(envs.VLLM_CACHE_ROOT, "deep_gemm")
    print(f"deepgemm_prewarm: {total} warm-up calls for {len(shapes)} weight shapes "
          f"({', '.join(f'{s} {n}x{k}' for s, n, k in shapes)}), {len(tasks)} tasks on "
          f"{args.jobs} processes, cache {cache}", flush=True)  # fmt: skip
    t0, done = time.monotonic(), 0
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for i, n_calls in enumerate(
            pool.imap_unordered(_task, [(*t, args.max_tokens) for t in tasks]), 1
        ):
            done += n_calls
            if i % max(1, len(tasks) // 10) == 0 or i == len(tasks):
                print(
                    f"deepgemm_prewarm: {done}/{total} calls, {time.monotonic() - t0:.0f} s",
                    flush=True,
                )
    print(f"deepgemm_prewarm: done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
