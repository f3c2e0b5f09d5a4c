"""The Hopper (sm_90a) backend: NVFP4 weights, BF16 activations (W4A16), weights dequantized to
BF16 in registers inside the GEMM mainloop.

- `weight`: the weight encoding the kernels read (`prepare_weight` -> `Weight`, once at load) and
  the host model of the decode;
- `tactics`: the `Tactic` (tiling) and its choice per GPU (tuned table, then a rule);
- `gemm`: launches of the dense, grouped (wo_a) and MoE GEMMs;
- `routing`, `swiglu`: the MoE's route / combine and the clamped SwiGLU;
- `runners`: the implementation of each public runner (`cutedsl.linear` etc.);
- `kernels/`: the CuTeDSL device code.
Importing the package does not import `cutlass`; compiling a kernel does.
"""
