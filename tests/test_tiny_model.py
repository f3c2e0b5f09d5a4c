"""cutedsl.tools.tiny_model + names: layouts vLLM 0.21.0 and HF transformers 5.17.0 expect.

The layout checks compare against three independent sources: research/vllm021_dsv4.md §4's
tensor table (hard-coded here), HF's DeepseekV4ForCausalLM module tree, and the parameters that
vLLM 0.21.0's own DeepseekV4ForCausalLM declares and fills through its real load_weights (built
on the CPU in a subprocess, with only the GPU-only pieces stubbed).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from cutedsl.tools import names as N
from cutedsl.tools import quantize as Q
from cutedsl.tools import tiny_model as TM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small config with every code path (SWA, C4+indexer, C128, hash and score MoE, mHC).
MICRO = {"hidden_size": 512, "n_routed_experts": 8, "moe_intermediate_size": 128, "vocab_size": 256}


def _read(ckpt: str) -> dict[str, torch.Tensor]:
    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        with safe_open(os.path.join(ckpt, fn), "pt") as h:
            for k in h.keys():
                assert idx[k] == fn, f"{k}: index says {idx[k]}, found in {fn}"
                out[k] = h.get_tensor(k)
    assert set(out) == set(idx), "index and shards disagree"
    return out


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """Micro checkpoints of one seed: {(format, scheme): path}."""
    root = tmp_path_factory.mktemp("micro")
    out = {}
    for fmt, scheme in [
        ("native", "native"),
        ("native", "hf"),
        ("nvfp4", "native"),
        ("nvidia-mixed", "native"),
        ("bf16", "native"),
        ("native-fp8", "native"),
    ]:
        p = str(root / f"{fmt}-{scheme}")
        TM.generate(p, fmt, scheme, "tiny", seed=3, overrides=MICRO)
        out[(fmt, scheme)] = p
    return out


# ------------------------------------------------------------------------------ names


def test_names_bijective_and_cover_every_tensor():
    cfg = TM.make_config("tiny", "nvfp4")
    names = list(TM.expected_tensors(cfg, "nvfp4"))
    hf = [N.native_to_hf(n) for n in names]
    assert len(set(hf)) == len(hf)
    assert [N.hf_to_native(h) for h in hf] == names
    assert N.native_to_hf("layers.3.attn.wq_a.weight_scale_2") == (
        "model.layers.3.self_attn.q_a_proj.weight_scale_2"
    )
    assert N.native_to_hf("layers.1.attn.indexer.compressor.ape") == (
        "model.layers.1.self_attn.compressor.indexer.position_bias"
    )
    assert (
        N.native_to_hf("layers.2.ffn.experts.7.w3.weight")
        == "model.layers.2.mlp.experts.7.up_proj.weight"
    )
    assert N.native_to_hf("layers.2.ffn.shared_experts.w2.input_scale") == (
        "model.layers.2.mlp.shared_experts.down_proj.input_scale"
    )
    assert N.native_to_hf("head.weight") == "lm_head.weight"
    for bad in ("layers.0.attn.wq_c.weight", "model.layers.0.foo.weight", "embedding.weight"):
        with pytest.raises(KeyError, match="not a DeepSeek V4"):
            N.native_to_hf(bad) if not bad.startswith("model.") else N.hf_to_native(bad)
    with pytest.raises(ValueError, match="naming scheme"):
        N.detect_scheme(["layers.0.attn.wq_a.weight", "model.norm.weight"])


def test_hf_names_are_the_hf_model_state_dict():
    """Our HF names (experts fused as HF stores them) == DeepseekV4ForCausalLM's state dict."""
    from transformers import DeepseekV4ForCausalLM

    from cutedsl.tools.golden import hf_config

    cfg = TM.make_config("tiny", "bf16")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_config(cfg))
    hf_keys = set(model.state_dict())
    ours = set()
    for n in TM.expected_tensors(cfg, "bf16", "hf"):
        if ".mlp.experts." in n:
            layer = int(n.split(".")[2])
            which = "down_proj" if ".down_proj." in n else "gate_up_proj"
            ours.add(N.hf_expert_param(layer, which))
        else:
            ours.add(n)
    assert ours == hf_keys, (sorted(ours - hf_keys)[:5], sorted(hf_keys - ours)[:5])


# ------------------------------------------------------------------------------ layout


