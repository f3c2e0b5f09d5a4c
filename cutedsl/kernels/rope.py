"""The inverse RoPE before DSv4's wo_a as one SIMT CuTeDSL kernel (arch-agnostic: compiled for
sm_90a and sm_100a).

Legend: T tokens, NH heads, HD head dim (compile-time; DSv4: 512), R = 64 RoPE dims (the last R of
each head), P positions in the cache.
  o   (T, NH, HD) bf16   the attention output
  pos (T,)        int64  the query positions
  cs  (P, R)      fp32   cos ‖ sin: cs[p, j] = cos_j(p), cs[p, R/2 + j] = sin_j(p)
  out (T, NH, HD) bf16   out[t, h, :HD-R] = o[t, h, :HD-R]; for pair j of the RoPE part (dims
                         HD-R+2j, HD-R+2j+1) with x0, x1 = float(o[t, h, pair]) and c, s the cos
                         and sin of pos[t]:
                           out = bf16(fma(x1, s, x0·c)), bf16(x1·c − x0·s)
                         with x0·c, x1·c and x0·s each rounded to fp32 first (x1·s is fused).
The fp32 operations are those of the torch statement it replaces
(`cutedsl.grouped_oproj.inverse_rope_into`: a rounded product, then addcmul. PyTorch's CUDA
addcmul (`pointwise_op_impl`) is fma(t1, t2, input) for value 1 and fma(value, t1·t2, input), the
product rounded, otherwise), each rounded to nearest; the pass-through dims are copied bit for bit.
The products and the subtraction are explicit mul.rn / sub.rn, which ptxas never contracts.

One CTA of HD/8 threads per (token, head) (grid.x = T, grid.y = NH); each thread moves one
16-byte vector of 8 bf16: a copy for the pass-through dims, and for the RoPE dims 4 pairs with
their 4 cos and 4 sin (two 16-byte loads of the cache row).
Compile-time: HD. Runtime: T, NH, P (tensor extents), pointers, stream (the TVM-FFI environment
stream). Graph safety: no host sync, no allocation; the grid depends on T and NH only.
Constraints: HD % 8 == 0, HD >= R, HD / 8 <= 1024; o 16-byte aligned with unit stride along HD
and token and head strides that are multiples of 8 (a head slice of a padded buffer is fine); out
contiguous and 16-byte aligned; cs contiguous; NH <= 65535. It replaces ten torch kernels (the copy of o, the cache gather, four
copies, two multiplies, two addcmul) and their fp32 scratch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import math as mlir_math
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cutedsl.kernels.checks import KernelTarget
from cutedsl.kernels.device_utils import f32_rn

ROPE_DIM = 64  # cutedsl.reference.ROPE_DIM (kernels import nothing of the runtime package)
VEC = 8  # bf16 per thread (16 bytes)
PAIRS = VEC // 2


def _fma(a: Float32, b: Float32, c: Float32) -> Float32:
    """a·b + c rounded once (fma.rn.f32)."""
    return Float32(mlir_math.fma(a.ir_value(), b.ir_value(), c.ir_value()))


class InverseRopeKernel:
    """out = o with the RoPE of its last ROPE_DIM dims per head undone (module docstring)."""

    def __init__(self, head_dim: int):
        if head_dim % VEC or head_dim < ROPE_DIM or head_dim // VEC > 1024:
            raise ValueError(f"head_dim must be a multiple of {VEC} in [{ROPE_DIM}, 8192]")
        self.head_dim = head_dim
        self.threads = head_dim // VEC
        self.nope_vecs = (head_dim - ROPE_DIM) // VEC

    @cute.jit
    def __call__(self, o: cute.Tensor, pos: cute.Tensor, cs: cute.Tensor, out: cute.Tensor, stream):
        t, nh = o.shape[0], o.shape[1]
        self.kernel(o, pos, cs, out).launch(
            grid=[t, nh, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, o: cute.Tensor, pos: cute.Tensor, cs: cute.Tensor, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, h, _ = cute.arch.block_idx()
        rx = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
        src = cute.local_tile(o[(t, h, None)], (VEC,), (tidx,))
        dst = cute.local_tile(out[(t, h, None)], (VEC,), (tidx,))
        cute.autovec_copy(src, rx)
        if tidx < self.nope_vecs:
            cute.autovec_copy(rx, dst)
        else:
            q = tidx - self.nope_vecs  # which 4 pairs of the RoPE part
            row = cs[(pos[t], None)]
            rc = cute.make_rmem_tensor(cute.make_layout((PAIRS,)), Float32)
            rs = cute.make_rmem_tensor(cute.make_layout((PAIRS,)), Float32)
            cute.autovec_copy(cute.local_tile(row, (PAIRS,), (q,)), rc)
            cute.autovec_copy(cute.local_tile(row, (PAIRS,), (q + ROPE_DIM // 2 // PAIRS,)), rs)
            x = rx.load().to(Float32)
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            for k in cutlass.range_constexpr(PAIRS):
                x0, x1, c, s = x[2 * k], x[2 * k + 1], rc[k], rs[k]
                acc[2 * k] = _fma(x1, s, f32_rn("mul", x0, c))
                acc[2 * k + 1] = f32_rn("sub", f32_rn("mul", x1, c), f32_rn("mul", x0, s))
            ro = cute.make_rmem_tensor(cute.make_layout((VEC,)), cutlass.BFloat16)
            ro.store(acc.load().to(cutlass.BFloat16))
            cute.autovec_copy(ro, dst)


def _fake(head_dim: int):
    s32 = cute.sym_int32
    t, nh, p = s32(symbol="T"), s32(symbol="NH"), s32(symbol="P")
    # o may be a head slice of a padded buffer: its token and head strides are free (16-byte rows)
    s64 = cute.sym_int64  # 64-bit offsets: T x token stride passes 2^31 at long prefills
    st, sh = s64(divisibility=VEC, symbol="ST"), s64(divisibility=VEC, symbol="SH")
    o = make_fake_tensor(cutlass.BFloat16, (t, nh, head_dim), (st, sh, 1), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.BFloat16, (t, nh, head_dim), stride_order=(2, 1, 0),
                                   assumed_align=16)  # fmt: skip
    pos = make_fake_compact_tensor(cutlass.Int64, (t,), assumed_align=8)
    cs = make_fake_compact_tensor(Float32, (p, ROPE_DIM), stride_order=(1, 0), assumed_align=16)
    return o, pos, cs, out, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_inverse_rope(head_dim: int, *, no_jit_engine: bool = False) -> object:
    """cute.compile the kernel for one head_dim from fake tensors (T, NH, P dynamic; TVM-FFI)."""
    kw = {"no_jit_engine": True} if no_jit_engine else {}
    return cute.compile(
        InverseRopeKernel(head_dim), *_fake(head_dim), options="--enable-tvm-ffi", **kw
    )


def check_targets() -> list[KernelTarget]:
    """Both archs at DSv4's head_dim 512: 16-byte loads and stores of the bf16 rows and of the
    cos / sin, the fused multiply-adds of the rotation."""
    ptx = (r"ld\.global(\.\w+)*\.v4\.(b32|u32|f32)", r"st\.global(\.\w+)*\.v4\.(b32|u32)",
           r"fma\.rn\.f32", r"mul\.rn\.f32", r"sub\.rn\.f32")  # fmt: skip
    return [
        KernelTarget(
            name=f"rope.inverse.{arch}",
            arch=arch,
            compile=lambda: compile_inverse_rope(512, no_jit_engine=True),
            ptx_patterns=ptx,
            sass_patterns=(r"LDG\.E\.128", r"STG\.E\.128", r"FFMA"),
        )  # fmt: skip
        for arch in ("sm_90a", "sm_100a")
    ]
