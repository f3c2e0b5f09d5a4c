"""The overlaid DSv4 model on the real pinned vLLM 0.21.0, on CPU: build, load, dispatch, adapters.

A subprocess (`python tests/test_vllm_integration.py --harness OUT.json --workdir DIR`, about a
minute on 2 cores) generates tiny checkpoints of every format with `cutedsl.tools.tiny_model`,
builds `DeepseekV4ForCausalLM` from each (the overlay installed by apply_patches.sh), loads the
checkpoint, post-processes our layers with the runners' reference backend and checks them against
torch math written here from the checkpoint tensors; the tests below assert on its JSON report.
A second one (`--pristine`) builds the FP8 checkpoints with upstream's own two files (imported
from the pristine copies) for an exact comparison.
A subprocess because vLLM binds `current_platform` at import time: the harness must pick the CPU
platform before anything imports vLLM.

Test-only shims in the harness, none in vLLM or cutedsl code (this box has no GPU and no vllm._C):
  - `current_platform` = vLLM's `CpuPlatform` (the venv's vLLM is a CUDA build);
  - `torch.cuda.Stream` / `torch.cuda.Event` stand-ins (DeepseekV4Model makes 3 aux streams, the
    attention wrapper 4 events, at construction);
  - `CpuPlatform.get_device_capability` = (9, 0) during construction (the wrapper asserts a CUDA
    capability to pick its fp8_einsum recipe);
  - `vllm.model_executor.layers.mhc` imported with `is_cuda_alike` True (it decorates TileLang
    kernels at import; nothing is compiled);
  - FP8 / MXFP4 formats only: `CPUFp8BlockScaledMMKernel.is_supported` True (needs AMX here) and
    the DSv4 MXFP4 MoE backend = MARLIN (what the H200 picks) so upstream's own methods can be
    constructed; their weights are loaded but not post-processed (that needs vllm._C);
  - `--pristine` only: a meta-path finder importing the two DSv4 modules from
    <vllm>/.cutedsl_pristine/.
Not testable here: forward passes through vLLM ops (attention, mHC, router top-k: vllm._C /
TileLang / DeepGEMM), the sm90/sm100 backends, CUDA graphs and torch.compile of the model.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Small but complete: layer 0 = SWA + hash MoE, 1 = C4 + indexer + hash MoE, 2 = C128 + scored MoE.
TINY = {"hidden_size": 1024, "n_routed_experts": 8, "num_experts_per_tok": 4}
LAYERS = 3
CASES = (
    "nvfp4/native",
    "nvfp4/hf",
    "nvidia-mixed/native",
    "ct-nvfp4-fp8/native",
    "native/native",
    "bf16/native",
)
BROKEN = (
    "nvfp4/native:missing",
    "nvfp4/native:badshape",
    "nvfp4/native:marlin",
    "ct-nvfp4-fp8/native:chanattn",  # a compressed-tensors scheme not served: refused
)
# The runners on the sm90 backend with the kernel launch emulated in torch (tests/nvfp4_data.py):
# what a GPU load leaves in the layers (the checkpoint-layout weights released).
SM90_EMU = "nvfp4/native:sm90emu"
# The sm100-emulated backend (CUTEDSL_BACKEND=sm100-emulated: the sm100 host path, W4A4, each kernel
# launch its torch statement) inside the same layers, against W4A4 math: the ModelOpt and the
# compressed-tensors (inverse global-scale convention) layouts.
SM100_EMU = ("nvfp4/native:sm100emu", "ct-nvfp4-fp8/native:sm100emu")
PRISTINE_CASES = ("native/native", "nvidia-mixed/native")
# vLLM 0.21.0's MTP draft model (deepseek_v4_mtp.py, whose block is our overlaid
# DeepseekV4DecoderLayer) on a checkpoint with num_nextn_predict_layers = 1, per MTP block format.
MTP_CASES = ("mtp:nvfp4", "mtp:nvidia-mixed", "mtp:ct-nvfp4-fp8", "mtp:native", "mtp:bf16")
# Created by upstream vLLM, absent from DeepSeek's checkpoints and never used in forward
# (research/vllm021_dsv4.md §1.1): not expected to be filled.
UNLOADED_UPSTREAM = (".indexer.k_norm.",)


# ---------------------------------------------------------------------------------------------
# The harness (runs in the subprocess)
# ---------------------------------------------------------------------------------------------


class _FakeCudaObject:
    def __init__(self, *args, **kwargs) -> None:
        pass


def _setup_cpu_vllm():
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if platforms._current_platform is not None:
        raise RuntimeError(f"vLLM platform already resolved: {platforms._current_platform}")
    platforms._current_platform = CpuPlatform()
    from unittest import mock

    with mock.patch.object(CpuPlatform, "is_cuda_alike", classmethod(lambda cls: True)):
        import vllm.model_executor.layers.mhc  # noqa: F401
    return CpuPlatform


def _construction_shims(fmt: str):
    from contextlib import ExitStack
    from unittest import mock

    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as mxfp4_oracle
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import DeviceCapability

    stack = ExitStack()
    stack.enter_context(mock.patch("torch.cuda.Stream", _FakeCudaObject))
    stack.enter_context(mock.patch("torch.cuda.Event", _FakeCudaObject))
    stack.enter_context(
        mock.patch.object(
            CpuPlatform,
            "get_device_capability",
            classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)),
        )
    )
    if fmt in ("native", "nvidia-mixed", "ct-nvfp4-fp8"):
        stack.enter_context(
            mock.patch.object(
                CPUFp8BlockScaledMMKernel,
                "is_supported",
                classmethod(lambda cls, compute_capability=None: (True, None)),
            )
        )
        marlin = mxfp4_oracle.Mxfp4MoeBackend.MARLIN
        stack.enter_context(
            mock.patch(
                "vllm.model_executor.layers.quantization.mxfp4."
                "select_deepseek_v4_mxfp4_moe_backend",
                lambda cfg: (marlin, mxfp4_oracle.backend_to_kernel_cls(marlin)[0]),
            )
        )
    return stack


def _vllm_config(ckpt: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        **kwargs,
        model=ckpt,
        skip_tokenizer_init=True,
        kv_cache_dtype="fp8",
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        dtype="bfloat16",  # as on the GPU (on the CPU platform "auto" may pick float32)
    ).create_engine_config()


def _init_distributed(vc, tmp: str) -> None:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(
        world_size=1, rank=0, local_rank=0,
        distributed_init_method=f"file://{tmp}/dist", backend="gloo",
    )  # fmt: skip
    ps.initialize_model_parallel(1, 1)
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))  # as the worker does; the MoE kernel uses it


def _poison(model) -> None:
    """Fill every parameter's bytes with 0xFF (NaN for every float dtype, -1 for ints)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            assert p.data.is_contiguous(), name
            p.data.view(torch.uint8).fill_(0xFF)


def _unfilled(model, n_heads: int) -> list[str]:
    """Parameters with a row (last dim) still all 0xFF bytes after loading."""
    import torch

    bad = []
    for name, p in model.named_parameters():
        if any(s in name for s in UNLOADED_UPSTREAM):
            continue
        t = p.data
        if name.endswith("attn_sink"):
            t = t[:n_heads]  # padded to 64 heads with -inf, by design
        b = t.contiguous().view(torch.uint8)
        b = b.reshape(-1, b.shape[-1]) if b.ndim else b.reshape(1, 1)
        if bool((b == 0xFF).all(dim=-1).any()):
            bad.append(name)
    return bad


