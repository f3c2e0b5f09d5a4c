"""DSv4 wo_a for NVFP4 checkpoints: BF16 inverse RoPE -> grouped NVFP4 o-projection.

The hook in `DeepseekV4MultiHeadLatentAttentionWrapper.forward` (deepseek_v4_attention.py):
    if is_nvfp4_oproj(self.wo_a):
        z = nvfp4_oproj(self.wo_a, o, positions, self.rotary_emb.cos_sin_cache)
        return self.wo_b(z.flatten(1))
replaces upstream's FP8-only `fused_inv_rope_fp8_quant` + DeepGEMM `fp8_einsum`, which read
`wo_a.weight_scale_inv`. FP8 checkpoints (no `CuTeDSLNvFp4LinearMethod` on wo_a) keep that path.
"""

from __future__ import annotations

import torch

from cutedsl.vllm.linear_kernel import RUNNER_ATTR, CuTeDSLNvFp4LinearMethod


def is_nvfp4_oproj(wo_a: torch.nn.Module) -> bool:
    """True when wo_a is an NVFP4 layer whose weights our grouped o-projection runs."""
    return isinstance(getattr(wo_a, "quant_method", None), CuTeDSLNvFp4LinearMethod)


def nvfp4_oproj(
    wo_a: torch.nn.Module,
    o: torch.Tensor,  # (T, NH, head_dim) bf16 attention output, RoPE in the last 64 dims
    positions: torch.Tensor,  # (T,) int query positions
    cos_sin_cache: torch.Tensor,  # (max_pos, 64) float32, cos then sin
) -> torch.Tensor:
    """z (T, G, R) bf16 = per-group wo_a of the inverse-rotated o (G = local groups)."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache: dtype {cos_sin_cache.dtype}, expected torch.float32 (a bf16 cache "
            "loses the rotation's precision at large positions)"
        )
    return getattr(wo_a, RUNNER_ATTR)(o, positions, cos_sin_cache)
