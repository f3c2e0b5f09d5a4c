"""Which implementation a runner uses: `sm100` (native NVFP4), `sm90` (W4A16), `reference` (torch)
or `sm100-emulated`.

Auto selection by the device: SM100 → sm100, SM90 → sm90, CPU (or any other GPU) → reference, with a
warning on a GPU since the reference is slow. `CUTEDSL_BACKEND=sm100|sm90|reference|sm100-emulated`
forces one for every runner; a runner's own `backend=` argument wins over both. A forced backend
that cannot run on the device raises `BackendUnavailableError` — never a silent fallback.

`sm100-emulated` is the sm100 backend's own code (weight preparation, blocked scales, layouts,
workspaces, launcher checks, W4A4 numerics) with each CuTeDSL kernel launch replaced by the torch
statement of that kernel's contract (`cutedsl.sm100.emulate`). It runs on any device, CPU or any
CUDA GPU, and is chosen only by name, never automatically: it tests the Blackwell host path where
no Blackwell GPU is, and is much slower than a real backend.
"""

from __future__ import annotations

import logging
import os

import torch

ENV_VAR = "CUTEDSL_BACKEND"
BACKENDS = ("sm100", "sm90", "reference", "sm100-emulated")
_REQUIRED_MAJOR = {"sm100": 10, "sm90": 9}
logger = logging.getLogger(__name__)


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run on this device."""


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def select_backend(device: torch.device | str, requested: str | None = None) -> str:
    """The backend for tensors on `device`: `requested`, else $CUTEDSL_BACKEND, else by capability."""
    device = torch.device(device)
    choice = requested or os.environ.get(ENV_VAR) or None
    cap = _capability(device)
    if choice is None:
        if cap is not None and cap[0] == 10:
            return "sm100"
        if cap is not None and cap[0] == 9:
            return "sm90"
        if cap is not None:
            logger.warning(
                "cutedsl: no CuTeDSL kernels for sm_%d%d; using the torch reference backend", *cap
            )
        return "reference"
    if choice not in BACKENDS:
        src = "backend=" if requested else f"${ENV_VAR}="
        raise ValueError(f"{src}{choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice in _REQUIRED_MAJOR:
        major = _REQUIRED_MAJOR[choice]
        if cap is None or cap[0] != major:
            found = "a CPU tensor" if cap is None else f"sm_{cap[0]}{cap[1]}"
            raise BackendUnavailableError(
                f"cutedsl backend {choice!r} needs an SM{major}x GPU, found {found} ({device}); "
                f"unset ${ENV_VAR} or pick 'reference'"
            )
    return choice
