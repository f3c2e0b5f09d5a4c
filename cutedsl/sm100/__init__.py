"""SM100 (Blackwell, sm_100a) backend: W4A4 NVFP4 through the native block-scaled MMA.

Activations are quantized to NVFP4 on the device with a static per-tensor input scale, and the
GEMM multiplies NVFP4 x NVFP4 with tcgen05 `kind::mxf4nvf4.block_scale` (e4m3 scales per 16
elements, fp32 accumulation in TMEM, bf16 out), optionally with the fused clamped SwiGLU.

Modules:
- `weight`:  `Weight` / `prepare_weight` (blocked scales), `interleave_w13` (pure torch)
- `layout`:  the o-projection and MoE row layouts, gather and combine (pure torch)
- `emulate`: the kernels' contracts as torch statements (pure torch), and `EMULATED`, the
             launches of the `sm100-emulated` backend
- `gemm`:    the GPU launchers (`quantize_act`, `gemm`) and the runner steps (`linear`,
             `grouped`, `moe`), `precompile`
- `runners`: the implementation classes of the public runners (`Linear`, `GroupedOproj`,
             `SharedMlp`, `MoE`, and their `Emulated*` twins)
- `kernels`: the CuTeDSL device code (`kernels.gemm`, `kernels.quant`)

Status: never run on a GPU by us. The kernels are compiled for sm_100a without a GPU
(`python -m cutedsl.tools.check_kernels --only sm100`) and the host side is tested on a CPU with
the kernels replaced by their torch statements (the `sm100-emulated` backend, which also runs on
any CUDA GPU). Importing this package (or any module above but
`kernels`) does not import `cutlass`.
"""
