"""The published NVFP4 DeepSeek V4 checkpoint layouts the tiny generator writes and the converter
reads: names, dtypes, shapes, config keys, the index file, the MTP block.

Sources (what each layout in cutedsl/tools/schema.py rests on; "not found" is said where it is so)
-----------------------------------------------------------------------------------------------
nvidia/DeepSeek-V4-Flash-NVFP4, nvidia/DeepSeek-V4-Pro-NVFP4 (format `nvidia-mixed`)
  - Model cards (huggingface.co/nvidia/DeepSeek-V4-Flash-NVFP4, README.md via the search index):
    ModelOpt, base deepseek-ai/DeepSeek-V4-Flash, released 2026-05-28; tags NVFP4 + fp8.
  - The exporter NVIDIA documents for these checkpoints: github.com/NVIDIA/Model-Optimizer,
    examples/deepseek/README.md ("DeepSeek V4 routed-expert NVFP4": only the routed experts are
    NVFP4 W4A4; attention, router gate, shared experts, embeddings and LM head keep their native
    formats) and examples/deepseek/deepseek_v4/quantize_to_nvfp4.py (read at commit a2fbac7):
      * keeps DeepSeek's native names; routed experts matching
        `^layers\\.\\d+\\.ffn\\.experts\\.\\d+\\.w[123]\\.weight$` ("MTP experts remain in source
        format") become `.weight` u8 (out, in//2), `.weight_scale` E4M3 (out, in//16),
        `.weight_scale_2` f32 0-d (= amax / (6*448)), `.input_scale` f32 0-d; the MXFP4 `.scale`
        sibling is dropped; w1/w3 share one weight amax and one input amax;
      * config.json (`_rewrite_config_json`): the source quantization_config (quant_method
        "fp8", activation_scheme, weight_block_size kept) plus quant_algo "MIXED_PRECISION",
        moe_quant_algo "NVFP4", group_size 16, kv_cache_quant_algo null, producer {"name":
        "modelopt", "version": "dsv4-nvfp4-experts"}, config_groups.group_0 (targets ["Linear"],
        weights and input_activations 4-bit float, group 16, static), quantized_layers (one
        `layers.L.ffn.experts` entry per main layer: {"quant_algo": "NVFP4", "group_size": 16})
        and ignore ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"];
      * hf_quant_config.json (`_build_hf_quant_config`): producer as above, "quantization":
        {quant_algo MIXED_PRECISION, kv_cache_quant_algo null, group_size 16, the same
        quantized_layers, exclude_modules = the same 4 patterns};
      * model.safetensors.index.json: the source's, `.scale` keys of converted experts removed,
        the three new keys added.
  - Third-party reads of the published files (quoted in public notes; no Hugging Face file is in
    the search corpora): the HEAD config.json keys above, 43 quantized_layers entries on Flash,
    none for mtp; a header read of model-00046-of-00046.safetensors shows
    `mtp.0.ffn.experts.0.w1.weight` I8 [2048, 2048] with `.scale` F8_E8M0 [2048, 128] (MXFP4 as
    DeepSeek ships it; our native layout writes that weight as u8, the same bytes) and no global
    scales. An earlier revision of the repositories carried per-projection quantized_layers keys
    with `awq_block_size` in hf_quant_config.json (same weights).
    vLLM 0.21.0 reads hf_quant_config.json only when config.json has no quantization_config
    (vllm/transformers_utils/config.py:780-792), so config.json decides: DeepseekV4FP8Config,
    whose MoE layers the overlay gives NVFP4 experts only where quantized_layers names them.
    vllm-project/recipes pull 541 (the NVFP4 variant's guide): "attention, shared experts, router
    head, and MTP stay" in DeepSeek's formats.
  - DeepSeek's own quantization_config (quant_method fp8, activation_scheme dynamic, fmt e4m3,
    scale_fmt ue8m0, weight_block_size [128, 128]) and compress_ratios with one trailing entry
    for the MTP layer: /work/shared/research/vllm021_dsv4.md section 4 and
    canada-quant/dsv4-flash-nvfp4-fp8-mtp vendor/dsv4-upstream/config.json (a copy of
    deepseek-ai/DeepSeek-V4-Flash inference/config.json: n_layers 43, n_hash_layers 3,
    44 compress_ratios ending in 0).

RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 and its MTP variant (format `ct-nvfp4-fp8`)
  - The recipe: github.com/vllm-project/llm-compressor examples/quantizing_moe/
    deepseek_v4_example.py and docs/key-models/deepseek-v4/ (FP8_BLOCK on attention
    q_a/q_b/kv/o_a/o_b projections, NVFP4 on MoE projections; docs/key-models/deepseek-v4/index.md
    names RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 as its pre-quantized checkpoint) and
    fix_dsv4_structure.py (branch commits 92a9f321, 3271745d, 156aa294) renaming HF module names
    to DeepSeek's flat ones.
  - The MTP variant: canada-quant/DeepSeek-V4-Flash-NVFP4-FP8-MTP (model card, and its repository
    github.com/canada-quant/dsv4-flash-nvfp4-fp8-mtp): "same quantization scheme as
    RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8: NVFP4 (group=16, FP8 e4m3 scales) on routed FFN
    experts, FP8_BLOCK 128x128 on attention"; "MTP block (mtp.0.*, 799 tensors) kept at BF16";
    Red Hat's artifact has no mtp.* tensors (transformers' `_keys_to_ignore_on_load_unexpected`
    drops them). Its docs/recipes/nvfp4_fp8_mtp_replication.md section 5 gives the recipe:
    group_0 targets `re:.*attn\\.(wq_a|wq_b|wkv|wo_a|wo_b)$` FP8 block [128, 128], weight only
    (input_activations None, "matches RedHat"), format float-quantized; group_1 targets
    `re:.*ffn\\.experts\\.\\d+\\.(gate_proj|up_proj|down_proj)$` NVFP4 tensor_group 16, input
    activations dynamic "local", format nvfp4-pack-quantized; ignore lm_head, embed_tokens, norms,
    router gate, q_norm, k_norm, `re:.*mtp\\..*` (that recipe's own targets, not Red Hat's: below).
    Its scripts: squeeze_global_scales.py (llm-compressor writes weight_global_scale and
    input_global_scale as shape (1,); the published MTP variant squeezes them to 0-d),
    convert_attn_scales_for_vllm.py ("llm-compressor's FP8_BLOCK preset saves attn .weight_scale
    as bfloat16"), postprocess_for_vllm.py (mtp.0.embed.weight -> mtp.0.emb.tok_emb.weight;
    scale_fmt "ue8m0" injected because Red Hat's config.json has none).
  - Names: "their model.safetensors.index.json uses exactly the flat native names vLLM expects"
    (pasta-paul/dsv4-flash-w4a16-fp8, notes on vLLM PR #41276); compressed-tensors leaves
    weight_packed, weight_scale, weight_global_scale, input_global_scale (a third-party key
    conversion document in the code index lists exactly these for DSv4 experts).
  - Global scales are divisors: vLLM 0.21.0 compressed_tensors/schemes/
    compressed_tensors_w4a4_nvfp4.py process_weights_after_loading takes 1 / weight_global_scale
    and 1 / input_global_scale ("CT stores as divisors").
  - Red Hat's config_groups targets, quoted by three independent third-party readers of its
    config.json: `re:.*attn.*(fused_wqa_wkv|wq_b|wo_a|wo_b)$` (FP8 block) and
    `re:.*ffn.*(gate|up|down)_proj$` (NVFP4): a canada-quant comparison table of its config
    against "RedHat NVFP4-FP8 reference" (group 0 / group 1 target regex rows), an SGLang
    bring-up note (compressed-tensors matching fails on SGLang's `wqkv_a`: "RedHatAI/DeepSeek-V4-
    Flash-NVFP4-FP8 — target fused_wqa_wkv"; no hf_quant_config.json), and ai-dynamo
    aiconfigurator's test of `_infer_quant_modes_from_raw_config` on that raw config. These
    name vLLM's modules: upstream vLLM (which serves the checkpoint on Blackwell) matches
    `model.layers.L.attn.fused_wqa_wkv`, `.attn.wq_b`, `.attn.indexer.wq_b`, `.attn.wo_a`,
    `.attn.wo_b` as FP8 and `.ffn.shared_experts.gate_up_proj` / `.down_proj` plus every routed
    expert's as NVFP4, so those parameters (and the checkpoint's tensors they load) are FP8 /
    NVFP4: indexer.wq_b FP8, shared experts NVFP4 (a pasta-paul/dsv4-flash-w4a16-fp8 note that
    calls them BF16 contradicts the targets; the targets decide what vLLM loads).
  - NOT found: Red Hat's published index file. Unverified: the attention scale dtype (BF16
    assumed), the group_0 input activations (None written, as the recipe above).

MTP block (`num_nextn_predict_layers` >= 1)
  - DeepSeek's inference/model.py `MTPBlock(Block)` (vendored verbatim in
    canada-quant/dsv4-flash-nvfp4-fp8-mtp vendor/dsv4-upstream/model.py): a Block plus e_proj,
    h_proj (Linear dim x dim), enorm, hnorm, norm, hc_head_fn/base/scale (f32), embed and head
    shared with the main model; held in `Transformer.mtp` -> names `mtp.{i}.*`.
  - vLLM 0.21.0 model_executor/models/deepseek_v4_mtp.py: remaps `mtp.{i}.` to
    `model.layers.{num_hidden_layers + i}.`, `.emb.tok_emb.weight` -> embed_tokens,
    `.head.weight` -> shared_head.head, `.norm.weight` -> shared_head.norm, builds the block with
    `DeepseekV4DecoderLayer` (our overlay) and e_proj / h_proj as ReplicatedLinear with the main
    quant config; non-expert `.scale` -> `.weight_scale_inv`.
  - `mtp.{i}.emb.tok_emb.weight` / `mtp.{i}.head.weight` in DeepSeek's own release: inferred
    from vLLM's remap table and canada-quant's rename to that name, NOT verified against
    DeepSeek's index.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from cutedsl import formats as F
from cutedsl.tools import quantize as Q
from cutedsl.tools import tiny_model as TM
from cutedsl.tools.checkpoint import Checkpoint, CheckpointError, read_linear, validate_layout
from cutedsl.tools.schema import NVIDIA_IGNORE, ConfigError, detect_format

MICRO = {
    "hidden_size": 512,
    "n_routed_experts": 8,
    "moe_intermediate_size": 128,
    "vocab_size": 256,
    "num_nextn_predict_layers": 1,
}
LAYERS = 2  # ratios [0, 4] + [0] for the MTP block: SWA + hash MoE, C4 + indexer, MTP (SWA)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for fmt in ("nvidia-mixed", "ct-nvfp4-fp8", "nvfp4"):
        p = str(root / fmt)
        TM.generate(p, fmt, seed=11, overrides=MICRO, layers=LAYERS, tokenizer=False)
        out[fmt] = p
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    idx = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for fn in sorted(set(idx.values())):
        with safe_open(os.path.join(path, fn), "pt") as f:
            for k in f.keys():
                assert idx[k] == fn, k
                out[k] = f.get_tensor(k)
    assert set(out) == set(idx), "index and shards disagree"
    return out


def _meta(t: torch.Tensor) -> tuple[list[int], torch.dtype]:
    return list(t.shape), t.dtype


# ---------------------------------------------------------------------------------------------
# nvidia-mixed


def test_nvidia_config_is_deepseek_fp8_plus_modelopt_keys(ckpts) -> None:
    cfg = json.load(open(os.path.join(ckpts["nvidia-mixed"], "config.json")))
    nvfp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "quant_algo": "MIXED_PRECISION",
        "moe_quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "producer": {"name": "modelopt", "version": "dsv4-nvfp4-experts"},
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": nvfp4, "input_activations": nvfp4}
        },
        "quantized_layers": {
            f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
            for i in range(LAYERS)
        },
        "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"],
    }
    assert cfg["expert_dtype"] == "fp4" and cfg["num_nextn_predict_layers"] == 1
    assert detect_format(cfg) == "nvidia-mixed"


def test_nvidia_hf_quant_config_lists_every_nvfp4_expert_layer(ckpts) -> None:
    hqc = json.load(open(os.path.join(ckpts["nvidia-mixed"], "hf_quant_config.json")))
    cfg = json.load(open(os.path.join(ckpts["nvidia-mixed"], "config.json")))
    assert hqc["producer"] == {"name": "modelopt", "version": "dsv4-nvfp4-experts"}
    q = hqc["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"], q["group_size"]) == (
        "MIXED_PRECISION",
        None,
        16,
    )
    assert q["exclude_modules"] == NVIDIA_IGNORE == cfg["quantization_config"]["ignore"]
    assert q["quantized_layers"] == cfg["quantization_config"]["quantized_layers"]
    # Independent of the schema: the experts' layers that carry an NVFP4 input_scale.
    t = _tensors(ckpts["nvidia-mixed"])
    expected = {
        k.split(".ffn.experts.")[0] + ".ffn.experts" for k in t if k.endswith(".input_scale")
    }
    assert (
        sorted(q["quantized_layers"])
        == sorted(expected)
        == [f"layers.{i}.ffn.experts" for i in range(LAYERS)]
    )


def test_nvidia_experts_nvfp4_mtp_experts_mxfp4_rest_native_fp8(ckpts) -> None:
    t = _tensors(ckpts["nvidia-mixed"])
    H, I = MICRO["hidden_size"], MICRO["moe_intermediate_size"]
    e = "layers.1.ffn.experts.5."
    assert _meta(t[e + "w1.weight"]) == ([I, H // 2], torch.uint8)
    assert _meta(t[e + "w1.weight_scale"]) == ([I, H // 16], torch.float8_e4m3fn)
    assert _meta(t[e + "w2.weight"]) == ([H, I // 2], torch.uint8)
    assert _meta(t[e + "w2.weight_scale"]) == ([H, I // 16], torch.float8_e4m3fn)
    for w in ("w1", "w2", "w3"):
        assert _meta(t[e + f"{w}.weight_scale_2"]) == ([], torch.float32)
        assert _meta(t[e + f"{w}.input_scale"]) == ([], torch.float32)
        assert e + f"{w}.scale" not in t  # the MXFP4 sibling is dropped
    # w1/w3 share one global scale (vLLM's fused w13 keeps one)
    assert torch.equal(t[e + "w1.weight_scale_2"], t[e + "w3.weight_scale_2"])
    # the MTP block's experts: DeepSeek's MXFP4 (e2m1 pairs + e8m0 per 32), no global scales
    m = "mtp.0.ffn.experts.5."
    assert _meta(t[m + "w1.weight"]) == ([I, H // 2], torch.int8)  # I8, as the header read shows
    assert _meta(t[m + "w1.scale"]) == ([I, H // 32], torch.float8_e8m0fnu)
    assert _meta(t[m + "w2.scale"]) == ([H, I // 32], torch.float8_e8m0fnu)
    assert not any(k.startswith(m) and k.endswith(("_scale", "_scale_2")) for k in t)
    # attention and the shared expert: DeepSeek FP8 block, e8m0 scales
    for block in ("layers.1.", "mtp.0."):
        a = f"{block}attn.wq_b"
        assert t[a + ".weight"].dtype == torch.float8_e4m3fn
        assert t[a + ".scale"].dtype == torch.float8_e8m0fnu
        assert t[f"{block}ffn.shared_experts.w2.scale"].dtype == torch.float8_e8m0fnu


def test_mtp_block_names(ckpts) -> None:
    names = set(_tensors(ckpts["nvidia-mixed"]))
    mtp = {n for n in names if n.startswith("mtp.")}
    for m in (
        "e_proj.weight", "e_proj.scale", "h_proj.weight", "h_proj.scale", "enorm.weight",
        "hnorm.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
        "emb.tok_emb.weight", "head.weight", "attn.wq_a.weight", "attn.wo_a.scale",
        "attn.attn_sink", "hc_attn_fn", "hc_ffn_scale", "ffn.gate.weight", "ffn.gate.bias",
    ):  # fmt: skip
        assert f"mtp.0.{m}" in mtp, m
    # compress_ratios[LAYERS] = 0: the MTP block is sliding-window only; index >= num_hash_layers
    assert not any(".compressor." in n or ".indexer." in n or "tid2eid" in n for n in mtp)
    assert not any(n.startswith("mtp.1.") for n in names)


# ---------------------------------------------------------------------------------------------
# compressed-tensors


def test_ct_config_groups(ckpts) -> None:
    qc = json.load(open(os.path.join(ckpts["ct-nvfp4-fp8"], "config.json")))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert g0["format"] == "float-quantized" and g0["input_activations"] is None
    assert g0["weights"]["strategy"] == "block" and g0["weights"]["block_structure"] == [128, 128]
    assert g1["format"] == "nvfp4-pack-quantized"
    assert (g1["weights"]["num_bits"], g1["weights"]["group_size"]) == (4, 16)
    assert g1["input_activations"]["dynamic"] == "local"
    # Red Hat's targets name vLLM's modules (fused_wqa_wkv) and match the shared experts too
    assert g0["targets"] == ["re:.*attn.*(fused_wqa_wkv|wq_b|wo_a|wo_b)$"]
    assert g1["targets"] == ["re:.*ffn.*(gate|up|down)_proj$"]
    assert r"re:.*mtp\..*" in qc["ignore"]
    assert "scale_fmt" not in qc  # Red Hat's config has none (pristine vLLM: KeyError)
    assert detect_format({"quantization_config": qc}) == "ct-nvfp4-fp8"
    qc2 = {**qc, "config_groups": {"group_0": g0}}
    with pytest.raises(ConfigError, match="nvfp4-pack-quantized"):
        detect_format({"quantization_config": qc2})


def test_ct_tensors_and_inverse_global_scale(ckpts) -> None:
    """Same seed, same masters: the compressed-tensors experts are ModelOpt's codes with the
    reciprocal global scales (compressed-tensors stores divisors)."""
    ct, mo = _tensors(ckpts["ct-nvfp4-fp8"]), _tensors(ckpts["nvfp4"])
    H, I = MICRO["hidden_size"], MICRO["moe_intermediate_size"]
    e = "layers.0.ffn.experts.3.w1."
    assert _meta(ct[e + "weight_packed"]) == ([I, H // 2], torch.uint8)
    assert _meta(ct[e + "weight_scale"]) == ([I, H // 16], torch.float8_e4m3fn)
    assert _meta(ct[e + "weight_global_scale"]) == ([1], torch.float32)
    assert _meta(ct[e + "input_global_scale"]) == ([1], torch.float32)
    assert e + "weight" not in ct and e + "weight_scale_2" not in ct
    assert torch.equal(ct[e + "weight_packed"], mo[e + "weight"])
    assert torch.equal(
        ct[e + "weight_scale"].view(torch.uint8), mo[e + "weight_scale"].view(torch.uint8)
    )
    prod = float(ct[e + "weight_global_scale"].double() * mo[e + "weight_scale_2"].double())
    assert abs(prod - 1.0) < 1e-6, prod
    prod = float(ct[e + "input_global_scale"].double() * mo[e + "input_scale"].double())
    assert abs(prod - 1.0) < 1e-6, prod
    # attention and indexer.wq_b: FP8 block weight + BF16 block scale
    for a in ("layers.1.attn.wo_a.", "layers.1.attn.indexer.wq_b."):
        n, k = ct[a + "weight"].shape
        assert ct[a + "weight"].dtype == torch.float8_e4m3fn, a
        assert _meta(ct[a + "weight_scale"]) == ([-(-n // 128), -(-k // 128)], torch.bfloat16), a
    # shared experts: NVFP4 like the routed ones, ModelOpt's codes
    for se in ("layers.1.ffn.shared_experts.w1.", "layers.1.ffn.shared_experts.w2."):
        assert se + "weight" not in ct, se
        assert torch.equal(ct[se + "weight_packed"], mo[se + "weight"]), se
        assert _meta(ct[se + "weight_global_scale"]) == ([1], torch.float32), se
    # the rest of the attention block and the router: BF16
    for b in ("layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.compressor.wkv.weight",
              "layers.1.ffn.gate.weight"):  # fmt: skip
        assert ct[b].dtype == torch.bfloat16, b
    # the MTP block: all BF16, no quantization tensor (canada-quant's "Option Y" invariant)
    mtp = {n: v for n, v in ct.items() if n.startswith("mtp.")}
    quant_leaves = (".weight_scale", ".weight_packed", ".scale", "_global_scale", ".input_scale")
    assert mtp and not any(n.endswith(quant_leaves) for n in mtp)
    assert mtp["mtp.0.ffn.experts.0.w2.weight"].dtype == torch.bfloat16
    assert mtp["mtp.0.e_proj.weight"].dtype == torch.bfloat16


def test_ct_dequantizes_to_the_same_weights_as_modelopt(ckpts) -> None:
    ct, mo = Checkpoint(ckpts["ct-nvfp4-fp8"]), Checkpoint(ckpts["nvfp4"])
    n = "layers.1.ffn.experts.6.w2"
    a, b = read_linear(ct, n), read_linear(mo, n)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    # and by hand: e2m1 * block scale / global scale
    t = _tensors(ckpts["ct-nvfp4-fp8"])
    vals = F.decode_e2m1(F.unpack_e2m1(t[n + ".weight_packed"]))
    sf = t[n + ".weight_scale"].float().repeat_interleave(16, dim=1)
    ref = vals * sf / t[n + ".weight_global_scale"].float()
    torch.testing.assert_close(a, ref, rtol=1e-6, atol=0)


def test_ct_global_scale_of_shape_zero_d_is_read(ckpts, tmp_path) -> None:
    """llm-compressor writes (1,)-shaped global scales; canada-quant's MTP variant squeezes them
    to 0-d (squeeze_global_scales.py): both read the same."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "ct1"
    shutil.copytree(ckpts["ct-nvfp4-fp8"], src)
    idx = json.load(open(src / "model.safetensors.index.json"))["weight_map"]
    for fn in set(idx.values()):
        t = {}
        with safe_open(str(src / fn), "pt") as f:
            for k in f.keys():
                v = f.get_tensor(k)
                t[k] = v.reshape(()) if k.endswith("_global_scale") else v
        save_file(t, str(src / fn), metadata={"format": "pt"})
    assert validate_layout(Checkpoint(str(src)), "ct-nvfp4-fp8") == []
    n = "layers.0.ffn.experts.1.w3"
    torch.testing.assert_close(
        read_linear(Checkpoint(str(src), validate=True), n),
        read_linear(Checkpoint(ckpts["ct-nvfp4-fp8"]), n),
        rtol=0,
        atol=0,
    )


