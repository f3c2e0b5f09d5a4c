"""What `make check-kernels` compiles: one `KernelTarget` per kernel and arch.

Each kernel module exposes `check_targets() -> list[KernelTarget]`; `cutedsl.tools.check_kernels`
runs every target in a fresh subprocess with `CUTE_DSL_ARCH=<arch>` (no GPU needed) and greps the
dumped PTX and the cuobjdump SASS for the patterns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTarget:
    name: str  # unique, e.g. "sm90.w4a16_gemm.dense"
    arch: str  # "sm_90a" | "sm_100a"
    compile: Callable[[], object]  # cute.compile(..., no_jit_engine=True) from fake tensors
    ptx_patterns: tuple[str, ...]  # regexes that must all occur in the PTX
    sass_patterns: tuple[str, ...] = ()  # regexes that must all occur in the SASS
    max_registers: int | None = None  # registers per thread the cubin may use (occupancy rules)
    absent_patterns: tuple[str, ...] = ()  # regexes that must not occur in the PTX


# Modules that define check_targets(); a module missing here is a module CI does not compile.
KERNEL_MODULES: tuple[str, ...] = (
    "cutedsl.sm90.kernels.gemm",
    "cutedsl.sm90.kernels.stream",
    "cutedsl.sm90.kernels.moe_routing",
    "cutedsl.sm90.kernels.swiglu",
    "cutedsl.sm100.kernels.gemm",
    "cutedsl.sm100.kernels.quant",
    "cutedsl.kernels.rope",
)
