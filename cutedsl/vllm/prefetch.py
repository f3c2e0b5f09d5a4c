"""Compile our kernels while vLLM loads the weights.

`DeepseekV4ForCausalLM.load_weights` calls `checked_load` (`cutedsl.vllm.checks`), which calls
`start(model)` before the first checkpoint tensor is read. The model is built by then: every layer
with one of our methods has its parameters (shapes known, data not yet loaded), its flags
(`is_bmm` for wo_a) and its method's `max_tokens`. From those, `kernel_jobs` lists exactly the
kernels each runner's `warmup(max_tokens)` will need (`cutedsl.sm90.runners.*_jobs`: the GEMM
tactics reachable for 1..max_tokens rows on this GPU, the SwiGLU and routing kernels), and
`cutedsl.jit.prefetch` compiles the ones not yet in the disk cache in background processes. The
runners are then built after loading (`process_weights_after_loading`), as before, and their
warm-up loads each kernel from disk (or waits for its compile process).

Only the sm90 backend is prefetched: its kernels are TVM-FFI functions (the disk cache stores
those only); sm100 compiles in its warm-up as before. A failure here only logs a warning: the
warm-up then compiles in process, as it would without a prefetch.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from cutedsl import jit
from cutedsl.backends import select_backend

logger = init_logger(__name__)


def kernel_jobs(model: torch.nn.Module) -> list[jit.Job]:
    """The sm90 kernels the runners of `model`'s NVFP4 layers will compile in their warm-up."""
    from cutedsl import grouped_oproj
    from cutedsl.sm90 import runners
    from cutedsl.sm90.tactics import gpu_spec
    from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod
    from cutedsl.vllm.moe_experts import CuTeDSLModelOptNvFp4FusedMoE
    from cutedsl.vllm.shared_mlp import CuTeDSLSharedMlpMethod

    jobs: list[jit.Job] = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, CuTeDSLNvFp4LinearMethod):
            if getattr(module, "cutedsl_fused", False):
                continue  # run by its fused shared-expert runner, which builds no linear runner
            w = module.weight
            if select_backend(w.device) != "sm90":
                continue
            bmm = getattr(module, "is_bmm", False)
            groups = module.bmm_batch_size if bmm else 1
            n, k = w.shape[0] // groups, w.shape[1] * 2
            mt, spec = method.kernel.max_tokens, gpu_spec(w.device)
            if bmm:  # wo_a: grouped, with its inverse RoPE
                hd = int(model.config.head_dim)
                jobs += grouped_oproj.sm90_jobs(n, k, groups, hd, mt, spec)
            else:
                jobs += runners.linear_jobs(n, k, 1, mt, spec)
        elif isinstance(method, CuTeDSLSharedMlpMethod):
            w2 = module.down_proj.weight  # (H, I/2); gate_up and down are linears of their own
            if select_backend(w2.device) != "sm90":
                continue
            h, i = w2.shape[0], w2.shape[1] * 2
            spec = gpu_spec(w2.device)
            jobs += runners.shared_mlp_jobs(h, i, method.swiglu_limit, method.max_tokens, spec)
        elif isinstance(method, CuTeDSLModelOptNvFp4FusedMoE):
            w2 = module.w2_weight  # (E, H, I/2)
            if select_backend(w2.device) != "sm90":
                continue
            e, h, i = w2.shape[0], w2.shape[1], w2.shape[2] * 2
            max_tokens = module.vllm_config.scheduler_config.max_num_batched_tokens
            spec = gpu_spec(w2.device)
            jobs += runners.moe_jobs(e, h, i, module.swiglu_limit, max_tokens, spec)
    return jobs


def start(model: torch.nn.Module) -> None:
    """Start compiling `kernel_jobs(model)` in the background (`jit.prefetch`); never raises."""
    try:
        jobs = kernel_jobs(model)
        started = jit.prefetch(jobs)
    except Exception as e:  # the warm-up compiles whatever this did not
        logger.warning("cutedsl: kernel prefetch failed (%s: %s); compiling at warm-up instead",
                       type(e).__name__, e)  # fmt: skip
        return
    logger.info(
        "cutedsl: %d kernels for this model, %d being compiled while the weights load (cache %s)",
        len({(j.build, j.args) for j in jobs}), started, jit.cache_dir(),
    )  # fmt: skip
