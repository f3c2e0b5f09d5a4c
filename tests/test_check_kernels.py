"""Every CuTeDSL kernel compiles for its arch on this GPU-less machine and shows the expected MMA."""

from __future__ import annotations

import pytest

from cutedsl.kernels.checks import KERNEL_MODULES
from cutedsl.tools import check_kernels

TARGETS = check_kernels.collect()


def test_every_arch_has_targets() -> None:
    archs = {t.arch for _, t in TARGETS}
    assert archs == {"sm_90a", "sm_100a"}, archs
    assert {m for m, _ in TARGETS} == set(KERNEL_MODULES)


@pytest.mark.parametrize(("module", "target"), TARGETS, ids=[t.name for _, t in TARGETS])
def test_compiles_and_shows_instructions(module: str, target: check_kernels.KernelTarget) -> None:
    r = check_kernels.run_target(module, target)
    assert r.ok, f"{target.name} ({target.arch}): {r.error or 'missing ' + ', '.join(r.missing)}"


def test_a_missing_instruction_fails() -> None:
    """The check bites: a pattern that cannot occur makes a real compile fail the check."""
    import dataclasses

    module, target = TARGETS[0]
    bogus = dataclasses.replace(target, ptx_patterns=(*target.ptx_patterns, r"no_such_instruction"))
    r = check_kernels.run_target(module, bogus)
    assert not r.ok and "no_such_instruction" in r.missing


def test_a_register_limit_fails() -> None:
    """The register check bites: a limit below the kernel's real count fails the check."""
    import dataclasses

    module, target = next((m, t) for m, t in TARGETS if m == "cutedsl.sm90.kernels.gemm")
    tight = dataclasses.replace(target, max_registers=16)
    r = check_kernels.run_target(module, tight)
    assert not r.ok and any("<= 16 registers" in x for x in r.missing), r


def test_a_forbidden_instruction_fails() -> None:
    """The absence check bites: forbidding an instruction the kernel uses fails the check."""
    import dataclasses

    module, target = next((m, t) for m, t in TARGETS if m == "cutedsl.sm90.kernels.stream")
    forbid = dataclasses.replace(target, absent_patterns=(r"mma\.sync\.aligned",))
    r = check_kernels.run_target(module, forbid)
    assert not r.ok and r.missing == [r"no PTX mma\.sync\.aligned"], r
