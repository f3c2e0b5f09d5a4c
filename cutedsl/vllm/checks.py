"""Loading checks for DSv4 checkpoints: name the tensor a loader error is about; for models with
our NVFP4 layers, fail on any parameter or expert tensor the checkpoint did not provide.

Hook in `DeepseekV4ForCausalLM.load_weights` (deepseek_v4.py), in place of
`loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)`:
    loaded_params = checked_load(self, loader, weights, self.hf_to_vllm_mapper)
A loader error keeps its type and message (upstream behaviour) and gets a note naming the
checkpoint tensor, its shape and dtype. A compressed-tensors checkpoint's tensors are renamed on
the way (`cutedsl.vllm.ct.ct_tensor`); the note names them as the checkpoint does. vLLM 0.21.0
does not track missing weights for quantized
models (default_loader.py: only when `quantization is None`), so a missing NVFP4 tensor would
silently leave `torch.empty` memory; for models with our methods `checked_load` raises a
ValueError naming every missing parameter (and, for routed experts, which it tracks per expert,
every missing checkpoint tensor). FP8 / MXFP4 / BF16 models get only the note (upstream otherwise).
Before the first tensor is read, models with our methods start compiling their kernels in the
background (`cutedsl.vllm.prefetch`), so the compiles overlap the weight loading; on a GPU, every
DSv4 model also starts compiling vLLM's step-metadata Triton kernels for each batch shape its
scheduler can produce (`cutedsl.vllm.metadata_warmup`), waited for once the weights have loaded.

Hook at the start of `DeepseekV4ForCausalLM.__init__` (deepseek_v4.py), before any layer (and
so any weight or buffer) is created:
    checked_construction(vllm_config)
which runs `cutedsl.vllm.preflight.check_checkpoint` on a local checkpoint folder (safetensors
headers only: truncated shards, an index naming a missing shard, missing or mis-typed scales, an
expert count the tensors disagree with, and, when MTP speculative decoding drafts from this
checkpoint, an MTP block without tensors) and raises its one-line CheckpointFault, so that the
engine fails before it allocates the weights and the KV cache. A model that is not a local folder
(a Hub id: the weights download later) or another --load-format is logged and left to the load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import regex as re
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from cutedsl.vllm import metadata_warmup, prefetch
from cutedsl.vllm.ct import ct_tensor, is_ct
from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod
from cutedsl.vllm.moe_experts import CuTeDSLModelOptNvFp4FusedMoE
from cutedsl.vllm.names import hf_to_native
from cutedsl.vllm.preflight import INDEX, check_checkpoint

logger = init_logger(__name__)

# Created by upstream vLLM 0.21.0, absent from DeepSeek's checkpoints, unused in forward.
UNLOADED_UPSTREAM = (".indexer.k_norm.",)
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(\w+)$")
_NVFP4_LEAVES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class _Tracked:
    """The checkpoint's tensors, each passed through `rename` (`current`: the one being loaded,
    as the checkpoint names it; `seen`: every name as renamed)."""

    def __init__(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        rename: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        self._weights = weights
        self._rename = rename
        self.current: tuple[str, torch.Tensor] | None = None
        self.seen: set[str] = set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        it = iter(self._weights)
        while True:
            self.current = None  # an error while reading the next tensor is not about this one
            try:
                name, tensor = next(it)
            except StopIteration:
                return
            self.current = (name, tensor)
            if self._rename is not None:
                name, tensor = self._rename(name, tensor)
            self.seen.add(name)
            yield name, tensor


def _missing(model: torch.nn.Module, loaded: set[str], seen: set[str]) -> list[str]:
    missing = []
    expert_layers: dict[int, int] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), CuTeDSLModelOptNvFp4FusedMoE):
            expert_layers[int(name.split(".layers.")[1].split(".")[0])] = module.global_num_experts
    for name, _ in model.named_parameters():
        if name in loaded or any(s in name for s in UNLOADED_UPSTREAM):
            continue
        missing.append(name)
    native = {hf_to_native(n) for n in seen}
    for layer, n_experts in sorted(expert_layers.items()):
        for e in range(n_experts):
            for w in ("w1", "w3", "w2"):
                for leaf in _NVFP4_LEAVES:
                    n = f"layers.{layer}.ffn.experts.{e}.{w}.{leaf}"
                    if n not in native:
                        missing.append(n)
    return missing


def _uses_ours(model: torch.nn.Module) -> bool:
    ours = (CuTeDSLNvFp4LinearMethod, CuTeDSLModelOptNvFp4FusedMoE)
    return any(isinstance(getattr(m, "quant_method", None), ours) for m in model.modules())


def _start_metadata_warmup(model: torch.nn.Module) -> bool:
    """Start compiling vLLM's step-metadata Triton kernels for this server's batches
    (`cutedsl.vllm.metadata_warmup`) on a GPU; whether it started. Never raises."""
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.config import get_current_vllm_config

        ctx = metadata_warmup.context(get_current_vllm_config(), model.config)
    except Exception as e:  # the kernels then compile on first use, as upstream's do
        logger.warning("cutedsl: no step-metadata warm-up (%s: %s)", type(e).__name__, e)
        return False
    metadata_warmup.start(ctx)
    return True


def checked_load(
    model: torch.nn.Module,
    loader: AutoWeightsLoader,
    weights: Iterable[tuple[str, torch.Tensor]],
    mapper: WeightsMapper,
) -> set[str]:
    """`loader.load_weights(weights, mapper=mapper)` with the checks of the module docstring; for
    models with our methods, our kernels start compiling first (`cutedsl.vllm.prefetch`), in
    background processes, while the weights load."""
    if _uses_ours(model):
        prefetch.start(model)
    warming = _start_metadata_warmup(model)
    ct = is_ct(getattr(getattr(model, "config", None), "quantization_config", None))
    tracked = _Tracked(weights, ct_tensor if ct else None)
    try:
        loaded = loader.load_weights(tracked, mapper=mapper)
    except Exception as e:
        if tracked.current is not None:
            name, t = tracked.current
            e.add_note(
                f"while loading checkpoint tensor {name!r} (shape {list(t.shape)}, dtype "
                f"{str(t.dtype).removeprefix('torch.')})"
            )
        raise  # the warm-up thread (a daemon) is not waited for: the error goes out at once
    if warming:
        metadata_warmup.finish()
    if _uses_ours(model):
        missing = _missing(model, loaded, tracked.seen)
        if missing:
            more = f", ... ({len(missing)} in all)" if len(missing) > 20 else ""
            raise ValueError(
                f"DeepSeek V4 NVFP4 checkpoint is missing tensors: {', '.join(missing[:20])}{more}"
            )
    return loaded


def checked_construction(vllm_config: VllmConfig) -> None:
    """The checkpoint checks that need no weights (module docstring); raises CheckpointFault."""
    folder = vllm_config.model_config.model
    fmt = str(vllm_config.load_config.load_format)
    if fmt not in ("auto", "safetensors"):
        logger.info("Checkpoint pre-check skipped: --load-format %s", fmt)
        return
    if not os.path.isdir(folder):
        logger.info("Checkpoint pre-check skipped: %s is not a local folder", folder)
        return
    if not os.path.isfile(os.path.join(folder, INDEX)) and not any(
        f.endswith(".safetensors") for f in os.listdir(folder)
    ):
        logger.info("Checkpoint pre-check skipped: no safetensors files in %s", folder)
        return
    hf = vllm_config.model_config.hf_config
    sc = vllm_config.speculative_config
    mtp = None
    if sc is not None and sc.method == "mtp" and str(sc.model or folder) == str(folder):
        mtp = (int(hf.num_hidden_layers), int(getattr(hf, "num_nextn_predict_layers", 0) or 0))
    n = check_checkpoint(
        folder,
        getattr(hf, "n_routed_experts", None),
        getattr(hf, "quantization_config", None),
        mtp,
    )
    logger.info("Checkpoint %s: %d tensors pass the pre-check (files, scales, experts)", folder, n)
