"""Ablations of the sm90 GEMM's consumer loop, for timing only (their outputs are wrong on purpose):
where does a decode K tile's time go? Each variant subclasses today's kernel and replaces
`_dequant`, the per-thread work between the full-barrier wait and the next WGMMA:

  nodq   the same shared-memory loads (2 x 8-byte weight words, 2 scale words per row pair), no
         decode: one integer op of a weight word and its scale word per fragment register (raw
         words alone make ptxas copy them into the WGMMA's register quads: 114-162 registers);
  nomul  the integer decode of `nvfp4x8_to_bf16x2x4_s2` without its 4 bf16x2 multiplies (and
         without the scale conversion);
  skel   no loads and no decode: the fragment keeps what it held; pipeline, TMA, barriers and
         WGMMA only.

The gap between the kernel and `nodq` is the decode's cost; between `nodq` and `skel` the
shared loads'; `skel` against the same-bytes copy is what the pipeline itself leaves.
Used by `bench/experiments/ab_kernel.py` through one-line shims (see `make_compile`):

    echo "from bench.experiments.ablate_variants import make_compile
    compile_kernel = make_compile('nodq')" > /tmp/_abl_nodq.py
    python3 bench/experiments/ab_kernel.py cutedsl/kernels/gemm_sm90.py /tmp/_abl_nodq.py ...
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from cutedsl.kernels import device_utils as du
from cutedsl.kernels import gemm_sm90 as G

VARIANTS = ("nodq", "nomul", "skel", "blocked", "skel_blocked")


def _int_decode(w):
    """`nvfp4x8_to_bf16x2x4_s2`'s integer ops only (no scale multiply)."""
    m = f"{du.BF16X2_MASK:#x}"
    text = (
        "{\n"
        ".reg .b32 t, u;\n"
        f"and.b32 $0, $4, {m};\n"
        f"shf.l.wrap.b32 t, $4, $4, {du.ROT[1]};\n"
        f"and.b32 $1, t, {m};\n"
        f"shf.l.wrap.b32 t, $4, $4, {du.ROT[2]};\n"
        f"and.b32 $2, t, {m};\n"
        f"shf.l.wrap.b32 t, $4, $4, {du.ROT[3]};\n"
        f"shf.l.wrap.b32 u, $4, $4, {du.ROT3_E1};\n"
        f"and.b32 u, u, {du.MASK3_E1:#x};\n"
        f"lop3.b32 $3, u, t, {du.MASK3:#x}, 0xF8;\n"
        "}"
    )
    return du._asm_i32xn(4, [w], text, "r")


def make_kernel_class(variant: str) -> type:
    if variant not in ("nodq", "nomul", "skel"):
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    class Ablated(G.Sm90Nvfp4W4A16GemmKernel):
        @cute.jit
        def _dequant(self, frag, sQ_addr, sS_addr, stage, q_off, s_off):
            f32 = cute.recast_tensor(frag, cutlass.Int32)
            q_base = sQ_addr + stage * (self.tile_n * G.BK // 2) + q_off
            s_base = sS_addr + stage * (self.tile_n * 4) + s_off
            if cutlass.const_expr(variant != "skel"):
                for rr in cutlass.range_constexpr(2):
                    s = du.ld_shared_b32(s_base + rr * 8 * 4)
                    u0, u1 = du.ld_shared_v2_b32(q_base + rr * 8 * (G.BK // 2))
                    for q, u in ((0, u0), (1, u1)):
                        if cutlass.const_expr(variant == "nodq"):
                            w0, w1, w2, w3 = u ^ s, u + s, u - s, u | s
                        else:
                            w0, w1, w2, w3 = _int_decode(u)
                        f32[rr + 0 + 4 * (2 * q)] = w0
                        f32[rr + 2 + 4 * (2 * q)] = w1
                        f32[rr + 0 + 4 * (2 * q + 1)] = w2
                        f32[rr + 2 + 4 * (2 * q + 1)] = w3

    Ablated.__name__ = f"Ablated_{variant}"
    return Ablated


def make_compile(variant: str):
    """`gemm_sm90.compile_kernel` of one ablation's kernel class."""
    if variant == "blocked":
        cls = make_blocked_class(G.Sm90Nvfp4W4A16GemmKernel)
    elif variant.endswith("_blocked"):
        cls = make_blocked_class(make_kernel_class(variant.removesuffix("_blocked")))
    else:
        cls = make_kernel_class(variant)

    return functools.partial(G.compile_kernel, kernel_cls=cls)


def make_blocked_class(base: type) -> type:
    """`base` reading its weight TMA tiles from one contiguous tile_n x 32-byte block per (n tile,
    K tile), as if the weights were stored [L][N/tile_n][K/64][tile_n][32]: the same buffer
    reinterpreted, so outputs are wrong; for timing the layout only."""

    class Blocked(base):
        def _weight_view(self, w):
            tn = self.tile_n
            n, kh, g = cute.size(w, mode=[0]), cute.size(w, mode=[1]), cute.size(w, mode=[2])
            layout = cute.make_layout(
                ((tn, n // tn), (32, kh // 32), g),
                stride=((32, tn * kh), (1, tn * 32), n * kh),
            )
            return cute.make_tensor(w.iterator, layout)

    Blocked.__name__ = f"{base.__name__}_blocked"
    return Blocked
