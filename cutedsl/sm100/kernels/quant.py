"""BF16 -> NVFP4 activation quantization for SM100 (sm_100a).

Computes, per 16-element block along K of every row (the ModelOpt / vLLM `ref_nvfp4_quant`
convention; gs = the static `input_scale`, a dequant multiplier amax / (6 * 448)):

    inv_gs  = 1 / gs                                        fp32, IEEE division
    sf      = e4m3_rn_satfinite(inv_gs * (amax16 * (1 / 6)))
    out_mul = 1 / (sf * (1 / inv_gs))                        1e-8 where sf == 0 (vLLM get_reciprocal)
    code    = e2m1_rn_satfinite(x * out_mul)                 round to nearest even, clamp to +-6
    dequant = e2m1(code) * sf * gs

i.e. `cutedsl.formats.quantize_nvfp4_activation(x, gs)` on the device, with the codes and scales
placed where the block-scaled GEMM (`cutedsl.sm100.kernels.gemm`) reads them.

Legend: T rows per group (tokens), K in features (logical; packed bytes K // 2), L groups (1 for a
plain linear, G for wo_a), KB = K // 16 scale columns.

Operands (raw device pointers + runtime extents):
    x:   (T, K, L) bf16, K contiguous, runtime row stride sx_t and group stride sx_l (a (T, G, D)
         attention output is read in place: sx_t = G * D, sx_l = D)
    q:   (L, padded_T, K // 2) uint8 e2m1x2, element 2i in the low nibble, compact: group g's rows
         start at row g * padded_T of the flattened (L * padded_T, K // 2) matrix
    sf:  e4m3 bytes in the 128x4 blocked ("to_blocked") layout of the flattened
         (L * padded_T, KB) matrix: group g's scales are `formats.swizzle_scales` of its own
         (padded_T, KB) block, placed at byte offset g * padded_T * KB
    gs:  (1,) fp32 device scalar (input_scale), never read on the host
Rows T <= r < padded_T of every group are written as zeros (codes 0, scale 0), so the GEMM reads
defined values there.

Thread mapping: one thread per (group, row, 16-block), 256 threads per CTA, no shared memory;
neighbouring threads take neighbouring blocks of one row (32 B bf16 loads, 8 B code stores,
1 B scale stores).

Compile-time: nothing but the arch. Runtime: T, padded_T, K, L, sx_t, sx_l, the pointers and the
stream; one compile serves every shape.

Constraints (`can_implement`): K % 64 == 0 (so KB % 4 == 0: no scale-column padding),
padded_T % 128 == 0, padded_T >= T, sx_t % 8 == 0 and sx_l % 8 == 0 (16 B aligned rows), x 16 B
aligned; 32-bit offsets: L * padded_T * K and every x offset below 2**31 elements.

CUDA graphs: no host synchronization; the grid depends on (L, padded_T, K) only.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from cutedsl.kernels.device_utils import asm

BLOCK = 16
THREADS = 256


@dsl_user_op
def _cvt_e2m1x8(v0, v1, v2, v3, v4, v5, v6, v7, *, loc=None, ip=None) -> Uint32:
    """Eight fp32 -> eight e2m1 codes in one 32-bit word, value i in nibble i (low first)."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3, v4, v5, v6, v7)]
    # cvt.*.e2m1x2 puts its first source in the upper nibble: pass (odd, even).
    return Uint32(
        asm(
            T.i32(),
            args,
            "{\n.reg .b8 b0, b1, b2, b3;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7;\n"
            "mov.b32 $0, {b0, b1, b2, b3};\n}",
            "=r,f,f,f,f,f,f,f,f",
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _cvt_e4m3(v, *, loc=None, ip=None) -> Uint32:
    """fp32 -> e4m3 (round to nearest even, saturate to +-448) as the low byte of a word."""
    return Uint32(
        asm(
            T.i32(),
            [Float32(v).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b16 h;\n.reg .b32 z;\nmov.b32 z, 0;\n"
            "cvt.rn.satfinite.e4m3x2.f32 h, z, $1;\n"
            "cvt.u32.u16 $0, h;\n}",
            "=r,f",
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _e4m3_to_f32(bits, *, loc=None, ip=None) -> Float32:
    """Low byte of `bits` (an e4m3 code) -> fp32 (exact)."""
    return Float32(
        asm(
            T.f32(),
            [Uint32(bits).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b16 lo, hi;\n.reg .b32 h2;\n.reg .f16 f;\n"
            "mov.b32 {lo, hi}, $1;\n"
            "cvt.rn.f16x2.e4m3x2 h2, lo;\n"
            "mov.b32 {f, hi}, h2;\n"
            "cvt.f32.f16 $0, f;\n}",
            "=f,r",
            loc=loc,
            ip=ip,
        )
    )


class Sm100Nvfp4QuantKernel:
    """BF16 (T, K, L) -> NVFP4 codes + blocked e4m3 scales at per-group padded offsets."""

    def __init__(self) -> None:
        self.threads = THREADS  # codegen config only; shapes are runtime

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,  # bf16 (T, K, L), K contiguous
        q_ptr: cute.Pointer,  # uint32 view of uint8 (L, padded_T, K//2)
        sf_ptr: cute.Pointer,  # uint8 blocked scales of (L*padded_T, K//16)
        gs_ptr: cute.Pointer,  # fp32 (1,) input_scale
        t: Int32,
        padded_t: Int32,
        k: Int32,
        l: Int32,
        sx_t: Int32,
        sx_l: Int32,
        stream,
    ):
        kb = k // BLOCK
        mX = cute.make_tensor(
            x_ptr,
            cute.make_layout(
                (t, cute.assume(k, 64), l),
                stride=(cute.assume(sx_t, 8), 1, cute.assume(sx_l, 8)),
            ),
        )
        # Two 32-bit words (8 codes each) per 16-block.
        n_words = l * padded_t * (kb * 2)
        mQ = cute.make_tensor(q_ptr, cute.make_layout((n_words,)))
        mSF = cute.make_tensor(sf_ptr, cute.make_layout((l * padded_t * kb,)))
        mGS = cute.make_tensor(gs_ptr, cute.make_layout((1,)))
        total = l * padded_t * kb
        grid = ((total + self.threads - 1) // self.threads, 1, 1)
        self.kernel(mX, mQ, mSF, mGS, t, padded_t, kb, total).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mQ: cute.Tensor,
        mSF: cute.Tensor,
        mGS: cute.Tensor,
        t: Int32,
        padded_t: Int32,
        kb: Int32,
        total: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        idx = bidx * self.threads + tidx
        if idx < total:
            blk = idx % kb
            row_all = idx // kb  # row in the flattened (L*padded_T) matrix
            row = row_all % padded_t
            grp = row_all // padded_t

            # ---- load one 16-element block (zeros for pad rows) ----
            rX = cute.make_rmem_tensor(cute.make_layout((BLOCK,)), cutlass.BFloat16)
            rX.fill(0.0)
            if row < t:
                gX = cute.local_tile(mX[(row, None, grp)], (BLOCK,), (blk,))
                cute.autovec_copy(gX, rX)
            v = rX.load().to(Float32)

            # ---- block scale ----
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(BLOCK):
                amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
            inv_gs = Float32(1.0) / mGS[0]
            sf_bits = _cvt_e4m3(inv_gs * (amax * Float32(1.0 / 6.0)))
            sf_val = _e4m3_to_f32(sf_bits)
            # vLLM's get_reciprocal: 1/(d + (d == 0) * 1e8), so an all-tiny block keeps signed zeros.
            d = sf_val * (Float32(1.0) / inv_gs)
            if d == Float32(0.0):
                d = Float32(1.0e8)
            out_mul = Float32(1.0) / d

            # ---- codes ----
            w0 = _cvt_e2m1x8(*[v[i] * out_mul for i in range(8)])
            w1 = _cvt_e2m1x8(*[v[i] * out_mul for i in range(8, 16)])
            word = row_all * (kb * 2) + blk * 2
            mQ[word] = w0
            mQ[word + 1] = w1

            # ---- scale byte at its 128x4 blocked position ----
            # to_blocked: tile (row//128, blk//4) of 512 B, tiles row-major over (rows/128, kb/4);
            # inside a tile: (row%32)*16 + ((row%128)//32)*4 + blk%4.
            rr = row % 128
            off = (
                grp * padded_t * kb
                + ((row // 128) * (kb // 4) + blk // 4) * 512
                + (rr % 32) * 16
                + (rr // 32) * 4
                + blk % 4
            )
            mSF[off] = Uint8(sf_bits)


def can_implement(t: int, padded_t: int, k: int, l: int, sx_t: int, sx_l: int) -> bool:
    """GPU-free shape check for `Sm100Nvfp4QuantKernel` (see the module constraints)."""
    return (
        t >= 0
        and l >= 1
        and k > 0
        and k % 64 == 0
        and padded_t % 128 == 0
        and padded_t >= t
        and sx_t % 8 == 0
        and sx_l % 8 == 0
        and l * padded_t * k < 2**31
        and t * sx_t + l * sx_l < 2**31
    )


def compile_quant(no_jit_engine: bool = False, options: str | None = None):
    """`cute.compile` of the quant kernel from fake pointers (every extent is a runtime argument;
    there are no codegen arguments). no_jit_engine / options: passed to `cute.compile`."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    fake = 0x10000000
    gmem = cute.AddressSpace.gmem
    args = (
        make_ptr(cutlass.BFloat16, fake, gmem, assumed_align=16),
        make_ptr(cutlass.Uint32, fake, gmem, assumed_align=16),
        make_ptr(cutlass.Uint8, fake, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),
        1,
        128,
        64,
        1,
        64,
        64,
        cuda.CUstream(0),
    )
    kw = {"no_jit_engine": no_jit_engine}
    if options:
        kw["options"] = options
    return cute.compile(Sm100Nvfp4QuantKernel(), *args, **kw)


def check_targets():
    """`make check-kernels` target: the quant kernel compiled for sm_100a from fakes."""
    from cutedsl.kernels.checks import KernelTarget

    return [
        KernelTarget(
            name="sm100.quant.nvfp4_act",
            arch="sm_100a",
            compile=lambda: compile_quant(no_jit_engine=True),
            ptx_patterns=(r"cvt\.rn\.satfinite\.e2m1x2\.f32", r"cvt\.rn\.satfinite\.e4m3x2\.f32"),
            sass_patterns=(),
        )
    ]
