"""Pre-allocated scratch buffers for the GPU runners' hot path (intermediates, split-K fp32
workspaces, MoE routing buffers, the MoE combine accumulator).

A `Workspace` holds named byte buffers. `reserve(name, shape, dtype)` (warm-up only) grows a
buffer to hold at least that many bytes (never shrinks it); `get(name, shape, dtype)` (hot path)
returns a contiguous view of its first bytes as `dtype` shaped `shape`, and raises `WorkspaceError`
(naming the buffer, the needed and the reserved sizes) when the reservation is too small. `get`
never allocates, syncs or creates a CPU tensor. A buffer may be viewed as different dtypes and
shapes by successive users (one name = one piece of memory; each view starts at byte 0, so it
has the caching allocator's 512-byte alignment).

Sharing: layers run one after another, so runners of one role share one `Workspace`
(`for_role(device, role)`): the buffers are sized by the largest user, not summed over 43 layers.
Roles must separate whatever vLLM may run concurrently on different CUDA streams:
  - "main": the routed experts (MoE) and the grouped o-projection (default stream);
  - "shared": the shared-expert MLP (vLLM may run it on a side stream next to the routed experts).
A plain linear keeps a private `Workspace()` (its split-K buffer is at most 64 rows): DSv4 runs
the indexer's wq_b on an aux stream concurrently with the attention's wq_b.

Rules:
  - Runners fetch views per call (`get`), never keep them from warm-up: growing a buffer replaces
    it (views already held keep the old memory alive, so they stay valid, but stale).
  - `reserve()` is refused during CUDA-graph capture, and refused for a buffer that a captured
    graph has used (its address is baked into the graph): all warm-ups (`Runner.warmup(max_tokens)`,
    called by `cutedsl.vllm.linear_kernel.install_runner` at load time) precede capture.
"""

from __future__ import annotations

import math

import torch


class WorkspaceError(RuntimeError):
    """A hot-path request larger than the warm-up reservation, or a reserve at a forbidden time."""


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class Workspace:
    """Named, grow-only byte buffers on one device (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", label: str = "private") -> None:
        self.device = torch.device(device)
        self.label = label
        self._bufs: dict[str, torch.Tensor] = {}
        self._captured: set[str] = set()
        self.reserves = 0  # how many reserve() calls grew a buffer (tests: none after warm-up)

    def reserved(self, name: str) -> int:
        """Bytes reserved for `name` (0 if never reserved)."""
        b = self._bufs.get(name)
        return 0 if b is None else b.numel()

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Warm-up only: make `name` hold at least a `shape` tensor of `dtype` (grow, never shrink).
        Raises WorkspaceError during CUDA-graph capture or when growing a captured buffer."""
        if _capturing(self.device):
            raise WorkspaceError(
                f"workspace {self.label}/{name}: reserve() during CUDA-graph capture; "
                "call Runner.warmup(max_tokens) before capture"
            )
        need = _nbytes(tuple(shape), dtype)
        if need <= self.reserved(name):
            return
        if name in self._captured:
            raise WorkspaceError(
                f"workspace {self.label}/{name}: cannot grow to {need} bytes, a captured CUDA "
                "graph uses it; warm up every runner (max_tokens) before capture"
            )
        self._bufs.pop(name, None)  # free the old one first (views held keep it alive)
        self._bufs[name] = torch.empty(need, dtype=torch.uint8, device=self.device)
        self.reserves += 1

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Hot path: a contiguous `dtype` view shaped `shape` of the first bytes of `name`
        (contents undefined). Never allocates; raises WorkspaceError if the reservation is short."""
        b = self._bufs.get(name)
        need = _nbytes(tuple(shape), dtype)
        have = 0 if b is None else b.numel()
        if b is None or need > have:
            raise WorkspaceError(
                f"workspace {self.label}/{name}: needs {need} bytes for {dtype} {list(shape)}, "
                f"{have} reserved; Runner.warmup(max_tokens) sets the size (more tokens than "
                "warmed up?)"
            )
        if b.is_cuda and name not in self._captured and torch.cuda.is_current_stream_capturing():
            self._captured.add(name)
        return b[:need].view(dtype).view(shape)


_SHARED: dict[tuple[torch.device, str], Workspace] = {}


def for_role(device: torch.device | str, role: str) -> Workspace:
    """The one Workspace of `role` ("main", "shared") on `device`, created empty on first use."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _SHARED.get((device, role))
    if ws is None:
        ws = _SHARED[(device, role)] = Workspace(device, role)
    return ws


def reserve(
    device: torch.device | str, role: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """`for_role(device, role).reserve(name, shape, dtype)`."""
    for_role(device, role).reserve(name, shape, dtype)


def get(
    device: torch.device | str, role: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`for_role(device, role).get(name, shape, dtype)` (hot path)."""
    return for_role(device, role).get(name, shape, dtype)
