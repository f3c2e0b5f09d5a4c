"""What every runner shares: backend choice from an explicit table, op registration, warm-up.

A runner is built once per layer from checkpoint-layout tensors (weights prepared for its backend
then, never per call), and called through its torch.library op (`cutedsl.ops`), so torch.compile
sees one opaque op and CUDA graphs capture only the backend's kernels. `run()` is the op body:
checks, the M == 0 early return, then the backend.

Each public runner names its other implementations in `impls` (backend name -> class taking
the runner: the sm90 and sm100 kernels, and sm100-emulated); "reference" is the runner's own
`_reference`. Input checks: `cutedsl.validate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from cutedsl import ops
from cutedsl.backends import BackendUnavailableError, select_backend


class Runner:
    """Base: subclasses set their static facts and `impls`, define `_reference`, and call
    `_setup(device, backend)`."""

    impls: Mapping[str, Callable[[Runner], Callable]]
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

    def _make_impl(self, backend: str) -> Callable:
        """A callable with `run`'s signature for `backend`; GPU backends prepare weights here."""
        if backend == "reference":
            return self._reference
        impl = self.impls.get(backend)
        if impl is None:
            raise BackendUnavailableError(
                f"cutedsl backend {backend!r} has no {type(self).__name__} implementation"
            )
        return impl(self)

    def warmup(self, max_tokens: int) -> None:
        """Compile every kernel this runner will need for up to `max_tokens` rows (all CUDA-graph
        capture sizes) and reserve its workspace; call before capture. Nothing to do for the
        reference backend."""
        warm = getattr(self._impl, "warmup", None)
        if warm is not None:
            warm(max_tokens)
