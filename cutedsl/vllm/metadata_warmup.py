"""Compile vLLM's DeepSeek V4 step-metadata kernels (Triton's, and one of DeepGEMM's) for every
batch they can meet, while the weights load, so that no engine step stalls on their compiles.

Triton compiles one binary per specialization of a call: each constexpr's value and, for each
integer argument, whether it equals 1 (then a constant) or is divisible by 16 (then marked so),
and for each pointer whether it is 16-byte aligned. vLLM 0.21.0 compiles these kernels on first
use, inside an engine step, stalling every running request: on an H100, the first request after
the server reported healthy compiled them (vLLM's Triton JIT monitor names them), and later runs
at concurrency 4 to 128 compiled new specializations of `_compute_prefill_metadata_kernel`, in
our server and in upstream's alike. The kernels and the arguments of their one call site each:

- `_compute_prefill_metadata_kernel` (`vllm/v1/attention/backends/mla/sparse_swa.py`, every step
  with prefills): `(pfx_gather_lens, seq_lens, query_start_loc, num_prefills, num_decodes,
  window_size, BLOCK_SIZE=next_power_of_2(num_prefills))`, three whole int32 tensors (aligned);
- `_compute_slot_mapping_kernel` (`vllm/v1/worker/block_table.py`, every step, each KV-cache
  group): `(num_tokens, max_num_batched_tokens, query_start_loc, positions, block_table,
  block_table.stride(0), block_size, slot_mapping)` and the context-parallel constants; the
  group's block size and table stride are known only once the KV cache is laid out, so every
  class of each is warmed;
- `_build_prefill_chunk_metadata_kernel` (`vllm/v1/attention/backends/mla/indexer.py`, each
  indexer prefill chunk, the compress-ratio-4 layers): `(query_start_loc, seq_lens[start:end],
  cu_seq_lens, token_to_seq, ks, ke, qs_start, qs_stop, BLOCK_SIZE=1024, COMPRESS_RATIO)`, of
  which only the seq_lens slice can start off a 16-byte boundary.

And one DeepGEMM kernel, `smxx_paged_mqa_logits_metadata` (the indexer's decode schedule, built by
`get_paged_mqa_logits_metadata(seq_lens, storage block size, SM count)` in
`DeepseekV32IndexerMetadataBuilder.build`, every step with decodes): DeepGEMM JIT-compiles one
binary per batch size rounded up to 32 (`kAlignedBatchSize`,
deep_gemm/scheduler/paged_mqa_logits.cuh); CUDA-graph capture meets only the classes of the
capture sizes (with sizes 1 to 128 in powers of two, not 65 to 96 decodes), and a run at
concurrency 128 compiled one mid-serving. `paged_mqa_batches(ctx)` lists one batch per class up
to the most decode rows a step can have (`max_num_seqs` times the tokens per decode with MTP);
`warm_deepgemm` calls vLLM's function with the builder's own block size and SM count, once the
weights have loaded (`finish`).

Two more Triton kernels run in every prefill step of every attention layer
(`vllm/v1/attention/ops/deepseek_v4_ops/cache_utils.py`, called from `_forward_prefill` in
deepseek_v4_attention.py): `_dequantize_and_gather_k_kernel` (the compressed and the sliding-window
KV of each prefill chunk into a BF16 workspace) and `_combine_topk_swa_indices_kernel`. Their
constexprs include the KV cache's layout (block-table width, cache block size, the cache's block
stride in bytes), known only once the KV cache exists, so they are warmed from the attention layer
itself on its first call with its caches and a step's metadata (`warm_prefill_gather`; CUDA-graph
capture's warm-up steps come before serving), one call per specialization `gather_calls` lists:
the slices of seq_lens, query_start_loc and the block tables start at the row of a chunk's first
prefill and the top-k slices at its first query, so they may start off a 16-byte boundary;
everything else is fixed by the layer.

`calls(ctx)` lists, per kernel, one call per specialization the call site can produce (a CPU test
checks each list against every reachable call with Triton's own specialization function);
`start(ctx)` compiles them in a background thread (`JITFunction.warmup`, from Triton's disk cache
when there, then `_prepare`: the binary loaded and its launcher built, which Triton otherwise
does at the first launch, a C compile per new signature; nothing is launched) and `finish()`
waits for it, then warms the DeepGEMM kernel. A failure only logs a warning: a kernel then compiles on first use, as it would
without this.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

# each kernel: (its module, its parameters in vLLM 0.21.0, in order; a CPU test keeps them equal)
KERNELS = {
    "_compute_prefill_metadata_kernel": (
        "vllm.v1.attention.backends.mla.sparse_swa",
        ("prefill_gather_lens_ptr", "seq_lens_ptr", "query_start_loc_ptr", "num_prefills",
         "num_decodes", "window_size", "BLOCK_SIZE"),
    ),
    "_compute_slot_mapping_kernel": (
        "vllm.v1.worker.block_table",
        ("num_tokens", "max_num_tokens", "query_start_loc_ptr", "positions_ptr", "block_table_ptr",
         "block_table_stride", "block_size", "slot_mapping_ptr", "TOTAL_CP_WORLD_SIZE",
         "TOTAL_CP_RANK", "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE"),
    ),
    "_build_prefill_chunk_metadata_kernel": (
        "vllm.v1.attention.backends.mla.indexer",
        ("query_start_loc_ptr", "uncompressed_seq_lens_ptr", "cu_compressed_seq_lens_ptr",
         "token_to_seq_ptr", "cu_compressed_seq_len_ks_ptr", "cu_compressed_seq_len_ke_ptr",
         "query_slice_start", "query_slice_stop", "BLOCK_SIZE", "COMPRESS_RATIO"),
    ),
}  # fmt: skip
INDEXER_RATIO = 4  # DSv4 runs its sparse-attention indexer on the compress-ratio-4 layers
UNALIGNED = "unaligned"  # in a call's args: an int32 pointer off a 16-byte boundary
GATHER_KERNELS = {
    "_dequantize_and_gather_k_kernel": (
        "vllm.v1.attention.ops.deepseek_v4_ops.cache_utils",
        ("out_ptr", "out_stride0", "out_stride1", "k_cache_ptr", "seq_lens_ptr", "block_table_ptr",
         "offset", "gather_lens_ptr", "max_blocks_per_seq", "fp8_dim", "bf16_dim", "scale_dim",
         "quant_block", "cache_block_size", "token_data_size", "block_stride", "output_dim",
         "fp8_max", "n_quant_blocks"),
    ),
    "_combine_topk_swa_indices_kernel": (
        "vllm.v1.attention.ops.deepseek_v4_ops.cache_utils",
        ("combined_indices_ptr", "combined_indices_stride", "combined_lens_ptr", "topk_indices_ptr",
         "topk_indices_stride", "query_start_loc_ptr", "seq_lens_ptr", "gather_lens_ptr", "M", "N",
         "TOP_K", "COMPRESS_RATIO", "WINDOW_SIZE", "PADDED_TOP_K"),
    ),
}  # fmt: skip
# dequantize_and_gather_k_cache's constants (cache_utils.py); the token layout of fp8_ds_mla
GATHER_CONSTANTS = {"fp8_dim": 448, "bf16_dim": 64, "scale_dim": 8, "quant_block": 64,
                    "token_data_size": 448 + 64 * 2, "output_dim": 512, "fp8_max": 448.0,
                    "n_quant_blocks": 7}  # fmt: skip
SPARSE_PREFILL_TOPK_ALIGNMENT = 128  # cache_utils.py: combined top-k rows are padded to this
C128_TOPK_ALIGNMENT = 128  # flashmla_sparse.py: the C128 prefill top-k buffer's row alignment


@dataclass(frozen=True)
class Context:
    """What the calls depend on: the scheduler's limits, the model's window and compress ratios,
    and this worker's context-parallel position (vLLM's BlockTable: 1 and 0 without CP)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    window_size: int
    compress_ratios: tuple[int, ...] = ()
    cp_world_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    pad_id: int = -1
    block_size: int = 0  # the KV cache's block size (tokens); 0: unknown, no DeepGEMM warm-up
    next_n: int = 1  # tokens per decode request (1 + MTP's speculative tokens)