def _method_names(model) -> dict[str, str]:
    out = {}
    for name, mod in model.named_modules():
        if ".layers." in name and not any(f".layers.{i}." in name for i in range(LAYERS)):
            continue
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        desc = type(qm).__name__
        kernel = getattr(qm, "kernel", None)
        if kernel is not None:
            desc += "/" + type(kernel).__name__
        out[name] = desc
    return out


def _ckpt_tensors(ckpt: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(f"{ckpt}/*.safetensors")):
        out.update(load_file(f))
    return out


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _deq(ck: dict):
    import torch

    from cutedsl import formats

    def deq(name: str) -> torch.Tensor:  # native module name -> fp32 [N, K]
        return formats.dequantize_nvfp4(
            ck[f"{name}.weight"], ck[f"{name}.weight_scale"], ck[f"{name}.weight_scale_2"],
            dtype=torch.float32,
        )  # fmt: skip

    return deq


def _acts(ck: dict, w4a4: bool):
    """act(x, *gemm_members) -> what that GEMM multiplies, fp32: x itself (W4A16), or with `w4a4`
    (the sm100 backend) x rounded to NVFP4 along its last dim by vLLM's own reference quantizer
    (`ref_nvfp4_quant_dequant`, blocks of 16) under the GEMM's static input scale: the max of its
    members' checkpoint `input_scale` (the dequantization multiplier; vLLM quantizes with its
    reciprocal). vLLM's quantizer, not `cutedsl.formats`: the emulated sm100 kernels round with
    the latter, so the reference must not."""
    import torch

    def act(x, *members: str):
        x = x.float()
        if not w4a4:
            return x
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            ref_nvfp4_quant_dequant,
        )

        s = max(float(ck[f"{m}.input_scale"]) for m in members)
        gs = torch.tensor(1.0 / s, dtype=torch.float32)
        return ref_nvfp4_quant_dequant(x.reshape(-1, x.shape[-1]), gs, 16).reshape(x.shape)

    return act


def _mlp_ref(x, w1, w3, w2, limit, act13=None, act2=None):
    """The clamped SwiGLU MLP in fp32; act13 / act2 (W4A4): round the inputs of the two GEMMs
    (h first rounded to bf16, as the fused w13 epilogue writes it)."""
    import torch.nn.functional as F

    x = x.float() if act13 is None else act13(x)
    h, u = x @ w1.T, x @ w3.T
    if limit is not None:
        h, u = h.clamp(max=limit), u.clamp(-limit, limit)
    h = F.silu(h) * u
    return (h if act2 is None else act2(h.bfloat16())) @ w2.T


def _moe_numerics(model, ck: dict, cfg: dict, w4a4: bool = False) -> dict:
    """Routed experts of a hash-routed (0) and a score-routed (2) layer, through the FusedMoE
    method -> vLLM's modular kernel (prepare / CuTeDSLMoEExperts / finalize), vs torch math
    (`w4a4`: with NVFP4 activations, `_acts`)."""
    import torch

    deq, g, res = _deq(ck), torch.Generator().manual_seed(2), {}
    act = _acts(ck, w4a4)
    H, L, layers = cfg["hidden_size"], cfg["swiglu_limit"], model.model.layers
    # Routed experts of a hash-routed (0) and a score-routed (2) layer, through the FusedMoE
    # method -> vLLM's modular kernel (prepare / CuTeDSLMoEExperts / finalize).
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for li in (0, 2):
        xm = (8 * torch.randn(9, H, generator=g)).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(9)]).int()
        wts = torch.rand(9, k, generator=g)
        exp_mod = layers[li].ffn.experts
        out = exp_mod.quant_method.apply(exp_mod, xm, wts, ids, None)
        ref = torch.zeros(9, H)
        ref_nc = torch.zeros(9, H)
        # one scale per GEMM over every expert (the max, as vLLM keeps it)
        experts = [f"layers.{li}.ffn.experts.{e}" for e in range(E)]
        w13 = tuple(f"{p}.{n}" for p in experts for n in ("w1", "w3"))
        w2 = tuple(f"{p}.w2" for p in experts)
        acts = (lambda x, m=w13: act(x, *m), lambda h, m=w2: act(h, *m)) if w4a4 else (None, None)
        for e, p in enumerate(experts):
            we = [deq(f"{p}.{n}") for n in ("w1", "w3", "w2")]
            sel = ids == e
            rows = sel.any(dim=1)
            if rows.any():
                wsum = (wts * sel).sum(dim=1)[rows, None]
                ref[rows] += wsum * _mlp_ref(xm[rows], *we, L, *acts)
                ref_nc[rows] += wsum * _mlp_ref(xm[rows], *we, None, *acts)
        res[f"moe_layer{li}"] = _rel(out, ref)
        res[f"moe_layer{li}_vs_unclamped"] = _rel(out, ref_nc)
        res[f"moe_layer{li}_nan"] = float(out.float().isnan().any())
    return res


def _numerics(model, ck: dict, cfg: dict, w4a4: bool = False) -> dict:
    """Our adapters vs torch math on the dequantized checkpoint tensors (`w4a4`: each GEMM's
    input rounded to NVFP4 as the sm100 backend does, `_acts`)."""
    import torch

    from cutedsl.vllm.oproj import nvfp4_oproj

    deq, act = _deq(ck), _acts(ck, w4a4)

    g = torch.Generator().manual_seed(1)
    H, NH, G, R = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["o_groups"],
        cfg["o_lora_rank"],
    )
    res: dict[str, float] = {}
    layers = model.model.layers

    # Attention projections, through vLLM's LinearBase.forward -> our kernel.
    x = torch.randn(7, H, generator=g).bfloat16()
    attn = layers[1].attn
    y, _ = attn.fused_wqa_wkv(x)
    w = torch.cat([deq("layers.1.attn.wq_a"), deq("layers.1.attn.wkv")])
    res["fused_wqa_wkv"] = _rel(y, act(x, "layers.1.attn.wq_a", "layers.1.attn.wkv") @ w.T)
    qr = torch.randn(5, cfg["q_lora_rank"], generator=g).bfloat16()
    res["wq_b"] = _rel(attn.wq_b(qr), act(qr, "layers.1.attn.wq_b") @ deq("layers.1.attn.wq_b").T)
    iq, _ = attn.indexer.wq_b(qr)
    iw = "layers.1.attn.indexer.wq_b"
    res["indexer.wq_b"] = _rel(iq, act(qr, iw) @ deq(iw).T)
    z = torch.randn(5, G * R, generator=g).bfloat16()
    res["wo_b"] = _rel(attn.wo_b(z), act(z, "layers.1.attn.wo_b") @ deq("layers.1.attn.wo_b").T)

    # wo_a: inverse RoPE (GPT-J pairs in the last 64 dims, conjugate rotation) -> grouped GEMM.
    T = 6
    o = torch.randn(T, NH, 512, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (T,), generator=g)
    cache = attn.rotary_emb.cos_sin_cache
    res["cos_sin_cache_is_f32"] = float(cache.dtype == torch.float32)
    cos, sin = cache[pos].float().chunk(2, dim=-1)  # [T, 32] each
    rope = o[..., 448:].float().unflatten(-1, (32, 2))
    y0, y1 = rope[..., 0], rope[..., 1]
    c, s = cos[:, None], sin[:, None]
    unrot = torch.stack([y0 * c + y1 * s, y1 * c - y0 * s], dim=-1).flatten(-2)
    xo = torch.cat([o[..., :448].float(), unrot], dim=-1).bfloat16().view(T, G, -1)
    xo = act(xo, "layers.1.attn.wo_a")  # each group's D-long row rounded on its own
    wa = deq("layers.1.attn.wo_a").view(G, R, -1)
    z_exp = torch.einsum("tgd,grd->tgr", xo, wa)
    z = nvfp4_oproj(attn.wo_a, o, pos, cache)
    res["wo_a"] = _rel(z, z_exp)
    res["wo_a_vs_no_inverse_rope"] = _rel(
        z, torch.einsum("tgd,grd->tgr", o.float().view(T, G, -1), wa)
    )

    res.update(_shared_mlp_numerics(model, ck, cfg, g, w4a4))
    res.update(_moe_numerics(model, ck, cfg, w4a4))

    return res


