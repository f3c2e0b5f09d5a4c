"""DeepSeek V4 tensor names between the native and HF schemes: the runtime module
`cutedsl.names`, under the tools' namespace (the tools and their users import either)."""

from __future__ import annotations

from cutedsl.names import (
    LAYER_MODULES,
    QUANT_LEAVES,
    TOP_MODULES,
    detect_scheme,
    hf_expert_param,
    hf_to_native,
    native_to_hf,
    split_leaf,
    to_scheme,
)

__all__ = [
    "QUANT_LEAVES",
    "LAYER_MODULES",
    "TOP_MODULES",
    "split_leaf",
    "native_to_hf",
    "hf_to_native",
    "to_scheme",
    "detect_scheme",
    "hf_expert_param",
]
