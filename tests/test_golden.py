"""cutedsl.tools.golden: HF transformers 5.17.0 DeepseekV4ForCausalLM on dequantized checkpoints (CPU)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cutedsl.tools import golden as G
from cutedsl.tools import tiny_model as TM

MICRO = {"hidden_size": 512, "n_routed_experts": 8, "moe_intermediate_size": 128, "vocab_size": 256}
IDS = torch.randint(2, 256, (150,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    out = {}
    for fmt, scheme in [
        ("native", "native"),
        ("native", "hf"),
        ("nvfp4", "native"),
        ("bf16", "native"),
    ]:
        p = str(root / f"{fmt}-{scheme}")
        TM.generate(p, fmt, scheme, "tiny", seed=11, overrides=MICRO)
        out[(fmt, scheme)] = p
    return out


_cos = G.logprob_cosine


def test_deterministic_sane_and_hf_names_identical(ckpts):
    m1 = G.load_model(ckpts[("native", "native")])
    m2 = G.load_model(ckpts[("native", "native")])
    mh = G.load_model(ckpts[("native", "hf")])
    a, b, h = (G.golden_logits(m, IDS) for m in (m1, m2, mh))
    assert a.shape == (len(IDS), 256) and a.dtype == torch.float32
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), "golden is not deterministic"
    assert torch.equal(a, h), "HF-named and native-named checkpoints differ"
    # Not degenerate: positions differ, distribution neither flat nor one-hot.
    assert float(a.std(-1).min()) > 0.3 and float(a.std(-1).max()) < 10
    assert len(set(a.argmax(-1).tolist())) > 10
    # Causal: logits at t do not depend on later tokens.
    short = G.golden_logits(m1, IDS[:40])
    assert float((short - a[:40]).abs().max()) < 1e-4
    rms = G.layer_rms(m1, IDS)
    for k, v in rms.items():
        assert 0.1 < v < 10, (k, v)  # activations neither collapse nor blow up through the layers


def test_matches_hf_from_pretrained(ckpts):
    """A BF16 native-named checkpoint loaded by HF's own from_pretrained (HF's conversion mapping,
    not cutedsl.tools.names) gives the same parameters and logits as our loader."""
    from transformers import DeepseekV4ForCausalLM

    path = ckpts[("bf16", "native")]
    ours = G.load_model(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sd_o, sd_h = ours.state_dict(), hf.state_dict()
    assert set(sd_o) == set(sd_h)
    for k in sd_o:
        assert torch.equal(sd_o[k], sd_h[k]), k
    assert torch.equal(G.golden_logits(ours, IDS[:64]), G.golden_logits(hf, IDS[:64]))


def test_formats_agree_within_quantization_error(ckpts):
    """The same seed in bf16, native (FP8+MXFP4) and nvfp4 is the same model up to quantization:
    a wrong dequantization (scale layout, nibble order, fused-pair mapping) would break this."""
    logits = {
        f: G.golden_logits(G.load_model(ckpts[(f, "native")]), IDS)
        for f in ("bf16", "native", "nvfp4")
    }
    c_native = _cos(logits["bf16"], logits["native"])
    c_nvfp4 = _cos(logits["bf16"], logits["nvfp4"])
    assert float(c_native.min()) > 0.97, float(c_native.min())
    assert float(c_nvfp4.min()) > 0.9, float(c_nvfp4.min())
    # A different seed is a different model: far lower similarity (the test can fail).
    other = G.golden_logits(G.load_model(ckpts[("bf16", "native")]), IDS[::-1])
    assert float(_cos(logits["bf16"], other).mean()) < 0.5


def test_swa_rope_option_changes_only_sliding_layers(ckpts):
    cfg = TM.make_config("tiny", "native", MICRO)
    hf = G.hf_config(cfg)
    hv = G.hf_config(cfg, swa_rope="vllm")
    assert hf.rope_parameters["main"]["rope_type"] == "default"
    assert hv.rope_parameters["main"]["rope_type"] == "yarn"
    assert hv.rope_parameters["main"]["rope_theta"] == cfg["rope_theta"]
    assert hv.rope_parameters["compress"] == hf.rope_parameters["compress"]
    with pytest.raises(ValueError, match="swa_rope"):
        G.hf_config(cfg, swa_rope="bogus")


def test_tiny_preset_cpu_forward_300_tokens(tmp_path):
    """The real tiny preset (4 layers, H 2048) runs a 300-token CPU forward (time printed)."""
    p = str(tmp_path / "tiny")
    TM.generate(p, "bf16", "native", "tiny", seed=0)
    m = G.load_model(p)
    ids = torch.randint(2, 1024, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    t = time.time()
    out = G.golden_logits(m, ids)
    dt = time.time() - t
    print(f"tiny preset 300-token CPU forward: {dt:.2f} s on {os.cpu_count()} cores")
    assert out.shape == (300, 1024) and torch.isfinite(out).all()
    rms = G.layer_rms(m, ids)
    assert all(0.1 < v < 10 for v in rms.values()), rms


_ROPE_PROBE = r"""
import json, sys, torch
from vllm.platforms import current_platform
type(current_platform).device_type = "cpu"
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
from cutedsl.tools.golden import hf_config
from cutedsl.tools.tiny_model import make_config
cfg = make_config("tiny", "native")
out = {}
with set_current_vllm_config(VllmConfig()):
    for theta, lt in ((cfg["compress_rope_theta"], "compress"), (cfg["rope_theta"], "main")):
        # What DeepseekV4Attention.__init__ (deepseek_v4.py:1013-1035) builds for this layer type.
        rp = dict(cfg["rope_scaling"], rope_theta=theta, rope_type="deepseek_yarn", mscale=0,
                  mscale_all_dim=0, is_deepseek_v4=True, rope_dim=64)
        r = get_rope(512, max_position=cfg["max_position_embeddings"], rope_parameters=rp,
                     is_neox_style=False)
        cs = r.cos_sin_cache[:400].float()
        for mode in ("hf", "vllm"):
            e = DeepseekV4RotaryEmbedding(hf_config(cfg, swa_rope=mode))
            cos, sin = e(torch.zeros(1), torch.arange(400)[None], layer_type=lt)
            out[f"{lt}/{mode}"] = max(float((cos[0] - cs[:, :32]).abs().max()),
                                      float((sin[0] - cs[:, 32:]).abs().max()))