def _shared_mlp_numerics(model, ck: dict, cfg: dict, g, w4a4: bool = False) -> dict:
    """The shared expert (clamped SwiGLU), through DeepseekV4MLP.forward -> our fused runner."""
    import torch

    deq, H, L, act = _deq(ck), cfg["hidden_size"], cfg["swiglu_limit"], _acts(ck, w4a4)
    xs = (8 * torch.randn(9, H, generator=g)).bfloat16()  # |gate|, |up| often > 10: clamp bites
    se = "layers.0.ffn.shared_experts"
    sw = [deq(f"{se}.{n}") for n in ("w1", "w3", "w2")]
    acts = (lambda x: act(x, f"{se}.w1", f"{se}.w3"), lambda h: act(h, f"{se}.w2"))
    acts = acts if w4a4 else (None, None)
    ys = model.model.layers[0].ffn.shared_experts(xs)
    return {
        "shared_mlp": _rel(ys, _mlp_ref(xs, *sw, L, *acts)),
        "shared_mlp_vs_unclamped": _rel(ys, _mlp_ref(xs, *sw, None, *acts)),
    }


# Tensors the broken-checkpoint variants drop or reshape.
DROPPED = ("layers.1.attn.wo_a.weight_scale", "layers.2.ffn.experts.3.w3.weight_scale_2")
RESHAPED = "layers.1.attn.wq_b.weight"


@contextlib.contextmanager
def _variant_backend(variant: str):
    """The backend the runners built and called inside use: sm90 with its launch emulated
    (`sm90emu`), sm100-emulated (`sm100emu`), else the harness's (reference)."""
    if variant != "sm100emu":
        with _sm90_emulated(variant == "sm90emu"):
            yield
        return
    from unittest import mock

    with mock.patch.dict(os.environ, {"CUTEDSL_BACKEND": "sm100-emulated"}):
        yield


@contextlib.contextmanager
def _sm90_emulated(on: bool):
    """Runners built inside pick the sm90 backend, whose kernel launch is a torch statement of its
    contract (tests/nvfp4_data.py) and whose warm-up compiles nothing."""
    if not on:
        yield
        return
    import cutedsl.runner
    from cutedsl.sm90 import gemm, runners, tactics

    sys.path.insert(0, str(REPO / "tests"))
    from nvfp4_data import sm90_launch_emulator

    h200 = tactics.GpuSpec("NVIDIA H200", 132)
    saved = (cutedsl.runner.select_backend, gemm.precompile, gemm._launch, runners.gpu_spec)
    cutedsl.runner.select_backend = lambda device, backend: "sm90"
    gemm.precompile, gemm._launch = (lambda tactics: None), sm90_launch_emulator()
    runners.gpu_spec = lambda device: h200
    try:
        yield
    finally:
        cutedsl.runner.select_backend, gemm.precompile, gemm._launch, runners.gpu_spec = saved


def _broken_load(model, weights, variant: str) -> dict:
    if variant == "missing":
        weights = ((n, t) for n, t in weights if n not in DROPPED)
    elif variant == "badshape":
        weights = ((n, t[:-16] if n == RESHAPED else t) for n, t in weights)
    else:
        raise ValueError(variant)
    try:
        model.load_weights(weights)
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    return {"raised": None}


def _prewarm_vs_prefetch(model, cfg: dict, max_tokens: int) -> dict:
    """The kernels dsv4-prewarm-kernels lists from config.json vs those the engine's prefetch
    lists from the built model (both on an H200's sm90 backend), as disk-cache keys."""
    from unittest import mock

    from cutedsl import jit
    from cutedsl.sm90 import tactics
    from cutedsl.tools import prewarm_kernels
    from cutedsl.vllm import prefetch

    h200 = tactics.GpuSpec("NVIDIA H200", 132)

    def keys(jobs) -> list[str]:
        return sorted({json.dumps(jit.disk_key(j.build, j.args, dict(j.kwargs))) for j in jobs})

    with mock.patch.object(prefetch, "select_backend", lambda device: "sm90"), \
            mock.patch.object(tactics, "gpu_spec", lambda device: h200):  # fmt: skip
        engine = keys(prefetch.kernel_jobs(model))
    tool = keys(prewarm_kernels.kernel_jobs(cfg, max_tokens, h200))
    return {"engine": len(engine), "tool": len(tool), "equal": engine == tool,
            "only_engine": [k for k in engine if k not in tool][:3],
            "only_tool": [k for k in tool if k not in engine][:3]}  # fmt: skip


def _ct_as_modelopt(ck: dict) -> dict:
    """compressed-tensors NVFP4 tensors under ModelOpt's names and conventions, written here
    from the format's definition (global scales are divisors), for the dequantized math."""
    out = {}
    for k, v in ck.items():
        head, _, leaf = k.rpartition(".")
        if leaf == "weight_packed":
            out[f"{head}.weight"] = v
        elif leaf in ("weight_global_scale", "input_global_scale"):
            new = "weight_scale_2" if leaf == "weight_global_scale" else "input_scale"
            out[f"{head}.{new}"] = v.float().reciprocal().reshape(())
        else:
            out[k] = v
    return out


def _ct_fp8_scales_exact(model, ck: dict) -> dict:
    """Per FP8 linear: its loaded block scales equal the checkpoint's BF16 ones (fused_wqa_wkv:
    wq_a's rows, then wkv's)."""
    import torch

    res = {}
    for li in range(LAYERS):
        a = model.model.layers[li].attn
        for mod, parts in (("fused_wqa_wkv", ("wq_a", "wkv")), ("wq_b", ("wq_b",)),
                           ("wo_a", ("wo_a",)), ("wo_b", ("wo_b",)),
                           ("indexer.wq_b", ("indexer.wq_b",))):  # fmt: skip
            if mod.startswith("indexer.") and getattr(a, "indexer", None) is None:
                continue  # only the C4 layers have an indexer
            got = a.get_submodule(mod).weight_scale_inv.data.float()
            want = torch.cat([ck[f"layers.{li}.attn.{p}.weight_scale"].float() for p in parts])
            res[f"layers.{li}.attn.{mod}"] = bool(
                got.dtype == torch.float32 and torch.equal(got, want)
            )
    return res


