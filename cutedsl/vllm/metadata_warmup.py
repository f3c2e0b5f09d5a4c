"""Compile vLLM's DeepSeek V4 prefill-metadata Triton kernel for every batch it can meet, while
the weights load, so that no engine step stalls on its compile.

vLLM 0.21.0's `DeepseekSparseSWAMetadataBuilder` (`vllm/v1/attention/backends/mla/sparse_swa.py`)
launches `_compute_prefill_metadata_kernel` in every step with prefills:

    _compute_prefill_metadata_kernel[(1,)](pfx_gather_lens, seq_lens, query_start_loc,
        num_prefills, num_decodes, self.window_size,
        BLOCK_SIZE=triton.next_power_of_2(num_prefills))

Triton compiles one binary per specialization of a call: the constexpr BLOCK_SIZE, and for each
integer argument whether it equals 1 (then a constant) or is divisible by 16 (then marked so); its
pointers here are the starts of whole tensors, always 16-byte aligned. Each new combination of the
step's prefill and decode counts compiles on first use, inside an engine step, stalling every
running request: on an H100, runs at concurrency 4 to 128 each added 8 to 17 of its cache files
after the server had reported healthy, in our server and in upstream's alike.

`cases(max_num_seqs)` lists one (num_prefills, num_decodes) per specialization that a scheduler
with `max_num_seqs` can produce (num_prefills >= 1, num_prefills + num_decodes <= max_num_seqs);
`start(max_num_seqs, window_size)` compiles them in a background thread (`JITFunction.warmup`:
compile only, nothing launched; from Triton's disk cache when there) and `finish()` waits for it.
A failure only logs a warning: the kernel then compiles on first use, as it would without this.
"""

from __future__ import annotations

import threading
import time

from vllm.logger import init_logger

logger = init_logger(__name__)

# the kernel's parameters in vLLM 0.21.0, in order (a CPU test keeps this equal to vLLM's)
KERNEL_PARAMS = (
    "prefill_gather_lens_ptr",
    "seq_lens_ptr",
    "query_start_loc_ptr",
    "num_prefills",
    "num_decodes",
    "window_size",
    "BLOCK_SIZE",
)


def int_class(v: int) -> str:
    """How Triton specializes an integer argument (`BaseBackend.get_int_specialization` and the
    equal-to-1 constant): '1', '16' (divisible by 16, zero included) or '' (neither)."""
    return "1" if v == 1 else "16" if v % 16 == 0 else ""


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2` for n >= 1."""
    return 1 << (n - 1).bit_length()


def key(num_prefills: int, num_decodes: int) -> tuple[int, str, str]:
    """The part of a call's specialization that changes from step to step."""
    return next_pow2(num_prefills), int_class(num_prefills), int_class(num_decodes)


def cases(max_num_seqs: int) -> list[tuple[int, int]]:
    """One (num_prefills, num_decodes) per reachable `key`, the smallest of each.

    Every reachable pair (p, d) is covered: its key is produced at the first p' of p's
    (BLOCK_SIZE, class) -- p' <= p -- with d' = 0, 1 or 2 for d's class, the smallest member of
    that class (d' <= d), so p' + d' <= p + d <= max_num_seqs was tried."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out: dict[tuple[int, str, str], tuple[int, int]] = {}
    for p in range(1, max_num_seqs + 1):
        for d in (0, 1, 2):
            if p + d <= max_num_seqs:
                out.setdefault(key(p, d), (p, d))
    return sorted(out.values())


def _kernel():
    """vLLM's kernel, or None where Triton is not usable (vLLM then has a placeholder)."""
    from vllm.v1.attention.backends.mla import sparse_swa

    k = getattr(sparse_swa, "_compute_prefill_metadata_kernel", None)
    return k if hasattr(k, "warmup") else None


def warm(max_num_seqs: int, window_size: int, kernel=None) -> int:
    """Compile every case of `cases(max_num_seqs)` for this window size; the number compiled or
    loaded. `kernel`: the Triton function (default: vLLM's)."""
    import torch

    k = _kernel() if kernel is None else kernel
    if k is None:
        return 0
    todo = cases(max_num_seqs)
    for p, d in todo:
        # dtypes stand for the three int32 tensors (Triton takes them as aligned pointers)
        k.warmup(torch.int32, torch.int32, torch.int32, p, d, window_size,
                 BLOCK_SIZE=next_pow2(p), grid=(1,))  # fmt: skip
    return len(todo)


_thread: threading.Thread | None = None


def start(max_num_seqs: int, window_size: int) -> None:
    """Compile in a background thread (overlapping the weight loading) for this thread's CUDA
    device (Triton keeps compiled kernels per device); never raises."""
    global _thread
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run() -> None:
        t0 = time.monotonic()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            n = warm(max_num_seqs, window_size)
        except Exception as e:  # first use compiles what this did not
            logger.warning("cutedsl: warming vLLM's prefill-metadata kernel failed (%s: %s); it "
                           "compiles on first use instead", type(e).__name__, e)  # fmt: skip
            return
        if n:
            logger.info("cutedsl: vLLM's prefill-metadata kernel ready for %d batch shapes "
                        "(max_num_seqs %d) in %.1f s", n, max_num_seqs, time.monotonic() - t0)  # fmt: skip

    _thread = threading.Thread(target=run, name="cutedsl-metadata-warmup", daemon=True)
    _thread.start()


def finish(timeout: float = 300.0) -> None:
    """Wait for `start`'s thread (at most `timeout` s; it goes on in the background after that)."""
    global _thread
    if _thread is None:
        return
    _thread.join(timeout)
    if _thread.is_alive():
        logger.warning("cutedsl: vLLM's prefill-metadata kernel still compiling after %.0f s; "
                       "serving starts without waiting for it", timeout)  # fmt: skip
    _thread = None
