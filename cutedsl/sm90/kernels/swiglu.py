"""DSv4's clamped SwiGLU as one SIMT CuTeDSL kernel (arch-agnostic: compiled for sm_90a and sm_100a).

Legend: M rows, I intermediate size.
  h   (M, 2I)  bf16  the L1 GEMM output, gate columns [0, I) then up columns [I, 2I)
  out (M, I)   bf16  out[m, i] = bf16( silu(min(g, L)) * clamp(u, -L, L) ),
                     g = float(h[m, i]), u = float(h[m, I + i]), silu(x) = x / (1 + exp(-x))
All in fp32, in the order of the torch statement it replaces (`cutedsl.sm90.swiglu.
swiglu_clamp_bf16`: bf16 -> fp32 copies, clamps, `silu`, `mul`, the bf16 copy): the clamps are
exact, exp is libdevice's accurate `expf` (range reduction around ex2, not the bare
ex2.approx of fast math), the division is IEEE `div.rn`, the result rounds to nearest bf16. The
compiler fuses expf's last scaling with the `1 +` into one FMA, so a value may differ from the
torch statement by one bf16 ulp. Without a limit (L = None) both clamps are left out.

One CTA of THREADS threads per row; each thread handles VEC = 8 columns (16-byte loads of gate
and up, one 16-byte store) per step and strides over the row.
Compile-time: the limit L (a float or None). Runtime: M, I (tensor extents), pointers, stream (the
TVM-FFI environment stream). One compile per limit serves every shape.
Graph safety: no host sync, no allocation; grid = M CTAs.
Constraints: I % 8 == 0; h and out 16-byte aligned with contiguous rows (row-major, compact).
It replaces seven torch kernels (two copies to fp32, two clamps, silu, mul, the copy back) and
their fp32 scratch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from cutedsl.kernels.checks import KernelTarget

THREADS = 128
VEC = 8  # bf16 columns per thread and step (16 bytes)


def swiglu_clamp_f32(g: Float32, u: Float32, limit: float | None) -> Float32:
    """silu(min(g, L)) * clamp(u, -L, L) of two fp32 values, in the order the module docstring
    gives (no clamps when `limit` is None). Traced inside a kernel; every kernel that applies
    DSv4's SwiGLU calls this one statement, so they round alike."""
    if limit is not None:
        g = cutlass.min(g, Float32(limit))
        u = cutlass.max(cutlass.min(u, Float32(limit)), Float32(-limit))
    e = cute.math.exp(-g, fastmath=False)
    return g / (Float32(1.0) + e) * u


class SwigluClampKernel:
    """out = silu(min(gate, L)) * clamp(up, -L, L) per row (see the module docstring)."""

    def __init__(self, limit: float | None):
        if limit is not None and not limit > 0:
            raise ValueError(f"swiglu limit must be > 0 or None, got {limit}")
        self.limit = None if limit is None else float(limit)

    @cute.jit
    def __call__(self, h: cute.Tensor, out: cute.Tensor, stream):
        m = out.shape[0]
        self.kernel(h, out).launch(grid=[m, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, h: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        nv = out.shape[1] // VEC  # up starts at column I = nv * VEC of h
        rg = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
        ru = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
        acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        ro = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
        hrow = h[(row, None)]
        orow = out[(row, None)]
        for c in range(tidx, nv, THREADS):
            cute.autovec_copy(cute.local_tile(hrow, (VEC,), (c,)), rg)
            cute.autovec_copy(cute.local_tile(hrow, (VEC,), (c + nv,)), ru)
            g = rg.load().to(Float32)
            u = ru.load().to(Float32)
            for i in cutlass.range_constexpr(VEC):
                acc[i] = swiglu_clamp_f32(g[i], u[i], self.limit)
            ro.store(acc.load().to(cutlass.BFloat16))
            cute.autovec_copy(ro, cute.local_tile(orow, (VEC,), (c,)))


def _fake():
    s32 = cute.sym_int32
    m = s32(symbol="M")
    i = s32(divisibility=VEC, symbol="I")
    i2 = s32(divisibility=2 * VEC, symbol="I2")
    h = make_fake_compact_tensor(cutlass.BFloat16, (m, i2), stride_order=(1, 0), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.BFloat16, (m, i), stride_order=(1, 0), assumed_align=16)
    return h, out, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_swiglu(limit: float | None, *, no_jit_engine: bool = False) -> object:
    """cute.compile the kernel for one limit from fake tensors (M and I dynamic; TVM-FFI)."""
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(SwigluClampKernel(limit), *_fake(), options="--enable-tvm-ffi", **kw)


def check_targets() -> list[KernelTarget]:
    """Both archs, with and without the clamp: 16-byte loads and stores, expf's range reduction
    (the fma by -log2(e) before ex2), the IEEE division, and the clamp's compares (limit only)."""
    ptx = (r"ld\.global(\.\w+)*\.v4\.(b32|u32)", r"st\.global(\.\w+)*\.v4\.(b32|u32)",
           r"fma\.rn\.f32\s+%f\d+, %f\d+, 0fBFB8AA3B", r"ex2\.approx", r"div\.rn\.f32")  # fmt: skip
    clamp = (
        r"setp\.ge\.f32\s+%p\d+, %f\d+, 0f41200000",
        r"setp\.le\.f32\s+%p\d+, %f\d+, 0fC1200000",
    )
    out = []
    for arch in ("sm_90a", "sm_100a"):
        for limit, extra in ((10.0, clamp), (None, ())):
            tag = "nolimit" if limit is None else "limit"
            out.append(KernelTarget(
                name=f"swiglu.clamp.{tag}.{arch}", arch=arch,
                compile=lambda limit=limit: compile_swiglu(limit, no_jit_engine=True),
                ptx_patterns=ptx + extra, sass_patterns=(r"LDG\.E\.128", r"STG\.E\.128"),
            ))  # fmt: skip
    return out