print("ROPE_JSON " + json.dumps(out))
"""


@pytest.mark.slow
def test_rope_vs_vllm_cos_sin_cache(tmp_path):
    """vLLM 0.21.0's DSv4 rotary cache equals HF's for compressed layers; for sliding-window
    layers vLLM applies YaRN (HF/DeepSeek do not), which `swa_rope="vllm"` reproduces."""
    import json
    import subprocess
    import sys

    script = tmp_path / "rope.py"
    script.write_text(_ROPE_PROBE)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("ROPE_JSON ")]
    assert line, r.stderr[-3000:]
    d = json.loads(line[0][len("ROPE_JSON ") :])
    assert d["compress/hf"] < 1e-6 and d["compress/vllm"] < 1e-6, d
    assert d["main/vllm"] < 1e-6, d
    assert d["main/hf"] > 0.1, d  # the known vLLM 0.21.0 SWA-YaRN difference


# --------------------------------------------------------------------------- W4A4 golden


@pytest.fixture(scope="module")
def w4a4_ckpts(tmp_path_factory):
    """MICRO checkpoints in the three formats our SM100 backend serves; in the nvfp4 one, a fused
    pair and one expert carry a larger input scale than their GEMM's other members."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("w4a4")
    out = {}
    for fmt in ("nvfp4", "nvidia-mixed", "ct-nvfp4-fp8"):
        p = str(root / fmt)
        TM.generate(p, fmt, "native", "tiny", seed=5, overrides=MICRO)
        out[fmt] = p
    shard = next(f for f in os.listdir(out["nvfp4"]) if f.endswith(".safetensors"))
    t = load_file(os.path.join(out["nvfp4"], shard))
    s = t["layers.0.attn.wq_a.input_scale"]
    t["layers.0.attn.wkv.input_scale"] = s * 2
    t["layers.0.ffn.experts.3.w2.input_scale"] = s * 3
    t["layers.0.ffn.shared_experts.w1.input_scale"] = s / 2
    save_file(t, os.path.join(out["nvfp4"], shard), metadata={"format": "pt"})
    return out


