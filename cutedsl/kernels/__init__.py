"""Device code shared by both backends: PTX helpers (`device_utils`) and the list of kernel
modules `make check-kernels` compiles (`checks`). Importing this package does not import
`cutlass`; each kernel module does."""
