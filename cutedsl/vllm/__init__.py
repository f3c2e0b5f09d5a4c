"""Adapters between vLLM 0.21.0 and the cutedsl runners, used by the overlaid vLLM files.

Imported only inside a vLLM process (they import vLLM); the math lives in the runners.
  quant        which quant config / methods a DSv4 layer gets (the dispatch the overlay calls)
  ct           compressed-tensors checkpoints: their per-layer schemes and tensor names
  linear_kernel  `CuTeDSLNvFp4LinearKernel` (an `NvFp4LinearKernel`) + its `LinearMethod`
  oproj        wo_a: inverse RoPE -> grouped NVFP4 o-projection (deepseek_v4_attention.py hook)
  shared_mlp   the shared expert's fused runner (a `QuantizeMethodBase` on `DeepseekV4MLP`)
  moe_experts  `CuTeDSLMoEExperts` (a `FusedMoEExpertsModular`) + its `FusedMoEMethod`
  names        HF-transformers / ModelOpt tensor names -> DeepSeek native names (mapper rules)
  checks       loading: name the tensor behind a loader error; fail on missing NVFP4 tensors
  prefetch     our kernels compiled in background processes while the weights load
  token_index  each step's token -> request index on the GPU (the two metadata builder overlays)
"""

import logging

import vllm.logger  # noqa: F401  (configures vLLM's "vllm" logger: its handler, format and level)


def _log_like_vllm() -> None:
    """Our modules log under "cutedsl.*", outside the "vllm" logger tree that holds vLLM's only
    handler: without this, their INFO lines are dropped and their warnings print bare. Nothing is
    done when vLLM's logging is off (VLLM_CONFIGURE_LOGGING=0) or ours is configured already."""
    ours, theirs = logging.getLogger("cutedsl"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


_log_like_vllm()
