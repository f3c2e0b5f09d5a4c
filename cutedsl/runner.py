"""What every runner shares: input checks with clear errors, backend choice, op registration.

A runner is built once per layer from checkpoint-layout tensors (weights prepared for its backend
then, never per call), and called through its torch.library op (`cutedsl.ops`), so torch.compile
sees one opaque op and CUDA graphs capture only the backend's kernels. `run()` is the op body:
checks, the M == 0 early return, then the backend.
"""

from __future__ import annotations

import torch

from cutedsl import ops
from cutedsl.backends import BackendUnavailableError, select_backend


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> None:
    """Raise ValueError naming `name` unless t has len(shape) dims matching `shape` (None = any),
    one of `dtypes`, and lives on `device` (if given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')}, expected {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (where the weights are)")


def scalar_f32(
    name: str, t: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """A per-tensor fp32 scale as a 0-dim tensor on `device`; accepts a float, a 0-dim or a
    one-element tensor. (vLLM keeps one scale per fused shard; callers pass their max.)"""
    if t is None:
        return None
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name}: {t.numel()} elements, expected one per-tensor fp32 scale")
    return t.reshape(())


def per_expert_f32(
    name: str, t: torch.Tensor | None, e: int, device: torch.device
) -> torch.Tensor | None:
    """Per-expert fp32 scales [E] (a 0-dim / one-element tensor is broadcast)."""
    if t is None:
        return None
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    if t.numel() == 1:
        return t.reshape(1).expand(e).contiguous()
    if t.shape != (e,):
        raise ValueError(f"{name}: shape {list(t.shape)}, expected [{e}] (one scale per expert)")
    return t


class Runner:
    """Base: subclasses set their static facts and `kind` (the stem of their backend factories
    `sm90_runners.<kind>_impl` / `sm100_runners.<kind>_impl`), define `_reference`, and call
    `_setup(device, backend)`."""

    kind: str
    id: int
    backend: str
    device: torch.device
    out_dtype: torch.dtype = torch.bfloat16
    # The checkpoint-layout tensors only `_reference` reads. A GPU backend's impl prepares its
    # own copies when it is built; the runner then lets go of these, so that once the caller
    # drops its references too (`cutedsl.vllm.linear_kernel.install_runner`) the weights are not
    # held twice.
    checkpoint_tensors: tuple[str, ...] = ()

    def _setup(self, device: torch.device, backend: str | None) -> None:
        self.device = device
        self.backend = select_backend(device, backend)
        self._impl = self._make_impl(self.backend)
        if self.backend != "reference":
            for name in self.checkpoint_tensors:
                setattr(self, name, None)
        self.id = ops.register(self)

    def _make_impl(self, backend: str):
        """A callable with `run`'s signature for `backend`; GPU backends prepare weights here."""
        if backend == "reference":
            return self._reference
        if backend == "sm90":
            from cutedsl import sm90_runners as impls
        elif backend == "sm100":
            from cutedsl import sm100_runners as impls
        else:
            raise BackendUnavailableError(f"cutedsl backend {backend!r} has no {self.kind} kernel")
        return getattr(impls, f"{self.kind}_impl")(self)

    def warmup(self, max_tokens: int) -> None:
        """Compile every kernel this runner will need for up to `max_tokens` rows (all CUDA-graph
        capture sizes); call before capture. Nothing to do for the reference backend."""
        warm = getattr(self._impl, "warmup", None)
        if warm is not None:
            warm(max_tokens)