def _run_mtp_case(fmt: str, tmp: str) -> dict:
    """Build DeepSeekV4MTP from an MTP-bearing checkpoint, load it, report methods and fill."""
    from unittest import mock

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.platforms.interface import PlatformEnum
    from vllm.utils.torch_utils import set_default_torch_dtype

    from cutedsl.tools import tiny_model

    ckpt = f"{tmp}/mtp-{fmt}"
    if os.path.exists(ckpt):
        cfg = json.load(open(f"{ckpt}/config.json"))
    else:
        overrides = {**TINY, "num_nextn_predict_layers": 1}
        cfg = tiny_model.generate(ckpt, fmt, overrides=overrides, layers=LAYERS, tokenizer=False)
    vc = _vllm_config(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    rep: dict = {"quant_config": type(vc.quant_config).__name__}
    # e_proj / h_proj are built by deepseek_v4_mtp.py (not overlaid) with upstream's NVFP4
    # linear method; its kernel list has no CPU entry: vLLM's emulation kernel stands in.
    cpu_nvfp4 = mock.patch.dict(
        linear_kernels._POSSIBLE_NVFP4_KERNELS,
        {PlatformEnum.CPU: [linear_kernels.EmulationNvFp4LinearKernel]},
    )
    with set_current_vllm_config(vc):
        _init_distributed(vc, tmp)
        from vllm.model_executor.models.deepseek_v4_mtp import DeepSeekV4MTP

        shims = _construction_shims("native" if fmt == "nvidia-mixed" else fmt)
        with shims, cpu_nvfp4, set_default_torch_dtype(vc.model_config.dtype):
            with torch.device("cpu"):
                model = DeepSeekV4MTP(vllm_config=vc, prefix="")
        rep["methods"] = {
            n: type(m.quant_method).__name__
            for n, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None
        }
        rep["block_types"] = sorted(
            {type(lyr.mtp_block).__name__ for lyr in model.model.layers.values()}
        )
        _poison(model)
        files = sorted(glob.glob(f"{ckpt}/*.safetensors"))
        loaded = model.load_weights(safetensors_weights_iterator(files, False))
        rep["n_loaded"] = len(loaded)
        rep["n_mtp_tensors"] = sum(1 for n in _ckpt_tensors(ckpt) if n.startswith("mtp."))
        # embed_tokens: shared with the target model at load time by vLLM's proposer
        rep["unfilled"] = [
            n
            for n in _unfilled(model, cfg["num_attention_heads"])
            if not n.startswith("model.embed_tokens.")
        ]
        rep["not_loaded"] = sorted(
            n
            for n, _ in model.named_parameters()
            if n not in loaded and not any(s in n for s in UNLOADED_UPSTREAM)
        )
    return rep


def _run_case(case: str, tmp: str) -> dict:
    import torch

    if case.startswith("mtp:"):
        return _run_mtp_case(case.removeprefix("mtp:"), tmp)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from cutedsl.tools import names as N
    from cutedsl.tools import tiny_model

    case, _, variant = case.partition(":")
    fmt, names = case.split("/")
    ckpt = f"{tmp}/{fmt}-{names}"
    if os.path.exists(ckpt):
        cfg = json.load(open(f"{ckpt}/config.json"))
    else:
        cfg = tiny_model.generate(ckpt, fmt, names, overrides=TINY, layers=LAYERS)
    if variant == "chanattn":  # the attention group FP8 per channel instead of 128x128 blocks
        import shutil

        src, ckpt = ckpt, f"{ckpt}-chanattn"
        if not os.path.exists(ckpt):
            shutil.copytree(src, ckpt)
            c = json.load(open(f"{ckpt}/config.json"))
            g0 = c["quantization_config"]["config_groups"]["group_0"]["weights"]
            g0.update(strategy="channel", block_structure=None)
            json.dump(c, open(f"{ckpt}/config.json", "w"))
    vc = _vllm_config(ckpt, **({"moe_backend": "marlin"} if variant == "marlin" else {}))
    rep: dict = {"quant_config": type(vc.quant_config).__name__}
    with set_current_vllm_config(vc):
        _init_distributed(vc, tmp)
        from vllm.model_executor.models.deepseek_v4 import DeepseekV4ForCausalLM

        from cutedsl.vllm.quant import dsv4_quant_config

        rep["dispatch_is_upstream_config"] = dsv4_quant_config(vc) is vc.quant_config
        rep["dispatch_config"] = type(dsv4_quant_config(vc)).__name__
        from vllm.utils.torch_utils import set_default_torch_dtype

        # as vLLM's BaseModelLoader.load_model: default dtype, then the model on the target device
        with _construction_shims(fmt), set_default_torch_dtype(vc.model_config.dtype):
            with torch.device("cpu"):
                if variant in ("marlin", "chanattn"):  # raises at construction
                    try:
                        DeepseekV4ForCausalLM(vllm_config=vc, prefix="")
                    except Exception as e:
                        return {"raised": type(e).__name__, "message": str(e)}
                    return {"raised": None}
                model = DeepseekV4ForCausalLM(vllm_config=vc, prefix="")
        rep["methods"] = _method_names(model)
        rep["prewarm"] = _prewarm_vs_prefetch(
            model, cfg, vc.scheduler_config.max_num_batched_tokens
        )
        _poison(model)
        files = sorted(glob.glob(f"{ckpt}/*.safetensors"))
        weights = safetensors_weights_iterator(files, False)
        if variant in ("missing", "badshape"):
            return _broken_load(model, weights, variant)
        loaded = model.load_weights(weights)
        rep["n_ckpt_tensors"] = len(_ckpt_tensors(ckpt))
        rep["n_loaded"] = len(loaded)
        rep["unfilled"] = _unfilled(model, cfg["num_attention_heads"])
        rep["params"] = {
            n: [str(p.dtype).removeprefix("torch."), list(p.shape)]
            for n, p in model.named_parameters()
        }
        if fmt in ("nvfp4", "nvidia-mixed", "ct-nvfp4-fp8"):
            from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod
            from cutedsl.vllm.moe_experts import CuTeDSLModelOptNvFp4FusedMoE
            from cutedsl.vllm.oproj import is_nvfp4_oproj
            from cutedsl.vllm.shared_mlp import CuTeDSLSharedMlpMethod

            ours = (CuTeDSLNvFp4LinearMethod, CuTeDSLSharedMlpMethod, CuTeDSLModelOptNvFp4FusedMoE)
            with _variant_backend(variant):
                for _, mod in model.named_modules():  # vLLM's loop, restricted to our methods
                    if isinstance(getattr(mod, "quant_method", None), ours):
                        mod.quant_method.process_weights_after_loading(mod)
            rep["wo_a_is_nvfp4_oproj"] = [
                is_nvfp4_oproj(lyr.attn.wo_a) for lyr in model.model.layers
            ]
            rep["fused_experts"] = [
                type(lyr.ffn.experts.quant_method.moe_kernel.fused_experts).__name__
                for lyr in model.model.layers
            ]
            rep["runners"] = {
                n: f"{type(r).__name__}:{r.backend}"
                for n, mod in model.named_modules()
                if (r := getattr(mod, "cutedsl_runner", None)) is not None
            }
            ck = _ckpt_tensors(ckpt)
            if names == "hf":
                ck = {N.hf_to_native(k): v for k, v in ck.items()}
            if fmt == "ct-nvfp4-fp8":
                rep["fp8_scales_exact"] = _ct_fp8_scales_exact(model, ck)
                ck = _ct_as_modelopt(ck)
            packed = {
                n: all(st == 0 for st in p.stride())  # a zero-stride placeholder: released
                for n, p in model.named_parameters()
                if p.dtype in (torch.uint8, torch.float8_e4m3fn) and p.numel() > 1
            }
            rep["packed_params_released"] = sorted(n for n, rel in packed.items() if rel)
            rep["packed_params_held"] = sorted(n for n, rel in packed.items() if not rel)

            def numerics(w4a4: bool) -> dict:
                if fmt == "nvfp4":
                    return _numerics(model, ck, cfg, w4a4)
                res = _moe_numerics(model, ck, cfg, w4a4)
                if fmt == "ct-nvfp4-fp8":  # its shared experts are NVFP4 too
                    g = torch.Generator().manual_seed(3)
                    res.update(_shared_mlp_numerics(model, ck, cfg, g, w4a4))
                return res

            with _variant_backend(variant):
                rep["numerics"] = numerics(w4a4=variant == "sm100emu")
                if variant == "sm100emu":  # the same outputs against W4A16 math
                    rep["numerics_w4a16"] = numerics(w4a4=False)
        else:
            from cutedsl.vllm.oproj import is_nvfp4_oproj

            rep["wo_a_is_nvfp4_oproj"] = [
                is_nvfp4_oproj(lyr.attn.wo_a) for lyr in model.model.layers
            ]
    return rep


class _PristineFinder:
    """Import the two DSv4 modules from the pristine upstream copies apply_patches.sh keeps in
    <vllm>/.cutedsl_pristine/ (test-only meta-path finder; the installed overlay is untouched)."""

    MODULES = {
        "vllm.model_executor.models.deepseek_v4": "model_executor/models/deepseek_v4.py",
        "vllm.model_executor.layers.deepseek_v4_attention": (
            "model_executor/layers/deepseek_v4_attention.py"
        ),
    }

    def __init__(self) -> None:
        import importlib.util

        root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
        self.files = {m: root / ".cutedsl_pristine" / rel for m, rel in self.MODULES.items()}
        missing = [str(f) for f in self.files.values() if not f.exists()]
        if missing:
            raise FileNotFoundError(f"pristine copies not found (overlay not applied?): {missing}")

    def find_spec(self, name, path, target=None):
        import importlib.util

        f = self.files.get(name)
        return importlib.util.spec_from_file_location(name, f) if f is not None else None


def _harness(out: str, cases: list[str], workdir: str, pristine: bool) -> None:
    os.environ.setdefault("CUTEDSL_BACKEND", "reference")
    if pristine:
        sys.meta_path.insert(0, _PristineFinder())
    _setup_cpu_vllm()
    report = {}
    for case in cases:
        try:
            report[case] = _run_case(case, workdir)
        except Exception as e:  # reported per case; the test prints it
            import traceback

            report[case] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
    if pristine:
        import vllm.model_executor.models.deepseek_v4 as dsv4

        report["pristine_module_file"] = dsv4.__file__
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_cpu")


def _run_harness(workdir: Path, name: str, cases: tuple[str, ...], *flags: str) -> dict:
    out = workdir / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, __file__, "--harness", str(out), "--workdir", str(workdir), *flags,
         *cases],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(workdir: Path) -> dict:
    return _run_harness(workdir, "overlay", (*CASES, *BROKEN, SM90_EMU, *SM100_EMU, *MTP_CASES))