def int_class(v: int) -> str:
    """How Triton specializes an integer argument (`BaseBackend.get_int_specialization` and the
    equal-to-1 constant): '1', '16' (divisible by 16, zero included) or '' (neither)."""
    return "1" if v == 1 else "16" if v % 16 == 0 else ""


# the smallest non-negative member of each class: 0 ('16'), 1 ('1'), 2 ('')
CLASS_MEMBERS = (0, 1, 2)


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2` for n >= 1."""
    return 1 << (n - 1).bit_length()


def prefill_cases(max_num_seqs: int) -> list[tuple[int, int]]:
    """`_compute_prefill_metadata_kernel`: one (num_prefills, num_decodes) per reachable
    (BLOCK_SIZE, class of num_prefills, class of num_decodes), the smallest of each.

    Every reachable pair (p, d) -- p >= 1, p + d <= max_num_seqs -- is covered: its key is produced
    at the first p' of p's (BLOCK_SIZE, class), p' <= p, with d' = 0, 1 or 2 for d's class, the
    smallest member of that class (d' <= d), so p' + d' <= p + d <= max_num_seqs was tried."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out: dict[tuple[int, str, str], tuple[int, int]] = {}
    for p in range(1, max_num_seqs + 1):
        for d in CLASS_MEMBERS:
            if p + d <= max_num_seqs:
                out.setdefault((next_pow2(p), int_class(p), int_class(d)), (p, d))
    return sorted(out.values())


def slot_mapping_cases() -> list[tuple[int, int, int]]:
    """`_compute_slot_mapping_kernel`: (num_tokens, block_table_stride, block_size), every class
    of each (num_tokens >= 1; a stride and a block size of any class)."""
    return [(n, s, b) for n in (1, 16, 2) for s in (16, 1, 2) for b in (16, 1, 2)]


def prefill_chunk_cases() -> list[tuple[bool, int, int]]:
    """`_build_prefill_chunk_metadata_kernel`: (seq_lens slice aligned, qs_start, qs_stop) for
    every alignment and every (class of start, class of stop) with 0 <= start < stop."""
    pairs = [(a, b) for a in CLASS_MEMBERS for b in (1, 16, 2, 17) if a < b]
    keys: dict[tuple[str, str], tuple[int, int]] = {}
    for a, b in pairs:
        keys.setdefault((int_class(a), int_class(b)), (a, b))
    return [(al, a, b) for al in (True, False) for a, b in sorted(keys.values())]


PAGED_MQA_ALIGN = 32  # DeepGEMM rounds the batch up to this (kAlignedBatchSize)


def paged_mqa_batches(ctx: Context) -> list[int]:
    """The batch sizes (decode rows of the indexer's seq_lens) whose `kAlignedBatchSize` classes
    cover every step: one per multiple of 32 up to `max_num_seqs * next_n` rounded up (a decode
    request is one row, or `next_n` rows where vLLM flattens MTP's draft tokens)."""
    rows = ctx.max_num_seqs * max(1, ctx.next_n)
    top = -(-rows // PAGED_MQA_ALIGN) * PAGED_MQA_ALIGN
    return list(range(PAGED_MQA_ALIGN, top + 1, PAGED_MQA_ALIGN))


def warm_deepgemm(ctx: Context) -> int:
    """Compile `smxx_paged_mqa_logits_metadata` for every `paged_mqa_batches` class through
    vLLM's `get_paged_mqa_logits_metadata`, as the indexer's builder calls it (storage block size
    = block size // 4, this device's SM count); the number of batches run. Nothing where the
    model has no indexer, the block size is unknown, or DeepGEMM is not there (the builder then
    does not call it either)."""
    if INDEXER_RATIO not in ctx.compress_ratios or ctx.block_size <= 0:
        return 0
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.deep_gemm import get_paged_mqa_logits_metadata, has_deep_gemm
    from vllm.utils.platform_utils import num_compute_units

    if not (current_platform.is_cuda() and has_deep_gemm()):
        return 0
    device = torch.cuda.current_device()
    sms = num_compute_units(device)
    n = 0
    for b in paged_mqa_batches(ctx):
        lens = torch.ones((b, 1), dtype=torch.int32, device=device)
        get_paged_mqa_logits_metadata(lens, ctx.block_size // INDEXER_RATIO, sms)
        n += 1
    torch.cuda.current_stream(device).synchronize()
    return n


@dataclass(frozen=True)
class GatherLayer:
    """What one attention layer's prefill gather calls specialize on, besides its two caches:
    the layer's constants and the block tables' width and row stride (elements) and block sizes
    from a step's metadata (the compressed ones 0 for a sliding-window-only layer)."""

    compress_ratio: int  # <= 1: sliding window only
    window_size: int
    head_dim: int  # the last dim of q (the BF16 workspace rows)
    max_model_len: int
    max_num_batched_tokens: int
    topk_width: int  # the indexer's top-k buffer width (index_topk)
    swa_block_size: int
    swa_table_width: int
    swa_table_stride: int
    block_size: int = 0
    table_width: int = 0
    table_stride: int = 0


def _row_classes(*strides: int) -> list[tuple[bool, ...]]:
    """For int32 tables with these row strides (elements) sliced from one common row: whether
    each slice starts 16-byte aligned, every combination some row gives (4 int32 are 16 bytes,
    so rows 0..3 give them all)."""
    return sorted({tuple((s * r) % 4 == 0 for s in strides) for r in range(4)}, reverse=True)


def gather_calls(
    layer: GatherLayer, swa_k_cache: object, k_cache: object | None
) -> list[tuple[str, tuple, dict]]:
    """(kernel, args, kwargs) of one `warmup` call per specialization `_forward_prefill` can
    produce for this layer: torch dtypes stand for aligned tensors, "unaligned" for an int32
    view off a 16-byte boundary, the caches are passed as they are. The slices of seq_lens,
    query_start_loc and the block tables start at one row (the step's decode count plus the
    chunk's start), so their alignments go together (`_row_classes`); the top-k rows start at
    any query; the gather lengths' slices start at chunk boundaries (PREFILL_CHUNK_SIZE 4 int32:
    aligned); the other tensors are fresh."""
    import torch

    i32, bf16 = torch.int32, torch.bfloat16

    def p(aligned: bool) -> object:
        return i32 if aligned else UNALIGNED

    swa_only = layer.compress_ratio <= 1
    if swa_only:
        top_k, n_comp, topk_width = 0, 0, layer.topk_width
    else:
        n_comp = -(-layer.max_model_len // layer.compress_ratio)
        if layer.compress_ratio == INDEXER_RATIO:
            top_k = layer.topk_width
        else:  # C128A: FlashMLASparseMetadataBuilder's c128a prefill buffer
            top_k = -(-n_comp // C128_TOPK_ALIGNMENT) * C128_TOPK_ALIGNMENT
        topk_width = top_k
    m = n_comp + layer.window_size + layer.max_num_batched_tokens
    d = layer.head_dim
    out: list[tuple[str, tuple, dict]] = []
    gather = "_dequantize_and_gather_k_kernel"
    if not swa_only:
        kw = {"max_blocks_per_seq": layer.table_width, "cache_block_size":
              layer.block_size // layer.compress_ratio, "block_stride": k_cache.stride(0),
              **GATHER_CONSTANTS}  # fmt: skip
        for (t,) in _row_classes(layer.table_stride):
            out.append((gather, (bf16, m * d, d, k_cache, i32, p(t), 0, None), kw))
    kw = {"max_blocks_per_seq": layer.swa_table_width, "cache_block_size": layer.swa_block_size,
          "block_stride": swa_k_cache.stride(0), **GATHER_CONSTANTS}  # fmt: skip
    for sl, t in _row_classes(1, layer.swa_table_stride):  # seq_lens and the table: one row
        out.append((gather, (bf16, m * d, d, swa_k_cache, p(sl), p(t), n_comp, i32), kw))
    combined = -(-(top_k + layer.window_size) // SPARSE_PREFILL_TOPK_ALIGNMENT) * (
        SPARSE_PREFILL_TOPK_ALIGNMENT
    )
    kw = {"TOP_K": top_k, "COMPRESS_RATIO": layer.compress_ratio,
          "WINDOW_SIZE": layer.window_size, "PADDED_TOP_K": next_pow2(topk_width)}  # fmt: skip
    for (tk,) in _row_classes(topk_width):  # top-k rows: the query's, any
        for (r,) in _row_classes(1):  # query_start_loc and seq_lens: the chunk's first request
            args = (i32, combined, i32, p(tk), topk_width, p(r), p(r), i32, m, n_comp)
            out.append(("_combine_topk_swa_indices_kernel", args, kw))
    return out


def calls(ctx: Context) -> dict[str, list[tuple[tuple, dict]]]:
    """Per kernel, the (args, kwargs) of one `warmup` call per specialization; torch dtypes stand
    for aligned tensors (Triton's MockTensor), an int32 view one element into a buffer for the
    unaligned seq_lens slice (`unaligned`, made by the caller on the device)."""
    import torch

    i32, i64 = torch.int32, torch.int64
    out: dict[str, list[tuple[tuple, dict]]] = {}
    out["_compute_prefill_metadata_kernel"] = [
        ((i32, i32, i32, p, d, ctx.window_size), {"BLOCK_SIZE": next_pow2(p)})
        for p, d in prefill_cases(ctx.max_num_seqs)
    ]
    cp = {"TOTAL_CP_WORLD_SIZE": ctx.cp_world_size, "TOTAL_CP_RANK": ctx.cp_rank,
          "CP_KV_CACHE_INTERLEAVE_SIZE": ctx.cp_interleave, "PAD_ID": ctx.pad_id,
          "BLOCK_SIZE": 1024}  # fmt: skip
    out["_compute_slot_mapping_kernel"] = [
        ((n, ctx.max_num_batched_tokens, i32, i64, i32, s, b, i64), cp)
        for n, s, b in slot_mapping_cases()
    ]
    if INDEXER_RATIO in ctx.compress_ratios:
        kw = {"BLOCK_SIZE": 1024, "COMPRESS_RATIO": INDEXER_RATIO}
        out["_build_prefill_chunk_metadata_kernel"] = [
            ((i32, i32 if al else UNALIGNED, i32, i32, i32, i32, a, b), kw)
            for al, a, b in prefill_chunk_cases()
        ]
    return out


def _kernel(name: str):
    """vLLM's kernel, or None where Triton is not usable (vLLM then has a placeholder)."""
    import importlib

    module = (KERNELS.get(name) or GATHER_KERNELS[name])[0]
    k = getattr(importlib.import_module(module), name, None)
    return k if hasattr(k, "warmup") else None


def _prepare(kernel, args: tuple, kwargs: dict) -> None:
    """Compile one specialization (`JITFunction.warmup`, nothing launched), then load it and
    build its launcher (`CompiledKernel._init_handles`, Triton 3.6), as its first launch would."""
    compiled = kernel.warmup(*args, **kwargs)
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()


def _prepare_all(kernel, todo, grid: tuple[int, ...]) -> int:
    """`_prepare` each (args, kwargs) of `todo`, UNALIGNED replaced by an int32 view one element
    into a buffer on this device (made once); the number prepared."""
    import torch

    unaligned = None
    for args, kwargs in todo:
        if any(isinstance(a, str) and a == UNALIGNED for a in args):
            if unaligned is None:
                unaligned = torch.zeros(8, dtype=torch.int32, device="cuda")[1:]
            args = tuple(unaligned if isinstance(a, str) and a == UNALIGNED else a for a in args)
        _prepare(kernel, args, {"grid": grid, **kwargs})
    return len(todo)


def warm(ctx: Context, kernels: dict | None = None) -> tuple[int, list[str]]:
    """Compile every call of `calls(ctx)`: the number compiled or loaded, and one line per kernel
    that failed (the others go on). `kernels`: name -> Triton function (default: vLLM's)."""

    n, failed = 0, []
    for name, todo in calls(ctx).items():
        try:
            k = _kernel(name) if kernels is None else kernels.get(name)
            if k is not None:
                n += _prepare_all(k, todo, (1,))
        except Exception as e:  # this kernel then compiles on first use
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return n, failed


def context(vllm_config, hf_config) -> Context:
    """The Context of this worker, from vLLM's config and the model's (raises where one lacks a
    value: the caller then skips the warm-up)."""
    from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    world, rank = 1, 0
    for group in (get_pcp_group, get_dcp_group):  # BlockTable's order: pcp rank, then dcp
        try:
            g = group()
        except AssertionError:  # not initialized: no context parallelism (as BlockTable does)
            continue
        rank = rank * g.world_size + g.rank_in_group
        world *= g.world_size
    sched = vllm_config.scheduler_config
    cache = getattr(vllm_config, "cache_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    return Context(
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        window_size=int(hf_config.sliding_window),
        compress_ratios=tuple(int(r) for r in (getattr(hf_config, "compress_ratios", None) or ())),
        cp_world_size=world,
        cp_rank=rank,
        cp_interleave=int(vllm_config.parallel_config.cp_kv_cache_interleave_size),
        pad_id=int(PAD_SLOT_ID),
        block_size=int(getattr(cache, "block_size", None) or 0),
        next_n=1 + int(getattr(spec, "num_speculative_tokens", None) or 0),
    )


_thread: threading.Thread | None = None
_ctx: Context | None = None


def start(ctx: Context) -> None:
    """Compile in a background thread (overlapping the weight loading) for this thread's CUDA
    device (Triton keeps compiled kernels per device); never raises."""
    global _thread, _ctx
    import torch

    _ctx = ctx
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    if device is not None:
        try:  # Triton's driver, created here rather than raced for by two threads
            from triton.runtime import driver

            driver.active.get_current_target()
        except Exception:  # the thread then meets the same error and reports it
            pass

    def run() -> None:
        t0 = time.monotonic()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            n, failed = warm(ctx)
        except Exception as e:  # first use compiles what this did not
            n, failed = 0, [f"{type(e).__name__}: {e}"]
        for line in failed:
            logger.warning("cutedsl: warming vLLM's step-metadata kernels failed (%s); they "
                           "compile on first use instead", line)  # fmt: skip
        if n:
            logger.info("cutedsl: vLLM's step-metadata kernels ready for %d batch shapes "
                        "(max_num_seqs %d) in %.1f s", n, ctx.max_num_seqs, time.monotonic() - t0)  # fmt: skip

    _thread = threading.Thread(target=run, name="cutedsl-metadata-warmup", daemon=True)
    _thread.start()


def finish(timeout: float = 300.0) -> None:
    """Wait for `start`'s thread (at most `timeout` s; it goes on in the background after that),
    then run `warm_deepgemm` on this thread, the loading one: DeepGEMM's JIT is not known to be
    safe beside another thread's use of it, which the weight loading may make. Never raises."""
    global _thread, _ctx
    if _thread is None:
        return
    _thread.join(timeout)
    if _thread.is_alive():
        logger.warning("cutedsl: vLLM's step-metadata kernels still compiling after %.0f s; "
                       "serving starts without waiting for them", timeout)  # fmt: skip
    ctx, _thread, _ctx = _ctx, None, None
    t0 = time.monotonic()
    try:
        n = warm_deepgemm(ctx)
    except Exception as e:  # first use compiles it
        logger.warning("cutedsl: warming DeepGEMM's paged MQA schedule kernel failed (%s: %s); "
                       "it compiles on first use instead", type(e).__name__, e)  # fmt: skip
        return
    if n:
        logger.info("cutedsl: DeepGEMM's paged MQA schedule kernel ready for %d batch classes "
                    "in %.1f s", n, time.monotonic() - t0)  # fmt: skip


_gather_done: set = set()


def _cache_key(t) -> tuple | None:
    """What a cache argument specializes on: dtype, block stride, 16-byte alignment."""
    return None if t is None else (t.dtype, t.stride(0), t.data_ptr() % 16 == 0)


def warm_prefill_gather(layer, q, attn_metadata, swa_metadata, k_cache, swa_k_cache) -> bool:
    """From a DeepSeek V4 attention layer's forward: compile its prefill gather kernels for
    every specialization `gather_calls` lists, once per distinct layout in this process, on this
    thread. Whether the layer is done: True also after a failure (one warning; first use then
    compiles), False during CUDA-graph capture (the next eager call does it). Never raises."""
    import torch

    compressed = layer.compress_ratio > 1
    unbound = swa_k_cache is None or swa_k_cache.dim() < 2
    if compressed:
        unbound = unbound or attn_metadata is None or k_cache is None or k_cache.dim() < 2
    if unbound:  # the caches not bound yet, or no metadata of this layer in the step
        return False
    try:
        if torch.cuda.is_current_stream_capturing():
            return False
        buf = layer.topk_indices_buffer
        tables = {}
        if compressed:
            tables = {"block_size": int(attn_metadata.block_size),
                      "table_width": int(attn_metadata.block_table.shape[-1]),
                      "table_stride": int(attn_metadata.block_table.stride(0))}  # fmt: skip
        spec = GatherLayer(
            compress_ratio=int(layer.compress_ratio),
            window_size=int(layer.window_size),
            head_dim=int(q.shape[-1]),
            max_model_len=int(layer.max_model_len),
            max_num_batched_tokens=int(layer.max_num_batched_tokens),
            topk_width=int(buf.shape[-1]) if buf is not None else 0,
            swa_block_size=int(swa_metadata.block_size),
            swa_table_width=int(swa_metadata.block_table.shape[-1]),
            swa_table_stride=int(swa_metadata.block_table.stride(0)),
            **tables,
        )
        key = (spec, _cache_key(swa_k_cache), _cache_key(k_cache) if compressed else None)
        if key in _gather_done:
            return True
        _gather_done.add(key)
        t0 = time.monotonic()
        todo = gather_calls(spec, swa_k_cache, k_cache)
        for name in dict.fromkeys(name for name, _, _ in todo):
            kernel = _kernel(name)
            if kernel is None:  # no Triton here: vLLM has placeholders
                return True
            _prepare_all(kernel, [(a, kw) for n, a, kw in todo if n == name], (1, 1))
        logger.info("cutedsl: vLLM's prefill gather kernels ready for the compress-ratio-%d "
                    "layers (%d specializations) in %.1f s", spec.compress_ratio, len(todo),
                    time.monotonic() - t0)  # fmt: skip
    except Exception as e:  # first use compiles what this did not
        logger.warning("cutedsl: warming vLLM's prefill gather kernels failed (%s: %s); they "
                       "compile on first use instead", type(e).__name__, e)  # fmt: skip
    return True
