"""cutedsl.formats: the NVFP4 codec, quantizers, scale layouts (CPU).

Independent oracles: the E2M1 bit-field formula, brute-force nearest rounding, hand-built blocks
with known bytes, the cuBLAS block-scaling offset formula, and vLLM 0.21.0's own torch code
(``dequantize_to_dtype``, ``ref_nvfp4_quant``, ``swizzle_blockscale``, ``to_blocked``,
``convert_swizzled_to_linear``) in the ``test_vllm_*`` functions.
"""

from __future__ import annotations

import types

import pytest
import torch

from cutedsl import formats as F

SHAPES = [(1, 16), (7, 32), (128, 64), (129, 48), (300, 160), (200, 256)]  # (R, K)


def _rand(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Gaussian data with per-row magnitudes spread over ~6 octaves (exercises block scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    x = x * torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=g).float())
    return x.to(dtype)


def _e2m1_from_bits(code: int) -> float:
    """E2M1 by its bit fields (s, e[2], m): subnormal 0.5·m, else 2^(e-1)·(1 + m/2)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def vllm_nvfp4() -> types.SimpleNamespace:
    """vLLM 0.21.0's NVFP4 torch helpers (imported once; `import vllm` takes ~20 s)."""
    from vllm.model_executor.layers.quantization import qutlass_utils
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils, nvfp4_utils

    return types.SimpleNamespace(
        emu=nvfp4_emulation_utils, utils=nvfp4_utils, to_blocked=qutlass_utils.to_blocked
    )


# --------------------------------------------------------------------------- E2M1 codec


def test_e2m1_all_16_codes_decode() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    got = F.decode_e2m1(codes)
    want = torch.tensor([_e2m1_from_bits(c) for c in range(16)])
    assert torch.equal(got, want)
    assert torch.equal(F.E2M1_VALUES, want)
    assert torch.equal(torch.signbit(got), codes >= 8)  # code 8 is -0.0
    assert got.dtype == torch.float32


def test_encode_rne_ties_and_saturation() -> None:
    cases = [
        (0.0, 0), (0.25, 0), (0.2500001, 1), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2),
        (1.2500001, 3), (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.5000002, 5), (3.0, 5),
        (3.5, 6), (4.0, 6), (5.0, 6), (5.0000005, 7), (6.0, 7), (6.5, 7), (1e30, 7),
        (float("inf"), 7), (-0.0, 8), (-0.1, 8), (-0.25, 8), (-0.75, 10), (-2.5, 12),
        (-5.0, 14), (-7.0, 15), (float("-inf"), 15),
    ]  # fmt: skip
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    assert F.encode_e2m1(x).tolist() == [c for _, c in cases]


def test_encode_is_nearest_ties_to_even_brute_force() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20000, generator=g) * 3, (torch.arange(-28, 29) * 0.25)])
    grid = torch.tensor([_e2m1_from_bits(c) for c in range(8)], dtype=torch.float64)
    a = x.double().abs().clamp(max=6.0)[:, None]
    dist = (a - grid).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best  # pick the even code (mantissa bit 0) on a tie
    mag = torch.where(tied.sum(1) > 1, (tied & (torch.arange(8) % 2 == 0)).int().argmax(1),
                      dist.argmin(1))  # fmt: skip
    want = mag.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    assert torch.equal(F.encode_e2m1(x), want)


def test_encode_decode_roundtrip_all_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(F.encode_e2m1(F.decode_e2m1(codes)), codes)


def test_pack_known_bytes_and_roundtrip() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    assert torch.equal(F.pack_e2m1(codes), want)  # element 2i in the low nibble
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 5, 24), generator=g, dtype=torch.uint8)
    codes = F.unpack_e2m1(packed)
    assert codes.shape == (3, 5, 48) and int(codes.max()) <= 15
    assert torch.equal(codes[..., 0::2], packed & 0xF)
    assert torch.equal(F.pack_e2m1(codes), packed)


# --------------------------------------------------------------------------- quantizers