@pytest.fixture(scope="module")
def pristine_report(workdir: Path, report: dict) -> dict:
    """Upstream's own DSv4 files on the same checkpoints (generated by `report`)."""
    return _run_harness(workdir, "pristine", PRISTINE_CASES, "--pristine")


def _case(report: dict, case: str) -> dict:
    rep = report[case]
    assert "error" not in rep, f"{case}: {rep.get('error')}\n{rep.get('tb')}"
    return rep


@pytest.mark.parametrize("case", CASES)
def test_builds_and_loads_every_parameter(report: dict, case: str) -> None:
    rep = _case(report, case)
    assert rep["unfilled"] == [], f"{case}: parameters not filled by the checkpoint"
    assert rep["n_loaded"] > 0


def _nvfp4_linear(params: dict, prefix: str) -> None:
    assert params[f"{prefix}.weight"][0] == "uint8", prefix
    assert params[f"{prefix}.weight_scale"][0] == "float8_e4m3fn", prefix
    assert params[f"{prefix}.weight_scale_2"][0] == "float32", prefix
    assert params[f"{prefix}.input_scale"][0] == "float32", prefix


@pytest.mark.parametrize("case", ["nvfp4/native", "nvfp4/hf"])
def test_nvfp4_selects_our_methods_and_dtypes(report: dict, case: str) -> None:
    rep = _case(report, case)
    assert rep["quant_config"] == "ModelOptNvFp4Config"
    assert rep["dispatch_is_upstream_config"] is False
    m, p = rep["methods"], rep["params"]
    ours = "CuTeDSLNvFp4LinearMethod/CuTeDSLNvFp4LinearKernel"
    for li in range(LAYERS):
        a, f = f"model.layers.{li}.attn", f"model.layers.{li}.ffn"
        for lin in ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b"):
            assert m[f"{a}.{lin}"] == ours, (lin, m[f"{a}.{lin}"])
            _nvfp4_linear(p, f"{a}.{lin}")
        assert m[f"{f}.shared_experts"] == "CuTeDSLSharedMlpMethod"
        assert m[f"{f}.experts"] == "CuTeDSLModelOptNvFp4FusedMoE"
        assert m[f"{f}.gate"] == "UnquantizedLinearMethod"
        assert p[f"{f}.experts.w13_weight"][0] == "uint8"
        assert p[f"{f}.experts.w13_weight_scale"][0] == "float8_e4m3fn"
    assert m["model.layers.1.attn.indexer.wq_b"] == ours
    assert m["model.layers.1.attn.indexer.weights_proj"] == "UnquantizedLinearMethod"
    assert m["model.layers.1.attn.mla_attn.compressor.fused_wkv_wgate"] == "UnquantizedLinearMethod"
    assert rep["wo_a_is_nvfp4_oproj"] == [True] * LAYERS
    assert rep["fused_experts"] == ["CuTeDSLMoEExperts"] * LAYERS
    r = rep["runners"]
    assert r["model.layers.0.attn.wo_a"] == "Nvfp4GroupedOproj:reference"
    assert r["model.layers.0.attn.wq_b"] == "Nvfp4Linear:reference"
    assert r["model.layers.0.ffn.shared_experts"] == "Nvfp4SharedMlp:reference"
    assert r["model.layers.0.ffn.experts"] == "Nvfp4MoE:reference"
    # the fused shared expert's two linears build no runner of their own
    assert "model.layers.0.ffn.shared_experts.gate_up_proj" not in r


def test_hf_names_load_like_native(report: dict) -> None:
    """Same parameters (names, dtypes, shapes) from the HF/ModelOpt-named checkpoint."""
    nat, hf = _case(report, "nvfp4/native"), _case(report, "nvfp4/hf")
    assert hf["params"] == nat["params"]
    assert hf["n_loaded"] == nat["n_loaded"]


