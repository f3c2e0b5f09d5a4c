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