def test_w4a4_input_scales_per_format(w4a4_ckpts):
    """Which GEMMs the W4A4 golden rounds, with which scale: our runners' NVFP4 projections (the
    indexer's wq_b of the C4 layers included, never an FP8 projection); one scale per GEMM, the
    max of its members; the compressed-tensors divisor read as its reciprocal."""
    from cutedsl import formats

    s = float(formats.global_scale_from_amax(TM.DEFAULT_INPUT_AMAX))
    cfg = TM.make_config("tiny", "nvfp4", MICRO)
    L = cfg["num_hidden_layers"]
    c4 = [i for i in range(L) if cfg["compress_ratios"][i] == 4]
    assert c4, "the tiny preset has an indexer layer"
    attn = ["q_a_proj", "kv_proj", "q_b_proj", "o_a_proj", "o_b_proj"]
    shared = ["gate_proj", "up_proj", "down_proj"]
    want = {
        "nvfp4": [f"self_attn.{m}" for m in attn] + [f"mlp.shared_experts.{m}" for m in shared]
        + ["mlp.experts"],
        "nvidia-mixed": ["mlp.experts"],
        "ct-nvfp4-fp8": [f"mlp.shared_experts.{m}" for m in shared] + ["mlp.experts"],
    }  # fmt: skip
    indexer = {f"model.layers.{i}.self_attn.compressor.indexer.q_b_proj" for i in c4}
    for fmt, mods in want.items():
        got = G.w4a4_input_scales(w4a4_ckpts[fmt])
        want_fmt = {f"model.layers.{i}.{m}" for i in range(L) for m in mods}
        assert set(got) == want_fmt | (indexer if fmt == "nvfp4" else set()), fmt
        for name, sc in got.items():
            if name.endswith("mlp.experts"):
                assert set(sc) == {"input", "down"}, name
            if not name.startswith("model.layers.0.") or fmt != "nvfp4":
                assert all(v == pytest.approx(s, rel=1e-6) for v in sc.values()), (fmt, name, sc)
    got = G.w4a4_input_scales(w4a4_ckpts["nvfp4"])
    lay = "model.layers.0."
    assert got[lay + "self_attn.q_a_proj"]["input"] == pytest.approx(2 * s, rel=1e-6)
    assert got[lay + "self_attn.kv_proj"]["input"] == pytest.approx(2 * s, rel=1e-6)
    assert got[lay + "mlp.experts"] == pytest.approx({"input": s, "down": 3 * s}, rel=1e-6)
    assert got[lay + "mlp.shared_experts.gate_proj"]["input"] == pytest.approx(s, rel=1e-6)
    assert got[lay + "self_attn.q_b_proj"]["input"] == pytest.approx(s, rel=1e-6)