def test_nvidia_mixed_fp8_attention_nvfp4_experts(report: dict) -> None:
    rep = _case(report, "nvidia-mixed/native")
    assert rep["quant_config"] == "DeepseekV4FP8Config"
    assert rep["dispatch_is_upstream_config"] is True
    m, p = rep["methods"], rep["params"]
    for li in range(LAYERS):
        a, f = f"model.layers.{li}.attn", f"model.layers.{li}.ffn"
        assert m[f"{a}.wo_a"].startswith("Fp8LinearMethod"), m[f"{a}.wo_a"]
        assert p[f"{a}.wo_a.weight"][0] == "float8_e4m3fn"
        assert p[f"{a}.wo_a.weight_scale_inv"][0] == "float8_e8m0fnu"
        assert m[f"{f}.shared_experts.gate_up_proj"].startswith("Fp8LinearMethod")
        assert m[f"{f}.experts"] == "CuTeDSLModelOptNvFp4FusedMoE"
        assert p[f"{f}.experts.w13_weight_scale"][0] == "float8_e4m3fn"
        assert p[f"{f}.experts.w2_input_scale"][0] == "float32"
    assert rep["wo_a_is_nvfp4_oproj"] == [False] * LAYERS
    assert rep["fused_experts"] == ["CuTeDSLMoEExperts"] * LAYERS


def test_native_fp8_mxfp4_is_upstream(report: dict) -> None:
    rep = _case(report, "native/native")
    assert rep["quant_config"] == "DeepseekV4FP8Config"
    assert rep["dispatch_is_upstream_config"] is True
    m = rep["methods"]
    assert not any("CuTeDSL" in v for v in m.values()), m
    assert m["model.layers.2.ffn.experts"] == "Mxfp4MoEMethod"
    assert m["model.layers.2.attn.wo_a"].startswith("Fp8LinearMethod")
    assert "model.layers.0.ffn.shared_experts" not in m  # no fused shared-expert method
    assert rep["wo_a_is_nvfp4_oproj"] == [False] * LAYERS


def test_bf16_builds_unquantized(report: dict) -> None:
    """No quantization_config: pristine 0.21.0 dies on quantization_config["scale_fmt"]."""
    rep = _case(report, "bf16/native")
    assert not any("CuTeDSL" in v for v in rep["methods"].values())
    assert rep["params"]["model.layers.0.attn.wo_a.weight"][0] == "bfloat16"


def test_nvfp4_adapters_match_dequantized_math(report: dict) -> None:
    """Reference backend through our adapters vs torch math on the checkpoint's dequantized
    weights: catches wrong tensors, swapped w1/w3, lost global scales, a missing clamp, the
    wrong RoPE direction or group order."""
    num = _case(report, "nvfp4/native")["numerics"]
    assert num["cos_sin_cache_is_f32"] == 1.0
    for k in ("fused_wqa_wkv", "wq_b", "indexer.wq_b", "wo_b", "wo_a", "shared_mlp", "moe_layer0",
              "moe_layer2"):  # fmt: skip
        assert num[k] < 2e-2, (k, num[k])
    assert num["wo_a_vs_no_inverse_rope"] > 0.02, num["wo_a_vs_no_inverse_rope"]
    for k in ("shared_mlp_vs_unclamped", "moe_layer0_vs_unclamped", "moe_layer2_vs_unclamped"):
        assert num[k] > 0.1, (k, num[k])  # the clamp matters for these inputs: it is applied
    assert num["moe_layer0_nan"] == 0.0 and num["moe_layer2_nan"] == 0.0


def test_gpu_backend_layers_hold_no_checkpoint_weights(report: dict) -> None:
    """Loaded with the sm90 backend (launch emulated), every NVFP4 weight and block-scale parameter
    of the model is a zero-stride placeholder once our runners hold their prepared copies (on the
    H200 the flash-layers model took 16.6 GiB at load against upstream's 7.0 GiB while both were
    held), and vLLM's forward paths through our adapters still give the dequantized math."""
    rep = _case(report, SM90_EMU)
    assert rep["runners"] and all(v.endswith(":sm90") for v in rep["runners"].values()), rep
    assert rep["packed_params_held"] == [], rep["packed_params_held"]
    released = rep["packed_params_released"]
    for name in ("model.layers.1.attn.wq_b.weight", "model.layers.1.attn.wo_a.weight_scale",
                 "model.layers.0.ffn.shared_experts.gate_up_proj.weight",
                 "model.layers.2.ffn.experts.w13_weight", "model.layers.2.ffn.experts.w2_weight_scale"):  # fmt: skip
        assert name in released, (name, released)
    num = rep["numerics"]
    for k in ("fused_wqa_wkv", "wq_b", "indexer.wq_b", "wo_b", "wo_a", "shared_mlp", "moe_layer0",
              "moe_layer2"):  # fmt: skip
        assert num[k] < 2e-2, (k, num[k])
    ref = _case(report, "nvfp4/native")
    assert ref["packed_params_released"] == [] and ref["packed_params_held"], "reference: kept"


@pytest.mark.parametrize("case", SM100_EMU)
def test_sm100_emulated_layers_compute_w4a4(report: dict, case: str) -> None:
    """The sm100-emulated backend inside vLLM's own layers (built, loaded and post-processed by
    vLLM's loaders and our methods, as on a GPU): every NVFP4 GEMM equals W4A4 math, its input
    rounded to NVFP4 by vLLM's reference quantizer under the checkpoint's static input scale
    (compressed-tensors: the reciprocal of its divisor), on fresh random inputs; W4A16 math is far
    from it, so each check can fail (a wrong scale, an input left unrounded, a layout slip)."""
    rep = _case(report, case)
    kinds = {v.split(":")[0] for v in rep["runners"].values()}
    assert all(v.endswith(":sm100-emulated") for v in rep["runners"].values()), rep["runners"]
    want = {"Nvfp4MoE", "Nvfp4SharedMlp"}
    if case.startswith("nvfp4/"):
        want |= {"Nvfp4Linear", "Nvfp4GroupedOproj"}
    assert kinds == want, kinds
    num, w16 = rep["numerics"], rep["numerics_w4a16"]
    gemms = [k for k in num if not k.endswith(("_nan", "_vs_unclamped", "_vs_no_inverse_rope"))
             and k != "cos_sin_cache_is_f32"]  # fmt: skip
    assert len(gemms) == (8 if case.startswith("nvfp4/") else 3), gemms
    for k in gemms:
        assert num[k] < 1e-2, (k, num[k])
        assert w16[k] > 5e-2, (k, w16[k])
    assert all(num[k] == 0.0 for k in num if k.endswith("_nan")), num


def test_nvidia_mixed_experts_match_dequantized_math(report: dict) -> None:
    num = _case(report, "nvidia-mixed/native")["numerics"]
    assert num["moe_layer0"] < 2e-2 and num["moe_layer2"] < 2e-2, num
    assert num["moe_layer0_vs_unclamped"] > 0.1 and num["moe_layer2_vs_unclamped"] > 0.1, num


def test_hf_named_checkpoint_matches_dequantized_math(report: dict) -> None:
    """HF/ModelOpt names land in the right parameters (w1/w3 not swapped, shared w2 -> down)."""
    num = _case(report, "nvfp4/hf")["numerics"]
    for k in ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b", "shared_mlp", "moe_layer0", "moe_layer2"):
        assert num[k] < 2e-2, (k, num[k])


def test_missing_tensor_is_named(report: dict) -> None:
    """vLLM 0.21.0 does not track missing weights of quantized models: without the check, a
    dropped NVFP4 tensor leaves torch.empty memory in the parameter."""
    rep = report["nvfp4/native:missing"]
    assert rep["raised"] == "ValueError", rep
    assert "model.layers.1.attn.wo_a.weight_scale" in rep["message"], rep["message"]
    assert "layers.2.ffn.experts.3.w3.weight_scale_2" in rep["message"], rep["message"]


