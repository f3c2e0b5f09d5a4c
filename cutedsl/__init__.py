"""DeepSeek V4 NVFP4 on vLLM 0.21.0 through CuTeDSL kernels.

Importable on a CPU-only machine without vLLM and without the CuTeDSL wheel: the format core
(`cutedsl.formats`) and the torch references (`cutedsl.reference`) need torch alone; kernels and
runners import `cutlass` lazily, when first used.
"""

__version__ = "0.1.0"
