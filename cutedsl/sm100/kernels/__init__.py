"""SM100 (Blackwell) device kernels: the block-scaled NVFP4 GEMM (`gemm`) and the NVFP4 activation
quantizer (`quant`). Importing this package does not import `cutlass`; each module does."""
