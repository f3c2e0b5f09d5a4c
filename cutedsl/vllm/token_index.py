"""The request index of every token of an engine step, computed on the GPU.

vLLM 0.21.0's DeepSeek V4 metadata builders (`CompressorMetadataBuilder.build` in
`vllm/model_executor/layers/deepseek_compressor.py`, `DeepseekSparseSWAMetadataBuilder.build` in
`vllm/v1/attention/backends/mla/sparse_swa.py`) each build this index on the host every step:
`torch.repeat_interleave(torch.arange(num_reqs), query_lens)`, a pinned copy of it and a
non-blocking copy into a persistent device buffer. On an H100 serving at batch 1, where the engine
thread's step time is the decode step's, py-spy put those lines at about 12 % of that thread
(bench/results/h100/host_ours_c1.md). Our overlays of the two builders call
`fill_token_to_req_indices` instead: one `searchsorted` on the device, into the same buffer, with
the same values.
"""

from __future__ import annotations

import torch


def fill_token_to_req_indices(
    out: torch.Tensor,  # (>= T,) int32 on the device, persistent (CUDA graphs read it)
    arange: torch.Tensor,  # (>= T,) int32 on the device: 0, 1, 2, ... (made once, at build setup)
    query_start_loc: torch.Tensor,  # (>= num_reqs + 1,) int32 on the device
    query_start_loc_cpu: torch.Tensor,  # (>= num_reqs + 1,) int32 on the host, the same values
    num_reqs: int,
) -> torch.Tensor:
    """out[:T] = the index of the request each of the step's T = query_start_loc_cpu[num_reqs]
    tokens belongs to (request r owns tokens [query_start_loc[r], query_start_loc[r + 1]); a
    request of no tokens owns none), as `repeat_interleave(arange(num_reqs), query_lens)`; returns
    that view of `out`. Stream-ordered, no host sync, nothing allocated on the device."""
    t = int(query_start_loc_cpu[num_reqs])
    if t > out.numel() or t > arange.numel():
        raise ValueError(
            f"query_start_loc_cpu: {t} tokens, over the buffers' {min(out.numel(), arange.numel())}"
        )
    dst = out[:t]
    if t == 0:
        return dst
    torch.searchsorted(
        query_start_loc[1 : num_reqs + 1], arange[:t], right=True, out_int32=True, out=dst
    )
    return dst