def test_wrong_shape_is_named(report: dict) -> None:
    rep = report["nvfp4/native:badshape"]
    assert rep["raised"] is not None, rep
    assert any(RESHAPED in n for n in rep["notes"]), rep


@pytest.mark.parametrize("fmt", ["nvfp4", "nvidia-mixed", "native", "native-fp8", "bf16"])
def test_name_rules_hf_to_native_and_native_untouched(fmt: str) -> None:
    """In-process, no vLLM: the mapper's HF rules equal `cutedsl.tools.names.hf_to_native` on
    every HF name, and match no native name (so native checkpoints map exactly as upstream)."""
    from cutedsl.tools import names as N
    from cutedsl.tools import tiny_model
    from cutedsl.vllm.names import HF_TO_NATIVE_REGEX

    def mapped(name: str) -> str:
        for pattern, repl in HF_TO_NATIVE_REGEX.items():  # WeightsMapper._map_name's loop
            if pattern.search(name):
                name = pattern.sub(repl, name)
        return name

    cfg = tiny_model.make_config("tiny", fmt, overrides=TINY, layers=LAYERS)
    native = list(tiny_model.expected_tensors(cfg, fmt, "native"))
    for n in native:
        assert not any(p.search(n) for p in HF_TO_NATIVE_REGEX), n
        assert mapped(N.native_to_hf(n)) == n, (N.native_to_hf(n), mapped(N.native_to_hf(n)))


def test_quantized_layers_name_experts_by_module_or_by_projection() -> None:
    """In-process: NVIDIA's list names a layer's experts as one module (the repositories' HEAD) or
    as every projection (`awq_block_size` entries of an earlier revision); both give that layer
    NVFP4 experts, no other layer (`layers.3` is not `layers.30`) and never the MTP block."""
    from cutedsl.vllm.quant import is_nvfp4_experts

    entry = {"quant_algo": "NVFP4", "group_size": 16}
    by_module = {f"layers.{i}.ffn.experts": entry for i in (3, 30)}
    by_projection = {
        f"{m}layers.{i}.ffn.experts.{e}.{w}": {**entry, "awq_block_size": 16}
        for m in ("", "model.") for i in (3, 30) for e in range(4) for w in ("w1", "w2", "w3")
    }  # fmt: skip
    for listed in (by_module, by_projection):
        assert is_nvfp4_experts("model.layers.3.ffn.experts", listed)
        assert is_nvfp4_experts("model.layers.30.ffn.experts", listed)
        assert not is_nvfp4_experts("model.layers.4.ffn.experts", listed)
        assert not is_nvfp4_experts("model.layers.43.mtp_block.ffn.experts", listed)
    assert not is_nvfp4_experts("model.layers.3.ffn.experts", {"layers.30.ffn.experts": entry})
    assert is_nvfp4_experts("model.layers.43.mtp_block.ffn.experts", None)  # no list: all


@pytest.mark.parametrize("experts,redundant", [(8, 0), (256, 0), (16, 4)])
def test_expert_mappings_index_finds_what_the_scan_finds(experts: int, redundant: int) -> None:
    """The overlay's indexed lookup in DeepseekV4Model.load_weights returns exactly the entries
    (and order) of upstream's scan `[e for e in mapping if e[1] in name]`, for expert tensors of
    every leaf, redundant (EPLB) experts, a LoRA base_layer mapping and names of no expert."""
    import torch
    from vllm.model_executor.layers.fused_moe import FusedMoE

    from cutedsl.vllm.names import expert_mappings

    def scan(mapping, name):
        return [e for e in mapping if e[1] in name]

    mapping = FusedMoE.make_expert_params_mapping(
        torch.nn.Module(), "w1", "w2", "w3", num_experts=experts, num_redundant_experts=redundant
    )
    lora = [(p, w + "base_layer.", i, s) for p, w, i, s in mapping[:6]]
    names = [
        f"layers.{li}.ffn.experts.{e}.{w}.{leaf}"
        for li in (0, 5)
        for e in range(experts)
        for w in ("w1", "w2", "w3")
        for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale", "scale")
    ]
    names += ["layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.experts.999.w1.weight",
              "mtp.0.ffn.experts.3.w2.weight", "layers.1.ffn.experts.1.w1.base_layer.weight"]  # fmt: skip
    for mp in (mapping, lora, mapping):  # a new mapping list re-indexes
        for name in names:
            assert expert_mappings(mp, name) == scan(mp, name), name
    assert len(expert_mappings(mapping, "layers.0.ffn.experts.1.w3.weight")) == 1 + (redundant > 0)


def test_explicit_upstream_moe_backend_goes_to_upstream_oracle(report: dict) -> None:
    """--moe-backend marlin: the experts get upstream's ModelOptNvFp4FusedMoE, whose oracle then
    refuses Marlin on this CPU (on a GPU it would run Marlin, without the clamp)."""
    rep = report["nvfp4/native:marlin"]
    assert rep["raised"] == "ValueError", rep
    assert "NvFp4 MoE backend 'MARLIN' does not support" in rep["message"], rep["message"]


def test_native_matches_pristine_upstream(report: dict, pristine_report: dict) -> None:
    """Native FP8 + MXFP4: the overlay builds the same parameters (names, dtypes, shapes) with the
    same quant methods as vLLM 0.21.0's own files, and loads the same parameter set."""
    assert pristine_report["pristine_module_file"].endswith(
        ".cutedsl_pristine/model_executor/models/deepseek_v4.py"
    ), pristine_report["pristine_module_file"]
    ours, up = _case(report, "native/native"), _case(pristine_report, "native/native")
    assert ours["methods"] == up["methods"]
    assert ours["params"] == up["params"]
    assert ours["n_loaded"] == up["n_loaded"] and ours["unfilled"] == up["unfilled"] == []


def test_pristine_cannot_load_nvidia_mixed(pristine_report: dict) -> None:
    """The regression the mixed-checkpoint dispatch fixes: upstream routes the NVFP4 experts to
    MXFP4 parameters and fails loading them."""
    err = pristine_report["nvidia-mixed/native"].get("error", "")
    assert err.startswith("KeyError") and ".ffn.experts." in err, err


def test_compressed_tensors_fp8_attention_nvfp4_experts(report: dict) -> None:
    """Red Hat's layout served as it is: FP8 block attention and indexer.wq_b upstream's (float32
    block scales, the checkpoint's BF16 ones exactly), NVFP4 routed experts and shared experts
    ours; every parameter filled."""
    rep = _case(report, "ct-nvfp4-fp8/native")
    assert rep["quant_config"] == "CompressedTensorsConfig"
    assert rep["dispatch_config"] == "CompressedTensorsDsv4Config"
    m, p = rep["methods"], rep["params"]
    ours = "CuTeDSLNvFp4LinearMethod/CuTeDSLNvFp4LinearKernel"
    for li in range(LAYERS):
        a, f = f"model.layers.{li}.attn", f"model.layers.{li}.ffn"
        for lin in ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b"):
            assert m[f"{a}.{lin}"].startswith("Fp8LinearMethod"), (lin, m[f"{a}.{lin}"])
            assert p[f"{a}.{lin}.weight"][0] == "float8_e4m3fn"
            assert p[f"{a}.{lin}.weight_scale_inv"][0] == "float32"
        assert m[f"{f}.shared_experts"] == "CuTeDSLSharedMlpMethod"
        for lin in ("gate_up_proj", "down_proj"):
            assert m[f"{f}.shared_experts.{lin}"] == ours, (lin, m[f"{f}.shared_experts.{lin}"])
            _nvfp4_linear(p, f"{f}.shared_experts.{lin}")
        assert m[f"{f}.experts"] == "CuTeDSLModelOptNvFp4FusedMoE"
        assert p[f"{f}.experts.w13_weight_scale"][0] == "float8_e4m3fn"
    assert m["model.layers.1.attn.indexer.wq_b"].startswith("Fp8LinearMethod")
    assert m["model.layers.1.attn.indexer.weights_proj"] == "UnquantizedLinearMethod"
    assert "layers.1.attn.indexer.wq_b" in rep["fp8_scales_exact"]
    assert rep["fp8_scales_exact"] and all(rep["fp8_scales_exact"].values()), rep[
        "fp8_scales_exact"
    ]
    assert rep["unfilled"] == [], rep["unfilled"]
    assert rep["wo_a_is_nvfp4_oproj"] == [False] * LAYERS
    assert rep["fused_experts"] == ["CuTeDSLMoEExperts"] * LAYERS