def test_ct_global_scales_must_be_one_positive_value(ckpts, tmp_path) -> None:
    """A zero weight global scale or a negative input global scale is refused naming the tensor
    and its file, not dequantized into infinities."""
    import shutil

    from safetensors.torch import save_file

    from cutedsl.tools.checkpoint import read_input_scale

    src = tmp_path / "ct0"
    shutil.copytree(ckpts["ct-nvfp4-fp8"], src)
    n = "layers.0.ffn.experts.1.w3"
    idx = json.load(open(src / "model.safetensors.index.json"))["weight_map"]
    fn = idx[f"{n}.weight_global_scale"]
    with safe_open(str(src / fn), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t[f"{n}.weight_global_scale"] = torch.zeros_like(t[f"{n}.weight_global_scale"])
    t[f"{n}.input_global_scale"] = -t[f"{n}.input_global_scale"]
    save_file(t, str(src / fn), metadata={"format": "pt"})
    ck = Checkpoint(str(src))
    with pytest.raises(CheckpointError, match=rf"{n}\.weight_global_scale: .*positive.*{fn}"):
        read_linear(ck, n)
    with pytest.raises(CheckpointError, match=rf"{n}\.input_global_scale: .*positive.*{fn}"):
        read_input_scale(ck, n)
    good = read_input_scale(Checkpoint(ckpts["ct-nvfp4-fp8"]), n)  # the reciprocal of the divisor
    assert good is not None and good.ndim == 0 and float(good) > 0


def test_mxfp4_expert_bytes_read_the_same_as_i8_or_u8(tmp_path) -> None:
    """DeepSeek ships its MXFP4 expert bytes as I8 (the generator writes that); the same bytes
    stored as U8 validate, dequantize and convert identically."""
    import shutil

    from safetensors.torch import save_file

    i8, u8 = str(tmp_path / "i8"), tmp_path / "u8"
    TM.generate(i8, "native", seed=11, overrides=MICRO, layers=LAYERS, tokenizer=False)
    shutil.copytree(i8, u8)
    for fn in set(json.load(open(u8 / "model.safetensors.index.json"))["weight_map"].values()):
        with safe_open(str(u8 / fn), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        t = {k: v.view(torch.uint8) if v.dtype == torch.int8 else v for k, v in t.items()}
        save_file(t, str(u8 / fn), metadata={"format": "pt"})
    n = "layers.1.ffn.experts.4.w1"
    assert _tensors(i8)[n + ".weight"].dtype == torch.int8
    assert _tensors(str(u8))[n + ".weight"].dtype == torch.uint8
    a, b = Checkpoint(i8), Checkpoint(str(u8))
    assert validate_layout(a, "native") == validate_layout(b, "native")
    wa = read_linear(a, n)
    assert torch.equal(wa, read_linear(b, n)) and wa.abs().sum() > 0
    qa, qb = str(tmp_path / "qa"), str(tmp_path / "qb")
    Q.convert(i8, qa), Q.convert(str(u8), qb)
    ta, tb = _tensors(qa), _tensors(qb)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert (
            torch.equal(ta[k], tb[k])
            if ta[k].dim() == 0
            else torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))
        ), k


