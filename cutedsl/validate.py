"""Input checks shared by the runners and both backends: each failure is one `ValueError` naming the
tensor (or value), what was found and what was expected. Also the one rule both backends' kernels
read activation rows by (`rows_addressable`), and the copy a runner makes of an input that breaks
it (`readable_rows`, logged once)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ROWS_NEED = "unit stride on the last dim, the others positive multiples of 8, 16-byte aligned"


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `cond`."""
    if not cond:
        raise ValueError(msg)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    *,
    contiguous: bool = False,
) -> None:
    """Raise ValueError naming `name` unless t has len(shape) dims matching `shape` (None = any),
    one of `dtypes`, lives on `device` (if given) and, with `contiguous`, is contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        names = " or ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {_dtype_name(t.dtype)}, expected {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (where the weights are)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: strides {list(t.stride())}, expected a contiguous tensor")


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


def rows_addressable(t: torch.Tensor) -> bool:
    """Whether a kernel reads or writes `t` in place through its strides (`ROWS_NEED`): unit
    stride along the last dim, the other strides positive multiples of 8 elements (no broadcast
    rows) and a 16-byte aligned start, e.g. a contiguous tensor or a column slice of one."""
    lead = t.stride()[:-1]
    return t.stride(-1) == 1 and all(s > 0 and s % 8 == 0 for s in lead) and t.data_ptr() % 16 == 0


_COPY_WARNED: set[tuple[str, tuple[int, ...]]] = set()


def warn_copy(what: str, t: torch.Tensor, need: str) -> None:
    """Log, once per runner tensor (`what`) and stride order, that `t` is copied on every call
    because it is not what the kernel needs (`need`): a warning, as it costs a kernel per call."""
    order = tuple(sorted(range(t.ndim), key=lambda d: -t.stride(d)))
    if (what, order) not in _COPY_WARNED:
        _COPY_WARNED.add((what, order))
        logger.warning(
            "cutedsl %s: %s with strides %s (start at byte %d mod 16) cannot be used in place "
            "(%s); it is copied on every call",
            what, tuple(t.shape), tuple(t.stride()), t.data_ptr() % 16, need,
        )  # fmt: skip


def readable_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as a kernel's activation operand: itself when `rows_addressable` (contiguous, or a column
    slice of a wider tensor), else a copy with row-major strides (also for a tensor torch calls
    contiguous whose size-1 dims carry odd strides), logged once (`warn_copy`)."""
    if rows_addressable(x):
        return x
    warn_copy(what, x, ROWS_NEED)
    return x.clone(memory_format=torch.contiguous_format)