def test_hand_built_blocks_give_known_bytes() -> None:
    vals = F.E2M1_VALUES  # one row: block 0 = codes 0..15 at scale 8, block 1 at scale 1.5
    x = torch.cat([vals * 4.0, vals * 0.75])[None]  # with global 0.5: 4 = 8 * 0.5, .75 = 1.5 * .5
    packed, sf, gs = F.quantize_nvfp4(x, torch.tensor(0.5))
    want = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    assert packed.tolist() == [want]
    assert _bytes(sf).tolist() == [[0x50, 0x3C]]  # e4m3: 8.0 = 0 1010 000, 1.5 = 0 0111 100
    assert gs.item() == 0.5 and gs.dtype == torch.float32
    assert torch.equal(F.dequantize_nvfp4(packed, sf, gs, torch.float32), x)


def test_known_codes_and_scales_are_recovered_exactly() -> None:
    """Build x from random codes/e4m3 scales (max |code| = 6 per block), quantize: same bytes."""
    g = torch.Generator().manual_seed(3)
    r, k = 65, 64
    codes = torch.randint(0, 16, (r, k), generator=g, dtype=torch.uint8)
    codes[:, ::16] = torch.where(torch.rand(r, k // 16, generator=g) < 0.5, 7, 15).to(torch.uint8)
    sf = torch.exp2(torch.randint(-6, 8, (r, k // 16), generator=g).float())
    sf = (sf * (1 + torch.randint(0, 8, sf.shape, generator=g) / 8)).to(torch.float8_e4m3fn)
    gs = torch.tensor(2.0**-5)
    x = F.decode_e2m1(codes) * (sf.float() * gs).repeat_interleave(16, dim=1)
    packed, sf_q, _ = F.quantize_nvfp4(x, gs)
    assert torch.equal(packed, F.pack_e2m1(codes))
    assert torch.equal(_bytes(sf_q), _bytes(sf))


def test_global_scale_from_amax() -> None:
    amax = torch.tensor([2688.0, 1.0, 0.0, 3.5])
    assert torch.equal(
        F.global_scale_from_amax(amax), torch.tensor([1.0, 1 / 2688, 1.0, 3.5 / 2688])
    )
    x = _rand((64, 64), 4)
    _, sf, gs = F.quantize_nvfp4(x)
    assert gs.ndim == 0 and gs.item() == pytest.approx(
        x.float().abs().max().item() / 2688, rel=1e-6
    )
    assert sf.float().max().item() == 448.0  # the amax block uses the full e4m3 range


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_dequantize_error_within_nvfp4_bound(shape: tuple[int, int]) -> None:
    x = _rand(shape, 5).float()
    packed, sf, gs = F.quantize_nvfp4(x)
    xq = F.dequantize_nvfp4(packed, sf, gs, torch.float32)
    s = (sf.float() * gs).repeat_interleave(16, dim=1)  # effective scale of each element
    u = torch.where(s > 0, x.abs() / s, torch.full_like(s, float("inf")))
    half_gap = torch.where(u < 2, 0.25, torch.where(u < 4, 0.5, 1.0))
    bound = torch.maximum(s * half_gap, x.abs() - 6 * s)  # rounding, or saturation at 6·s
    err = (x - xq).abs()
    assert bool((err <= bound * (1 + 1e-6)).all()), f"max excess {(err - bound).max()}"
    rel = (err.square().sum() / x.square().sum()).sqrt().item()
    assert rel < 0.12, rel  # NVFP4 on gaussian data: ~0.09
    # every block scale is an e4m3 value nearest amax_block / 6 in global units (brute force;
    # either neighbour at an exact tie, since the quantizer multiplies by a rounded 1/gs)
    ideal = (x.reshape(shape[0], -1, 16).abs().amax(-1).double() / 6 / gs.double())[..., None]
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    d_min = (e4m3 - ideal).abs().min(-1).values
    d_got = (sf.double() - ideal[..., 0]).abs()
    assert bool((d_got <= d_min + ideal[..., 0] * 1e-6).all())


def test_quantize_saturates_with_a_small_static_scale() -> None:
    x = _rand((8, 32), 6).float()
    gs = F.global_scale_from_amax(x.abs().max()) / 4  # 4x too small: blocks and codes saturate
    packed, sf, _ = F.quantize_nvfp4(x, gs)
    xq = F.dequantize_nvfp4(packed, sf, gs, torch.float32)
    assert xq.abs().max().item() == pytest.approx(6 * 448 * gs.item(), rel=1e-6)
    assert sf.float().max().item() == 448.0 and int((F.unpack_e2m1(packed) & 7).max()) == 7
    assert bool(torch.isfinite(xq).all())


def test_quantize_batched_matches_per_matrix_with_per_matrix_scales() -> None:
    w = _rand((3, 40, 32), 7)
    gs = F.global_scale_from_amax(w.float().abs().amax(dim=(1, 2)))
    packed, sf, gs_out = F.quantize_nvfp4(w, gs)
    assert torch.equal(gs_out, gs)
    for e in range(3):
        p_e, sf_e, _ = F.quantize_nvfp4(w[e], gs[e])
        assert torch.equal(packed[e], p_e) and torch.equal(_bytes(sf[e]), _bytes(sf_e))
        assert torch.equal(
            F.dequantize_nvfp4(packed, sf, gs)[e], F.dequantize_nvfp4(p_e, sf_e, gs[e])
        )


def test_fused_pair_shares_one_global_scale() -> None:
    w1, w3 = _rand((48, 64), 8), _rand((48, 64), 9) * 5  # different amax
    gs = F.global_scale_from_amax(torch.maximum(w1.abs().max(), w3.abs().max()).float())
    p1, sf1, g1 = F.quantize_nvfp4(w1, gs)
    p3, sf3, g3 = F.quantize_nvfp4(w3, gs)
    assert g1.item() == g3.item() == gs.item()
    p13, sf13, g13 = F.quantize_nvfp4(torch.cat([w1, w3]))  # the fused tensor's own amax
    assert g13.item() == gs.item()
    assert torch.equal(torch.cat([p1, p3]), p13)
    assert torch.equal(_bytes(torch.cat([sf1, sf3])), _bytes(sf13))
    own = F.quantize_nvfp4(w1)  # w1 alone would get a different scale
    assert own[2].item() != gs.item()


def test_activation_quantizer_matches_weight_quantizer_rows() -> None:
    x = _rand((33, 64), 10)
    s = torch.tensor(0.01)
    a = F.quantize_nvfp4_activation(x, s)
    w = F.quantize_nvfp4(x, s)
    assert torch.equal(a[0], w[0]) and torch.equal(_bytes(a[1]), _bytes(w[1]))


# --------------------------------------------------------------------------- scale layouts


def _blocked_offset(r: int, c: int, cp: int) -> int:
    """cuBLAS 1D block-scaling layout: 128x4 tiles, row-tile major; inside, 16·(r%32)+4·(r//32)+c."""
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (127, 3), (128, 4), (129, 5), (300, 8)])
def test_swizzle_layout_formula_and_roundtrip(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + cols)
    sf = torch.randint(1, 127, (rows, cols), generator=g, dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )
    blocked = F.swizzle_scales(sf)
    rp, cp = F.round_up(rows, 128), F.round_up(cols, 4)
    assert blocked.shape == (rp, cp) and blocked.dtype == torch.float8_e4m3fn
    flat = _bytes(blocked).flatten()
    lin = _bytes(sf)
    r_idx, c_idx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    offs = torch.tensor(
        [
            _blocked_offset(r, c, cp)
            for r, c in zip(r_idx.flatten().tolist(), c_idx.flatten().tolist())
        ]
    )
    assert torch.equal(flat[offs], lin.flatten())
    mask = torch.ones(rp * cp, dtype=torch.bool)
    mask[offs] = False
    assert int(flat[mask].count_nonzero()) == 0  # padding is zero
    assert torch.equal(_bytes(F.unswizzle_scales(blocked, rows, cols * 16)), lin)


def test_swizzle_batched_equals_per_slice() -> None:
    sf = _rand((3, 130, 6), 11).float().abs().to(torch.float8_e4m3fn)
    blocked = F.swizzle_scales(sf)
    assert blocked.shape == (3, 256, 8)
    for b in range(3):
        assert torch.equal(_bytes(blocked[b]), _bytes(F.swizzle_scales(sf[b])))
    assert torch.equal(_bytes(F.unswizzle_scales(blocked, 130, 96)), _bytes(sf))


def test_assemble_group_scales_puts_group_g_at_g_times_padded_rows() -> None:
    g_n, r, c, padded = 3, 100, 5, 256
    sf = _rand((g_n, r, c), 12).float().abs().to(torch.float8_e4m3fn)
    out = F.assemble_group_scales(sf, padded)
    assert out.shape == (g_n * padded, 8)
    lin = _bytes(F.unswizzle_scales(out, g_n * padded, 8 * 16))
    for g in range(g_n):
        assert torch.equal(lin[g * padded : g * padded + r, :c], _bytes(sf[g]))
        assert int(lin[g * padded + r : (g + 1) * padded].count_nonzero()) == 0
        tile = F.swizzle_scales(torch.cat([sf[g], sf.new_zeros(padded - r, c)]))
        start = g * padded * 8  # each group's tiles are contiguous bytes starting at row g*padded
        assert torch.equal(
            _bytes(out).flatten()[start : start + padded * 8], _bytes(tile).flatten()
        )
    assert int(lin[:, c:].count_nonzero()) == 0
    ragged = F.assemble_group_scales([sf[0, :7], sf[1], sf[2, :128]], 128)
    assert torch.equal(_bytes(F.unswizzle_scales(ragged, 384, 128))[128:228, :c], _bytes(sf[1]))


# --------------------------------------------------------------------------- bad input


def test_errors_name_the_tensor_and_expected_value() -> None:
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x: shape \(4, 24\).*divisible by 16"):
        F.quantize_nvfp4(x)
    with pytest.raises(ValueError, match=r"x: dtype torch.int32"):
        F.quantize_nvfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x: shape \(32,\)"):
        F.quantize_nvfp4(torch.ones(32))
    with pytest.raises(ValueError, match=r"global_scale: shape \(2,\), expected \(\) or \(3,\)"):
        F.quantize_nvfp4(torch.ones(3, 4, 32), torch.ones(2))
    with pytest.raises(ValueError, match=r"x: shape \(2, 4, 32\), expected \[M, K\]"):
        F.quantize_nvfp4_activation(torch.ones(2, 4, 32))
    p, sf, gs = F.quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"packed: dtype torch.int8"):
        F.dequantize_nvfp4(p.view(torch.int8), sf, gs)
    with pytest.raises(ValueError, match=r"block_scales: dtype torch.float32"):
        F.dequantize_nvfp4(p, sf.float(), gs)
    with pytest.raises(ValueError, match=r"block_scales: shape \(4, 1\), expected \(4, 2\)"):
        F.dequantize_nvfp4(p, sf[:, :1], gs)
    with pytest.raises(ValueError, match=r"packed: shape \(4, 12\).*divisible by 16"):
        F.dequantize_nvfp4(p[:, :12], sf, gs)
    with pytest.raises(ValueError, match=r"block_scales: shape \(4, 2\), expected \(128, 4\)"):
        F.dequantize_nvfp4(p, sf, gs, swizzled=True)
    with pytest.raises(ValueError, match=r"blocked: shape \(128, 4\), expected \[..., 256, 4\]"):
        F.unswizzle_scales(F.swizzle_scales(sf), 200, 32)
    with pytest.raises(ValueError, match=r"k: 40, expected a multiple of 16"):
        F.unswizzle_scales(F.swizzle_scales(sf), 4, 40)
    with pytest.raises(ValueError, match=r"padded_rows: 100"):
        F.assemble_group_scales(sf[None], 100)
    with pytest.raises(ValueError, match=r"sf\[1\]: shape \(129, 2\), expected \[R_g <= 128, 2\]"):
        F.assemble_group_scales([sf, sf.new_zeros(129, 2)], 128)
    with pytest.raises(ValueError, match=r"codes: shape \(3,\), expected an even last dim"):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


# --------------------------------------------------------------------------- against vLLM 0.21.0


def test_vllm_dequantize_to_dtype_equals_ours_linear_and_swizzled(vllm_nvfp4) -> None:
    deq = vllm_nvfp4.emu.dequantize_to_dtype
    for r, k in SHAPES:
        packed, sf, gs = F.quantize_nvfp4(_rand((r, k), 13 + r))
        for dtype in (torch.float32, torch.bfloat16):
            ours = F.dequantize_nvfp4(packed, sf, gs, dtype)
            theirs_lin = deq(packed, sf, gs, dtype, 16, swizzle=False)
            assert torch.equal(ours, theirs_lin), (r, k, dtype)
            if k % 64 != 0:
                continue  # vLLM's swizzled path needs K//16 % 4 == 0 (no column un-padding)
            theirs_swz = deq(packed, F.swizzle_scales(sf), gs, dtype, 16, swizzle=True)
            assert torch.equal(ours, theirs_swz), (r, k, dtype)
            ours_swz = F.dequantize_nvfp4(packed, F.swizzle_scales(sf), gs, dtype, swizzled=True)
            assert torch.equal(ours_swz, theirs_swz)


def test_vllm_dequantize_to_dtype_3d_per_expert_scales(vllm_nvfp4) -> None:
    w = _rand((4, 64, 48), 14)
    gs = F.global_scale_from_amax(w.float().abs().amax(dim=(1, 2)))
    packed, sf, _ = F.quantize_nvfp4(w, gs)
    theirs = vllm_nvfp4.emu.dequantize_to_dtype(packed, sf, gs, torch.float32, 16, swizzle=False)
    assert torch.equal(F.dequantize_nvfp4(packed, sf, gs, torch.float32), theirs)


@pytest.mark.parametrize("static", [False, True])
def test_vllm_ref_nvfp4_quant_bit_exact(vllm_nvfp4, static: bool) -> None:
    """Our activation quantizer == ref_nvfp4_quant(x, 1/input_scale) (vLLM's quantize-side gs)."""
    for m, k in SHAPES:
        x = _rand((m, k), 15 + m)
        x[0, :16] = 0  # an all-zero block
        x[-1, :3] = -0.0
        s = F.global_scale_from_amax(x.float().abs().max()) / (3 if static else 1)  # 3: saturates
        packed, sf, gs = F.quantize_nvfp4_activation(x, s if static else None)
        gs_q = (1.0 / gs).to(torch.float32)  # what vLLM stores as input_global_scale_inv
        vals, scale = vllm_nvfp4.emu.ref_nvfp4_quant(x, gs_q, 16)
        ours = F.decode_e2m1(F.unpack_e2m1(packed))
        assert torch.equal(_bytes(sf.float()), _bytes(scale)), (m, k)  # fp32 bit patterns
        # vLLM maps an input of exactly -0.0 to +0 (torch.sign(-0.0) == 0); we keep the sign bit
        # (code 8). Everywhere else, including small negatives that round to -0, bits agree.
        nz = x.float() != 0
        assert torch.equal(ours, vals) and torch.equal(
            ours[nz].view(torch.int32), vals[nz].view(torch.int32)
        )


def test_vllm_ref_nvfp4_quant_dequant_matches(vllm_nvfp4) -> None:
    x = _rand((50, 64), 16).float()
    s = F.global_scale_from_amax(x.abs().max())
    theirs = vllm_nvfp4.emu.ref_nvfp4_quant_dequant(x, (1.0 / s).float(), 16)
    ours = F.dequantize_nvfp4(*F.quantize_nvfp4_activation(x, s), torch.float32)
    # they dequantize with scale / gs_q, we with scale * gs: at most 1 ulp apart in fp32
    torch.testing.assert_close(ours, theirs, rtol=2**-22, atol=0)


def test_vllm_swizzle_blockscale_layout(vllm_nvfp4, monkeypatch: pytest.MonkeyPatch) -> None:
    # swizzle_blockscale ends with .cuda(); make that a no-op to run vLLM's own code on CPU.
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    for rows, cols in [(1, 1), (127, 3), (128, 4), (129, 5), (300, 8)]:
        sf = _rand((rows, cols), 17 + rows).float().abs().to(torch.float8_e4m3fn)
        ours = F.swizzle_scales(sf)
        assert torch.equal(_bytes(ours), _bytes(vllm_nvfp4.utils.swizzle_blockscale(sf)))
        padded = sf.new_zeros(ours.shape)
        padded[:rows, :cols] = sf
        blocked = vllm_nvfp4.to_blocked(padded.view(torch.uint8), backend="torch")
        assert torch.equal(_bytes(ours).flatten(), blocked)
        # convert_swizzled_to_linear slices columns with the logical K, i.e. keeps the pad columns
        back = vllm_nvfp4.emu.convert_swizzled_to_linear(ours, rows, cols * 16, 16)
        assert torch.equal(_bytes(back[:, :cols]), _bytes(sf))
    sf3 = _rand((2, 130, 6), 18).float().abs().to(torch.float8_e4m3fn)
    assert torch.equal(
        _bytes(F.swizzle_scales(sf3)), _bytes(vllm_nvfp4.utils.swizzle_blockscale(sf3))
    )
