"""SM90 (Hopper) device kernels: the NVFP4 W4A16 GEMM (`gemm`, with the weight decode of
`decode`), the MoE route / combine kernels (`moe_routing`) and the clamped SwiGLU (`swiglu`).
Importing this package does not import `cutlass`; each module does."""
