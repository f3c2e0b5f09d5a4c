"""cutedsl.tools.quantize: DSv4 checkpoint -> full NVFP4 ModelOpt checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cutedsl import formats as F
from cutedsl.tools import names as N
from cutedsl.tools import quantize as Q
from cutedsl.tools import tiny_model as TM

MICRO = {"hidden_size": 512, "n_routed_experts": 8, "moe_intermediate_size": 128, "vocab_size": 256}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qsrc")
    out = {}
    for fmt, scheme in [
        ("native", "native"),
        ("bf16", "hf"),
        ("native-fp8", "native"),
        ("nvidia-mixed", "native"),
    ]:
        p = str(root / f"{fmt}-{scheme}")
        TM.generate(p, fmt, scheme, "tiny", seed=5, overrides=MICRO, max_shard_bytes=4 << 20)
        out[fmt] = p
    return out


def _all(path: str) -> dict[str, torch.Tensor]:
    idx = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        out.update(load_file(os.path.join(path, fn)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_nvfp4_block_error(src: torch.Tensor, packed, sf, gs) -> None:
    """Every element within half an e2m1 step of its block: |err| <= 1.0 * block scale
    (the largest e2m1 gap is 4 -> 6), and exact zero stays zero."""
    n, k = src.shape
    deq = F.dequantize_nvfp4(packed, sf, gs, dtype=torch.float32)
    step = (sf.float() * gs.float()).repeat_interleave(16, dim=1)  # [N, K] block scale
    err = (deq - src).abs()
    assert bool((err <= step * (1.0 + 1e-5)).all()), float((err / step.clamp_min(1e-30)).max())
    # and it is an NVFP4 quantization, not a copy: typical Gaussian error ~ 5-12 %.
    rel = float((deq - src).norm() / src.norm())
    assert 0.01 < rel < 0.15, rel


@pytest.mark.parametrize("fmt", ["native", "bf16", "native-fp8", "nvidia-mixed"])
def test_convert_within_nvfp4_error(sources, fmt, tmp_path):
    src = sources[fmt]
    dst = str(tmp_path / "nvfp4")
    cfg = Q.convert(src, dst)
    ck_s, ck_d = Q.Checkpoint(src), Q.Checkpoint(dst)
    assert ck_d.scheme == ck_s.scheme
    assert cfg == json.load(open(os.path.join(dst, "config.json")))
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"], qc["scale_fmt"]) == (
        "modelopt",
        "NVFP4",
        16,
        "ue8m0",
    )
    assert Q.detect_format(cfg) == "nvfp4"
    exp = TM.expected_tensors(cfg, "nvfp4", ck_d.scheme)
    assert set(ck_d.names()) == set(exp)
    for n in exp:
        assert ck_d.meta(n) == exp[n], n
    s_all, d_all = _all(src), _all(dst)
    gs_seen = {}
    for spec in TM.tensor_specs(cfg):
        name = N.to_scheme(spec.name, ck_s.scheme)
        if spec.kind != "linear":
            leaf = f"{name}.weight" if spec.kind == "bf16_linear" else name
            assert torch.equal(_bits(s_all[leaf]), _bits(d_all[leaf])), leaf  # copied bit for bit
            continue
        if TM.storage_of(spec, fmt) == "nvfp4":  # nvidia-mixed experts: copied, not re-quantized
            for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                assert torch.equal(_bits(s_all[f"{name}.{leaf}"]), _bits(d_all[f"{name}.{leaf}"]))
            continue
        src_w = Q.read_linear(ck_s, name)
        packed, sf, gs = (
            d_all[f"{name}.{x}"] for x in ("weight", "weight_scale", "weight_scale_2")
        )
        _check_nvfp4_block_error(src_w, packed, sf, gs)
        if spec.fuse is not None:
            gs_seen.setdefault(spec.fuse, []).append((float(gs), float(src_w.abs().amax())))
        else:  # a lone projection's global scale is its own amax / (6*448)
            assert float(gs) == pytest.approx(float(src_w.abs().amax()) / (6 * 448), rel=1e-6)
        assert float(d_all[f"{name}.input_scale"]) == pytest.approx(32.0 / (6 * 448))
    for fuse, vals in gs_seen.items():
        assert len(vals) == 2 and vals[0][0] == vals[1][0], fuse  # one shared global scale
        assert vals[0][0] == pytest.approx(max(v[1] for v in vals) / (6 * 448), rel=1e-6), fuse
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_convert_names_option_and_multi_shard(sources, tmp_path):
    # The native source was written in 4 MiB shards: one output shard per input shard.
    src = sources["native"]
    n_in = len(
        set(
            json.load(open(os.path.join(src, "model.safetensors.index.json")))[
                "weight_map"
            ].values()
        )
    )
    assert n_in > 2
    dst = str(tmp_path / "hf")
    Q.convert(src, dst, names="hf")
    ck = Q.Checkpoint(dst)
    assert ck.scheme == "hf" and len(ck.shard_files()) == n_in
    a = Q.read_linear(Q.Checkpoint(src), "layers.3.attn.wo_a")
    b = Q.read_linear(ck, "model.layers.3.self_attn.o_a_proj")
    assert float((a - b).norm() / a.norm()) < 0.15


def _convert_on(sources, tmp_path, device: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for fmt in ("native", "native-fp8", "nvidia-mixed", "bf16"):
        dst = str(tmp_path / f"{fmt}-{device.replace(':', '')}")
        Q.convert(sources[fmt], dst, device=device)
        out[fmt] = _all(dst)
    return out


def test_convert_device_cpu_is_the_default(sources, tmp_path):
    """`device` reaches every re-quantized projection: the CPU named explicitly writes what the
    default writes, bit for bit."""
    src, a, b = sources["native"], str(tmp_path / "default"), str(tmp_path / "cpu")
    Q.convert(src, a)
    Q.convert(src, b, device="cpu")
    ta, tb = _all(a), _all(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(_bits(ta[k]), _bits(tb[k])), k


@pytest.mark.gpu
def test_convert_on_the_gpu_matches_the_cpu(sources, tmp_path):
    """dsv4-quantize --device cuda: every tensor of every source layout the same, bit for bit,
    as the CPU conversion (and on the CPU when written)."""
    gpu, cpu = _convert_on(sources, tmp_path, "cuda"), _convert_on(sources, tmp_path, "cpu")
    for fmt in cpu:
        assert gpu[fmt].keys() == cpu[fmt].keys(), fmt
        for k, v in cpu[fmt].items():
            g = gpu[fmt][k]
            assert g.device.type == "cpu" and g.dtype == v.dtype and g.shape == v.shape, (fmt, k)
            assert torch.equal(_bits(g), _bits(v)), (fmt, k)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _rewrite(path: str, fn) -> None:
    """Apply fn(dict) to the tensors of every shard of `path` (and fix the index)."""
    idx_path = os.path.join(path, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    new_map = {}
    for shard in sorted(set(idx["weight_map"].values())):
        t = fn(load_file(os.path.join(path, shard)))
        save_file(t, os.path.join(path, shard))
        new_map.update({k: shard for k in t})
    idx["weight_map"] = new_map
    json.dump(idx, open(idx_path, "w"))


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "missing tensor 'layers.2.attn.wo_b.scale'"),
        ("unknown", "unknown tensor 'layers.0.attn.wq_c.weight'"),
        ("shape", "tensor 'layers.1.ffn.experts.3.w2.weight': \\[512, 32\\]"),
        ("dtype", "tensor 'layers.0.attn.wq_b.weight'.*float8_e4m3fn"),
        ("method", "quant_method 'awq'"),
        ("already", "already a full NVFP4"),
        ("config", "config.json"),
    ],
)
def test_refusals_leave_no_dst(sources, tmp_path, case, match):
    src = _copy(sources["native"], str(tmp_path / "src"))
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    if case == "missing":
        _rewrite(src, lambda t: {k: v for k, v in t.items() if k != "layers.2.attn.wo_b.scale"})
    elif case == "unknown":
        _rewrite(
            src,
            lambda t: (
                {**t, "layers.0.attn.wq_c.weight": torch.zeros(2, 2)} if "embed.weight" in t else t
            ),
        )
    elif case == "shape":
        _rewrite(
            src,
            lambda t: {
                k: (v[:, :32].contiguous() if k == "layers.1.ffn.experts.3.w2.weight" else v)
                for k, v in t.items()
            },
        )
    elif case == "dtype":
        _rewrite(
            src,
            lambda t: {
                k: (v.to(torch.bfloat16) if k == "layers.0.attn.wq_b.weight" else v)
                for k, v in t.items()
            },
        )
    elif case == "method":
        cfg["quantization_config"]["quant_method"] = "awq"
    elif case == "already":
        cfg["quantization_config"] = TM.quantization_config(cfg, "nvfp4")
    elif case == "config":
        cfg["o_lora_rank"] = 100
    json.dump(cfg, open(cfg_path, "w"))
    dst = tmp_path / "dst"
    with pytest.raises(Q.ConversionError, match=match):
        Q.convert(src, str(dst))
    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no temp dir left behind


def test_existing_dst_and_cli(sources, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        Q.convert(sources["native"], str(dst))
    assert (dst / "keep").read_text() == "x"
    assert Q.main([sources["native"], str(dst)]) == 2  # CLI refuses too, exit code 2
    # --force replaces only what a cutedsl tool wrote: a folder holding `keep` is refused.
    assert Q.main([sources["native"], str(dst), "--force"]) == 2
    assert sorted(os.listdir(dst)) == ["keep"] and (dst / "keep").read_text() == "x"
    (dst / "keep").unlink()
    assert Q.main([sources["native"], str(dst), "--force"]) == 0  # an empty folder: replaced
    assert Q.Checkpoint(str(dst)).config["quantization_config"]["quant_algo"] == "NVFP4"
    first = {f: (dst / f).read_bytes() for f in os.listdir(dst)}
    # A converter output is replaced by --force (its marker lists every file).
    assert Q.main([sources["bf16"], str(dst), "--force"]) == 0
    assert Q.Checkpoint(str(dst)).scheme == "hf"  # the bf16 source is HF-named
    assert {f: (dst / f).read_bytes() for f in os.listdir(dst)} != first
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f or ".old-" in f]