# ---------------------------------------------------------------------------------------------
# The converter


@pytest.mark.parametrize("fmt", ["ct-nvfp4-fp8", "nvidia-mixed"])
def test_convert_to_full_nvfp4(ckpts, tmp_path, fmt: str) -> None:
    out = str(tmp_path / "q")
    cfg = Q.convert(ckpts[fmt], out)
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    dst, src = Checkpoint(out), Checkpoint(ckpts[fmt])
    assert validate_layout(dst, "nvfp4") == []
    ref = _tensors(ckpts["nvfp4"])
    got = _tensors(out)
    assert set(got) == set(ref)  # the full-NVFP4 layout, MTP block included
    for k, v in ref.items():
        assert _meta(got[k]) == _meta(v), k
    # NVFP4 experts are carried over code for code (no re-quantization)
    e = "layers.1.ffn.experts.2.w3"
    assert torch.equal(got[e + ".weight"], ref[e + ".weight"])
    torch.testing.assert_close(read_linear(dst, e), read_linear(src, e), rtol=1e-6, atol=0)
    # re-quantized projections stay close to their source (NVFP4 error); the MTP block's experts
    # are MXFP4 (nvidia-mixed) or BF16 (ct-nvfp4-fp8) in the source
    requantized = ["layers.0.attn.wq_b", "mtp.0.h_proj", "mtp.0.ffn.experts.0.w2"]
    for n in requantized:
        a, b = read_linear(src, n), read_linear(dst, n)
        rel = float((a - b).norm() / a.norm())
        assert 0.01 < rel < 0.15, (n, rel)


def test_convert_checkpoint_without_its_mtp_block(ckpts, tmp_path) -> None:
    """Red Hat's checkpoint declares the MTP layer but ships no mtp.* tensor."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "nomtp"
    shutil.copytree(ckpts["ct-nvfp4-fp8"], src)
    ipath = src / "model.safetensors.index.json"
    idx = json.load(open(ipath))
    for fn in set(idx["weight_map"].values()):
        with safe_open(str(src / fn), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")}
        save_file(t, str(src / fn), metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith("mtp.")}
    json.dump(idx, open(ipath, "w"))
    out = str(tmp_path / "q")
    Q.convert(str(src), out)
    assert not any(n.startswith("mtp.") for n in Checkpoint(out).names())
    # a partial block is named, not silently dropped
    fn = sorted(set(idx["weight_map"].values()))[0]
    with safe_open(str(src / fn), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["mtp.0.enorm.weight"] = torch.ones(MICRO["hidden_size"], dtype=torch.bfloat16)
    save_file(t, str(src / fn), metadata={"format": "pt"})
    idx["weight_map"]["mtp.0.enorm.weight"] = fn
    json.dump(idx, open(ipath, "w"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\."):
        Q.convert(str(src), str(tmp_path / "q2"))