def test_tiny_native_layout_matches_research_table():
    """research/vllm021_dsv4.md §4 table (H scaled to the preset's 2048)."""
    cfg = TM.make_config("tiny", "native")
    exp = TM.expected_tensors(cfg, "native")
    assert len(exp) == 532
    H = cfg["hidden_size"]
    e8 = torch.float8_e8m0fnu
    want = {
        "embed.weight": ((1024, H), torch.bfloat16),
        "hc_head_fn": ((4, 4 * H), torch.float32),
        "layers.0.hc_attn_fn": ((24, 4 * H), torch.float32),
        "layers.0.hc_ffn_scale": ((3,), torch.float32),
        "layers.0.attn.wq_a.weight": ((256, H), torch.float8_e4m3fn),
        "layers.0.attn.wq_a.scale": ((2, H // 128), e8),
        "layers.0.attn.wq_b.weight": ((8192, 256), torch.float8_e4m3fn),
        "layers.0.attn.wq_b.scale": ((64, 2), e8),
        "layers.0.attn.wo_a.weight": ((256, 4096), torch.float8_e4m3fn),
        "layers.0.attn.wo_a.scale": ((2, 32), e8),
        "layers.0.attn.wo_b.weight": ((H, 256), torch.float8_e4m3fn),
        "layers.0.attn.attn_sink": ((16,), torch.float32),
        "layers.1.attn.compressor.wkv.weight": ((1024, H), torch.bfloat16),
        "layers.2.attn.compressor.wgate.weight": ((512, H), torch.bfloat16),
        "layers.2.attn.compressor.ape": ((128, 512), torch.float32),
        "layers.1.attn.compressor.ape": ((4, 1024), torch.float32),
        "layers.3.attn.indexer.wq_b.weight": ((8192, 256), torch.float8_e4m3fn),
        "layers.3.attn.indexer.weights_proj.weight": ((64, H), torch.bfloat16),
        "layers.3.attn.indexer.compressor.wkv.weight": ((256, H), torch.bfloat16),
        "layers.3.attn.indexer.compressor.ape": ((4, 256), torch.float32),
        "layers.3.attn.indexer.compressor.norm.weight": ((128,), torch.bfloat16),
        "layers.1.ffn.gate.tid2eid": ((1024, 6), torch.int64),
        "layers.2.ffn.gate.bias": ((16,), torch.float32),
        "layers.0.ffn.shared_experts.w2.scale": ((H // 128, 2), e8),
        "layers.0.ffn.experts.15.w1.weight": ((256, H // 2), torch.int8),  # DeepSeek's I8
        "layers.0.ffn.experts.15.w1.scale": ((256, H // 32), e8),
        "layers.0.ffn.experts.0.w2.weight": ((H, 128), torch.int8),
        "layers.0.ffn.experts.0.w2.scale": ((H, 8), e8),
    }
    for n, v in want.items():
        assert exp[n] == v, (n, exp[n], v)
    assert not any("layers.0.attn.compressor" in n or "layers.2.attn.indexer" in n for n in exp)
    assert not any(n.startswith("layers.2.ffn.gate.tid2eid") for n in exp)


def test_nvfp4_layout_every_projection_quantized():
    cfg = TM.make_config("tiny", "nvfp4")
    exp = TM.expected_tensors(cfg, "nvfp4")
    H = cfg["hidden_size"]
    for proj, (n, k) in {
        "attn.wq_a": (256, H),
        "attn.wkv": (512, H),
        "attn.wo_a": (256, 4096),
        "attn.wo_b": (H, 256),
        "attn.wq_b": (8192, 256),
        "ffn.shared_experts.w1": (256, H),
        "ffn.experts.3.w2": (H, 256),
    }.items():
        p = f"layers.1.{proj}"
        assert exp[f"{p}.weight"] == ((n, k // 2), torch.uint8)
        assert exp[f"{p}.weight_scale"] == ((n, k // 16), torch.float8_e4m3fn)
        assert exp[f"{p}.weight_scale_2"] == ((), torch.float32)
        assert exp[f"{p}.input_scale"] == ((), torch.float32)
    assert exp["layers.1.attn.indexer.wq_b.weight_scale"] == ((8192, 16), torch.float8_e4m3fn)
    for bf16 in (
        "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.indexer.weights_proj.weight",
        "layers.1.ffn.gate.weight",
        "embed.weight",
        "head.weight",
    ):
        assert exp[bf16][1] == torch.bfloat16, bf16
    assert not any(n.endswith(".scale") for n in exp)
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["scale_fmt"], qc["group_size"]) == (
        "modelopt",
        "NVFP4",
        "ue8m0",
        16,
    )


def test_flash_layers_preset_dims():
    cfg = TM.make_config("flash-layers", "nvfp4")
    exp = TM.expected_tensors(cfg, "nvfp4")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["o_groups"]) == (4096, 64, 8)
    assert exp["layers.0.attn.wo_a.weight"][0] == (8 * 1024, 4096 // 2)
    assert exp["layers.0.ffn.experts.255.w1.weight"][0] == (2048, 2048)
    assert exp["layers.1.ffn.experts.0.w2.weight_scale"][0] == (4096, 2048 // 16)
    assert TM.mhc_decode_hazard(cfg) is None
    assert TM.mhc_decode_hazard(TM.make_config("tiny", "native")) is None
    assert "n_splits" in TM.mhc_decode_hazard(
        TM.make_config("tiny", "native", {"hidden_size": 1024})
    )


def test_check_config_refuses_broken_configs():
    for bad, msg in [
        ({"head_dim": 256}, "head_dim"),
        ({"o_lora_rank": 100}, "o_lora_rank"),
        ({"hidden_size": 1000}, "hidden_size"),
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"o_groups": 3}, "o_groups"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TM.make_config("tiny", "native", bad)


# ------------------------------------------------------------------------------ generated files


@pytest.mark.parametrize(
    "fmt,scheme",
    [
        ("native", "native"),
        ("native", "hf"),
        ("nvfp4", "native"),
        ("nvidia-mixed", "native"),
        ("bf16", "native"),
        ("native-fp8", "native"),
    ],
)
def test_generated_checkpoint_matches_layout(micro, fmt, scheme):
    path = micro[(fmt, scheme)]
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg == TM.make_config("tiny", fmt, MICRO)
    exp = TM.expected_tensors(cfg, fmt, scheme)
    got = _read(path)
    assert set(got) == set(exp), sorted(set(got) ^ set(exp))[:5]
    for n, t in got.items():
        assert (tuple(t.shape), t.dtype) == exp[n], n
        if t.is_floating_point() and t.dtype not in (torch.float8_e8m0fnu,):
            assert torch.isfinite(t.float()).all(), n
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp-" in f]


def test_deterministic_seeded_and_format_consistent(micro, tmp_path):
    a = _read(micro[("native", "native")])
    TM.generate(str(tmp_path / "again"), "native", "native", "tiny", seed=3, overrides=MICRO)
    TM.generate(str(tmp_path / "seed4"), "native", "native", "tiny", seed=4, overrides=MICRO)
    b, c = _read(str(tmp_path / "again")), _read(str(tmp_path / "seed4"))
    for n in a:
        assert torch.equal(
            a[n].view(torch.uint8) if a[n].element_size() == 1 else a[n],
            b[n].view(torch.uint8) if b[n].element_size() == 1 else b[n],
        ), n
    assert not torch.equal(
        a["layers.0.attn.wq_b.weight"].view(torch.uint8),
        c["layers.0.attn.wq_b.weight"].view(torch.uint8),
    )
    # HF-named and native-named files hold the same bytes under mapped names.
    h = _read(micro[("native", "hf")])
    for n, t in a.items():
        u = h[N.native_to_hf(n)]
        assert torch.equal(
            t.view(torch.uint8) if t.element_size() == 1 else t,
            u.view(torch.uint8) if u.element_size() == 1 else u,
        ), n
    # nvfp4 and native dequantize to the same master weights within their quantization error.
    ck_n, ck_f = Q.Checkpoint(micro[("native", "native")]), Q.Checkpoint(micro[("nvfp4", "native")])
    for lin in ("layers.1.attn.wq_b", "layers.2.ffn.experts.5.w1", "layers.3.attn.wo_a"):
        x, y = Q.read_linear(ck_n, lin), Q.read_linear(ck_f, lin)
        rel = float((x - y).norm() / x.norm())
        assert 0 < rel < 0.2, (lin, rel)
    f = _read(micro[("nvfp4", "native")])
    for pair in (
        ("attn.wq_a", "attn.wkv"),
        ("ffn.shared_experts.w1", "ffn.shared_experts.w3"),
        ("ffn.experts.6.w1", "ffn.experts.6.w3"),
    ):
        s0, s1 = (f[f"layers.2.{p}.weight_scale_2"] for p in pair)
        assert torch.equal(s0, s1), pair
    assert not torch.equal(
        f["layers.2.attn.wq_a.weight_scale_2"], f["layers.2.attn.wq_b.weight_scale_2"]
    )


def test_conditioning_knobs_router_gain_and_expert_shared():
    """router_gain scales only ffn.gate; expert_shared makes a layer's routed experts correlated by
    r (same per-weight std), other layers' experts independent; 1 / 0 is the plain N(0, 1/K)."""
    cfg = TM.make_config("tiny", "native", MICRO)
    specs = {s.name: s for s in TM.tensor_specs(cfg)}
    gate, e0, e1 = (specs[f"layers.2.ffn.{n}"] for n in ("gate", "experts.0.w1", "experts.1.w1"))
    other, wq = specs["layers.3.ffn.experts.0.w1"], specs["layers.2.attn.wq_b"]
    plain = dict(router_gain=1.0, expert_shared=0.0)

    def m(s, **kw):
        return TM.master_tensor(s, cfg, 3, **kw)

    H = cfg["hidden_size"]
    assert float(m(gate, **plain).std() * H**0.5) == pytest.approx(1.0, rel=0.05)
    assert torch.allclose(m(gate), m(gate, **plain) * TM.DEFAULT_ROUTER_GAIN)
    assert torch.equal(m(wq), m(wq, **plain))  # only the router and the experts change
    assert torch.equal(
        m(specs["layers.2.ffn.gate.bias"]), m(specs["layers.2.ffn.gate.bias"], **plain)
    )

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])

    r = TM.DEFAULT_EXPERT_SHARED
    a, b = m(e0), m(e1)
    assert corr(a, b) == pytest.approx(r, abs=0.02)  # same layer: the common base
    assert abs(corr(a, m(other))) < 0.02  # another layer: independent
    assert float(a.std() * H**0.5) == pytest.approx(1.0, rel=0.05)
    assert abs(corr(m(e0, **plain), m(e1, **plain))) < 0.02
    # own part of the conditioned expert is the plain master (one generator per name).
    assert torch.allclose(
        a, (1 - r) ** 0.5 * m(e0, **plain) + r**0.5 * m(TM.Spec("layers.2.ffn.experts.base.w1",
        e0.shape, "linear"), **plain), atol=1e-6,
    )  # fmt: skip
    with pytest.raises(ValueError, match="expert_shared"):
        m(e0, expert_shared=1.0)
    with pytest.raises(ValueError, match="router_gain"):
        m(gate, router_gain=0.0)


def test_generation_failure_leaves_nothing(tmp_path):
    out = tmp_path / "ckpt"
    cfg = TM.make_config("tiny", "bf16", MICRO)

    def broken():
        yield 0, {"embed.weight": torch.zeros(2, 2)}
        raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        TM.write_checkpoint(str(out), cfg, broken())
    assert os.listdir(tmp_path) == []
    out.mkdir()
    with pytest.raises(FileExistsError):
        TM.write_checkpoint(str(out), cfg, iter([]))


# ------------------------------------------------------------------------------ codecs


def test_fp8_block_and_mxfp4_codecs_known_answers():
    # MXFP4: a block of 32 with amax 3.0 -> scale 2^ceil(log2(0.5)) = 0.5; e2m1 codes exact.
    row = torch.tensor([3.0, -1.5, 0.25, 0.75, 2.0, -3.0, 0.0, 1.0] * 4)
    q, s = Q.quantize_mxfp4(row[None])
    assert s.view(torch.uint8).tolist() == [[126]]
    assert torch.equal(Q.dequantize_mxfp4(q, s), row[None])
    # 0.3 / 0.5 = 0.6 -> rounds to 0.5 -> 0.25; 1.3/0.5=2.6 -> 3.0 -> 1.5 (nearest)
    q, s = Q.quantize_mxfp4(torch.tensor([[3.0, 0.3, 1.3] + [0.0] * 29]))
    assert Q.dequantize_mxfp4(q, s)[0, :3].tolist() == [3.0, 0.25, 1.5]
    # FP8 block: non-multiple-of-128 shape, e8m0 and f32 scales; error within e4m3 precision.
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    for e8 in (True, False):
        qq, ss = Q.quantize_fp8_block(w, e8m0=e8)
        assert ss.shape == (2, 3) and ss.dtype == (torch.float8_e8m0fnu if e8 else torch.float32)
        d = Q.dequantize_fp8_block(qq, ss)
        assert float(((d - w).abs() / w.abs().clamp_min(1e-2)).max()) < 0.07
        assert float((d - w).norm() / w.norm()) < 0.03


# ------------------------------------------------------------------------------ vLLM loader


_PROBE = r"""
import json, os, sys, types
import torch
ckpt, dist_init = sys.argv[1], sys.argv[2]
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
type(current_platform).device_type = "cpu"
type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
class _Dummy:
    def __init__(self, *a, **k):
        pass
torch.cuda.Stream = _Dummy
torch.cuda.Event = _Dummy
sys.modules["vllm.model_executor.layers.mhc"] = types.ModuleType("vllm.model_executor.layers.mhc")
import vllm.model_executor.layers.quantization.fp8 as _fp8
import vllm.model_executor.layers.quantization.modelopt as _mo
import vllm.model_executor.layers.quantization.mxfp4 as _mx
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
_fp8.init_fp8_linear_kernel = lambda *a, **k: None
_mo.init_nvfp4_linear_kernel = lambda *a, **k: None
_mx.select_deepseek_v4_mxfp4_moe_backend = lambda moe: (Mxfp4MoeBackend.MARLIN, None)
_mo.select_nvfp4_moe_backend = lambda *a, **k: (NvFp4MoeBackend.MARLIN, None)
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.deepseek_v4 import DeepseekV4ForCausalLM
import vllm.model_executor.models.deepseek_v4 as _d4
from vllm.utils.torch_utils import set_default_torch_dtype
from safetensors import safe_open
mc = ModelConfig(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                cache_config=CacheConfig(cache_dtype="fp8"))
out = {"quant": type(vc.quant_config).__name__, "file": _d4.__file__}
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
        distributed_init_method="file://" + dist_init, backend="gloo")
    initialize_model_parallel(1, 1)
    with set_default_torch_dtype(torch.bfloat16):
        model = DeepseekV4ForCausalLM(vllm_config=vc)
    params = dict(model.named_parameters())
    out["params"] = {n: [list(p.shape), str(p.dtype)] for n, p in params.items()}
    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    def weights():
        for fn in sorted(set(idx.values())):
            with safe_open(os.path.join(ckpt, fn), "pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)
    loaded = model.load_weights(weights())
    out["not_loaded"] = sorted(set(params) - set(loaded))
    out["methods"] = sorted({type(m.quant_method).__name__ for m in model.modules()
                             if getattr(m, "quant_method", None) is not None})
    out["fused_wqa_wkv"] = params["model.layers.1.attn.fused_wqa_wkv.weight"].view(torch.uint8).flatten().tolist()
    out["w13"] = params["model.layers.2.ffn.experts.w13_weight"].view(torch.uint8)[3].flatten().tolist()
print("PROBE_JSON " + json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def _upstream_state() -> str:
    import vllm.model_executor  # noqa: F401  (locate without importing the model files)

    site = os.path.dirname(os.path.dirname(__import__("vllm").__file__))
    want = {}
    for line in open(os.path.join(REPO, "vllm_patches", "UPSTREAM")):
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#"):
            want[parts[1]] = parts[2]
    ok = all(
        hashlib.sha256(open(os.path.join(site, "vllm", p), "rb").read()).hexdigest() == h
        for p, h in want.items()
    )
    return "pristine" if ok else "overlaid (not pristine)"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["native", "nvfp4"])
def test_vllm_loader_fills_every_parameter(micro, fmt, tmp_path):
    """vLLM 0.21.0's DeepseekV4ForCausalLM (built on CPU) declares exactly what we write."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    path = micro[(fmt, "native")]
    r = subprocess.run(
        [sys.executable, str(script), path, str(tmp_path / "dist_init")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("PROBE_JSON ")]
    state = _upstream_state() if line else "?"
    assert line, f"probe failed (rc {r.returncode}):\n{r.stderr[-3000:]}"
    d = json.loads(line[0][len("PROBE_JSON ") :])
    where = f"(vLLM deepseek_v4.py {state}: {d['file']})"
    assert d["quant"] == {"native": "DeepseekV4FP8Config", "nvfp4": "ModelOptNvFp4Config"}[fmt], (
        where
    )
    # Only the unused indexer.k_norm (not in DeepSeek's checkpoints either) stays unfilled.
    assert d["not_loaded"] == sorted(
        f"model.layers.{i}.attn.indexer.k_norm.{w}" for i in (1, 3) for w in ("bias", "weight")
    ), where
    ck = _read(path)
    # The loader put the right bytes in the right place: fused rows = [wq_a; wkv]; w13 = [w1; w3].
    fused = torch.cat([ck["layers.1.attn.wq_a.weight"], ck["layers.1.attn.wkv.weight"]])
    assert d["fused_wqa_wkv"] == fused.view(torch.uint8).flatten().tolist(), where
    w13 = torch.cat(
        [ck["layers.2.ffn.experts.3.w1.weight"], ck["layers.2.ffn.experts.3.w3.weight"]]
    )
    assert d["w13"] == w13.view(torch.uint8).flatten().tolist(), where
    if fmt == "nvfp4":
        p = d["params"]
        assert p["model.layers.1.attn.wo_a.weight"][0] == [256, 4096 // 2], where
        assert p["model.layers.1.attn.fused_wqa_wkv.weight_scale_2"][0] == [2], where
        assert any("NvFp4" in m for m in d["methods"]), (d["methods"], where)