@pytest.mark.parametrize("case", CASES)
def test_prewarm_tool_lists_the_kernels_the_engine_compiles(report: dict, case: str) -> None:
    """dsv4-prewarm-kernels, from config.json alone, lists exactly the kernels (disk-cache keys)
    the engine's own prefetch lists from the model vLLM builds; none for layouts without ours."""
    p = _case(report, case)["prewarm"]
    assert p["equal"], p
    assert (p["engine"] > 0) == case.startswith(("nvfp4", "nvidia-mixed", "ct-nvfp4-fp8")), p


def test_compressed_tensors_scheme_not_served_is_refused(report: dict) -> None:
    rep = report["ct-nvfp4-fp8/native:chanattn"]
    assert rep["raised"] == "NotImplementedError", rep
    msg = rep["message"]
    assert (
        "ct-nvfp4-fp8-native-chanattn/config.json: quantization_config (compressed-tensors)" in msg
    )
    assert "model.layers.0.attn.fused_wqa_wkv" in msg and "8-bit float channel" in msg, msg
    assert "\n" not in msg


def test_compressed_tensors_experts_match_dequantized_math(report: dict) -> None:
    """Our experts on the renamed tensors vs torch math on the checkpoint's own (global scales
    taken as divisors); a global scale not inverted would be off by its square."""
    n = _case(report, "ct-nvfp4-fp8/native")["numerics"]
    for li in (0, 2):
        assert n[f"moe_layer{li}"] < 2e-2 and n[f"moe_layer{li}_nan"] == 0, n
        assert n[f"moe_layer{li}_vs_unclamped"] > 0.1, n  # the clamp bites: the check can fail
    assert n["shared_mlp"] < 2e-2 and n["shared_mlp_vs_unclamped"] > 0.1, n


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_draft_builds_on_our_decoder_layer_and_loads_every_parameter(
    report: dict, case: str
) -> None:
    """vLLM 0.21.0's DeepSeekV4MTP (deepseek_v4_mtp.py) with `mtp.0.*` of each block format."""
    rep = _case(report, case)
    assert rep["block_types"] == ["DeepseekV4DecoderLayer"]
    assert rep["n_mtp_tensors"] > 0 and rep["n_loaded"] > 0
    assert rep["unfilled"] == [] and rep["not_loaded"] == [], (rep["unfilled"], rep["not_loaded"])


def test_mtp_block_methods_per_format(report: dict) -> None:
    b = f"model.layers.{LAYERS}.mtp_block"
    nv = _case(report, "mtp:nvfp4")["methods"]
    assert nv[f"{b}.attn.fused_wqa_wkv"] == "CuTeDSLNvFp4LinearMethod"
    assert nv[f"{b}.attn.wo_a"] == "CuTeDSLNvFp4LinearMethod"
    assert nv[f"{b}.ffn.shared_experts"] == "CuTeDSLSharedMlpMethod"
    assert nv[f"{b}.ffn.experts"] == "CuTeDSLModelOptNvFp4FusedMoE"
    # built by deepseek_v4_mtp.py itself (not overlaid) with the model's quant config
    assert nv[f"model.layers.{LAYERS}.e_proj"] == "ModelOptNvFp4LinearMethod"
    mixed = _case(report, "mtp:nvidia-mixed")["methods"]
    # quantized_layers names the main layers' experts only: the MTP block's stay MXFP4
    assert mixed[f"{b}.ffn.experts"] == "Mxfp4MoEMethod"
    assert mixed[f"{b}.attn.wo_a"] == mixed[f"model.layers.{LAYERS}.e_proj"] == "Fp8LinearMethod"
    native = _case(report, "mtp:native")["methods"]
    assert native[f"{b}.ffn.experts"] == "Mxfp4MoEMethod"
    assert not any("CuTeDSL" in v for v in native.values())
    ct = _case(report, "mtp:ct-nvfp4-fp8")["methods"]  # the recipe ignores mtp.*: BF16
    assert ct[f"{b}.attn.wq_b"] == ct[f"{b}.attn.wo_a"] == "UnquantizedLinearMethod"
    assert ct[f"{b}.ffn.experts"] == "UnquantizedFusedMoEMethod"
    bf16 = _case(report, "mtp:bf16")["methods"]
    assert bf16[f"{b}.ffn.experts"] == "UnquantizedFusedMoEMethod"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the CPU vLLM harness of this test file")
    ap.add_argument("--harness", required=True, metavar="OUT.json")
    ap.add_argument("--workdir", required=True, help="checkpoints are generated (or reused) here")
    ap.add_argument("--pristine", action="store_true", help="upstream's DSv4 files, not ours")
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    _harness(
        a.harness,
        a.cases or [*CASES, *BROKEN, SM90_EMU, *SM100_EMU, *MTP_CASES],
        a.workdir,
        a.pristine,
    )


def test_deepgemm_prewarm_shapes_are_upstreams(workdir: Path, pristine_report: dict) -> None:
    """bench/deepgemm_prewarm.py compiles DeepGEMM kernels for exactly the 2-D FP8 block-scaled
    linear weights upstream's own model builds from the native checkpoint (wo_a aside: upstream
    marks it `is_bmm` and its weight is 3-D after loading, so the warm-up skips it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dgp", REPO / "bench" / "deepgemm_prewarm.py")
    dgp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dgp)
    up = _case(pristine_report, "native/native")
    want = set()
    for mod, method in up["methods"].items():
        dtype, shape = up["params"].get(f"{mod}.weight", (None, []))
        if method.startswith("Fp8LinearMethod") and dtype == "float8_e4m3fn" and len(shape) == 2:
            if not mod.endswith(".wo_a") and shape[0] % 128 == 0 and shape[1] % 128 == 0:
                want.add(tuple(shape))
    cfg = json.loads((workdir / "native-native" / "config.json").read_text())
    got = dgp.fp8_linear_shapes(cfg)
    assert want and {(n, k) for _, n, k in got} == want, (got, want)
    assert len(got) == len(want)  # one entry per distinct shape
    ms = [list(range(i, i + 70)) for i in range(3)]
    tasks = dgp.chunks([(n, k, m) for (_, n, k), m in zip(got, ms, strict=False)], size=32)
    for (_, n, k), m in zip(got, ms, strict=False):  # every M once, in order, ≤ 32 per task
        assert [x for tn, tk, t in tasks if (tn, tk) == (n, k) for x in t] == m
    assert max(len(t) for *_, t in tasks) == 32