def test_w4a4_golden_matches_the_w4a4_reference_ops(w4a4_ckpts):
    """The W4A4 golden's modules compute what `cutedsl.reference` states for act="nvfp4" (a
    linear, the routed experts) on fresh random inputs, and differ from the W4A16 statement."""
    from cutedsl import reference as ref
    from cutedsl.tools.checkpoint import Checkpoint

    path = w4a4_ckpts["nvfp4"]
    ck = Checkpoint(path)
    scales = G.w4a4_input_scales(path)
    m = G.load_model(path, act_quant="nvfp4")
    lay = m.model.layers[0]
    g = torch.Generator().manual_seed(3)

    def lin(name):
        return tuple(
            ck.get(f"{name}.{leaf}") for leaf in ("weight", "weight_scale", "weight_scale_2")
        )

    x = torch.randn(9, lay.self_attn.q_b_proj.in_features, generator=g)
    s = scales["model.layers.0.self_attn.q_b_proj"]["input"]
    got = lay.self_attn.q_b_proj(x)
    w4a4 = ref.nvfp4_linear_ref(x, *lin("layers.0.attn.wq_b"), act="nvfp4", input_scale=s)
    w4a16 = ref.nvfp4_linear_ref(x, *lin("layers.0.attn.wq_b"))
    assert torch.allclose(got, w4a4, rtol=1e-5, atol=1e-5 * float(w4a4.abs().max()))
    assert not torch.allclose(got, w4a16, rtol=1e-2, atol=1e-2 * float(w4a16.abs().max()))

    ex = lay.mlp.experts
    E = ex.num_experts
    hid = torch.randn(11, ex.hidden_dim, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(11)])
    wts = torch.rand(11, 2, generator=g)
    got = ex(hid, ids, wts)
    w13 = [torch.cat([ck.get(f"layers.0.ffn.experts.{e}.{w}.{leaf}") for w in ("w1", "w3")])
           for e in range(E) for leaf in ("weight", "weight_scale")]  # fmt: skip
    w13_packed, w13_sf = torch.stack(w13[0::2]), torch.stack(w13[1::2])
    w13_gs = torch.stack([ck.get(f"layers.0.ffn.experts.{e}.w1.weight_scale_2") for e in range(E)])
    w2 = [ck.get(f"layers.0.ffn.experts.{e}.w2.{leaf}") for e in range(E)
          for leaf in ("weight", "weight_scale", "weight_scale_2")]  # fmt: skip
    sc = scales["model.layers.0.mlp.experts"]
    args = (hid, ids, wts, w13_packed, w13_sf, w13_gs, torch.stack(w2[0::3]), torch.stack(w2[1::3]),
            torch.stack(w2[2::3]), ex.limit)  # fmt: skip
    want = ref.nvfp4_moe_ref(*args, act="nvfp4", a13_scale=sc["input"], a2_scale=sc["down"])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    w4a16 = ref.nvfp4_moe_ref(*args)
    assert not torch.allclose(got, w4a16, rtol=1e-2, atol=1e-2 * float(w4a16.abs().max()))


def test_w4a4_golden_cli_and_errors(w4a4_ckpts, ckpts, capsys):
    """`--act-quant nvfp4` runs; a checkpoint without NVFP4 input scales is refused by name."""
    assert G.main([w4a4_ckpts["nvidia-mixed"], "--random", "8", "--act-quant", "nvfp4"]) == 0
    assert "T=8" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no NVFP4 projection with an input scale"):
        G.load_model(ckpts[("native", "native")], act_quant="nvfp4")
    with pytest.raises(ValueError, match="act_quant"):
        G.load_model(w4a4_ckpts["nvfp4"], act_quant="fp8")


def test_w4a4_bad_input_scale_is_named(tmp_path):
    """An input scale that is not one positive value is refused with the tensor and the file."""
    from safetensors.torch import load_file, save_file

    from cutedsl.tools.checkpoint import CheckpointError

    p = str(tmp_path / "bad")
    TM.generate(p, "nvfp4", "native", "tiny", seed=5, overrides=MICRO)
    shard = os.path.join(p, next(f for f in os.listdir(p) if f.endswith(".safetensors")))
    t = load_file(shard)
    t["layers.1.attn.wo_b.input_scale"] = -t["layers.1.attn.wo_b.input_scale"]
    save_file(t, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wo_b\.input_scale: .*positive"):
        G.w4a4_input_scales(p)
