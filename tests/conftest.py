"""Test-suite plumbing.

- GPU-marked tests (gpu, sm90, sm100) skip at collection with the reason, never halfway through.
- `--require-gpu-tests` (what `make test-gpu` passes; or CUTEDSL_REQUIRE_GPU_TESTS=1) turns a
  run in which no GPU-marked test ran into a failure: skipped is not green.
- Every test starts with torch's and Python's global RNGs seeded from a fresh per-test seed (or
  CUTEDSL_TEST_SEED); a failed test's report says which, so the failure can be reproduced.
  Tests that seed their own generators keep their seeds.
"""

from __future__ import annotations

import os
import random

import pytest

GPU_MARKS = ("gpu", "sm90", "sm100")
SEED_ENV = "CUTEDSL_TEST_SEED"
REQUIRE_ENV = "CUTEDSL_REQUIRE_GPU_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu-tests",
        action="store_true",
        default=os.environ.get(REQUIRE_ENV, "") not in ("", "0"),
        help="fail the run when no test marked gpu/sm90/sm100 ran (make test-gpu sets it)",
    )


def _device_capability() -> tuple[int, int] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cap = _device_capability()
    if cap is None:
        no_gpu = pytest.mark.skip(
            reason="needs a CUDA GPU; none visible (torch.cuda.is_available() is False)"
        )
    for item in items:
        if cap is None and any(m in item.keywords for m in GPU_MARKS):
            item.add_marker(no_gpu)
            continue
        if "sm100" in item.keywords and cap is not None and cap[0] != 10:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs an SM100 (Blackwell) GPU; this one is sm_{cap[0]}{cap[1]}"
                )
            )
        if "sm90" in item.keywords and cap is not None and cap[0] != 9:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs an SM90 (Hopper) GPU; this one is sm_{cap[0]}{cap[1]}"
                )
            )


# ------------------------------------------------------------------------------ GPU tests ran?

_gpu_ran: dict[str, int] = {"ran": 0, "skipped": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not any(m in report.keywords for m in GPU_MARKS):
        return
    if report.when == "call":
        _gpu_ran["ran"] += 1
    elif report.when == "setup" and report.skipped:
        _gpu_ran["skipped"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("--require-gpu-tests"):
        return
    if _gpu_ran["ran"] == 0 and exitstatus in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = (
            f"--require-gpu-tests: no GPU test ran ({_gpu_ran['skipped']} skipped); "
            "this is not a pass"
        )
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(msg, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------------------ seeds


def _seed_for(nodeid: str) -> int:
    env = os.environ.get(SEED_ENV, "").strip()
    if env:
        try:
            return int(env, 0)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={env!r} is not an integer") from None
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


@pytest.fixture(autouse=True)
def _seed_rngs(request: pytest.FixtureRequest) -> int:
    """Seed torch's and Python's global RNGs for this test; the seed is in a failure's report."""
    seed = _seed_for(request.node.nodeid)
    request.node.cutedsl_seed = seed
    random.seed(seed)
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.manual_seed(seed)
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    seed = getattr(item, "cutedsl_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"seed={seed} ({SEED_ENV}={seed} to reproduce)"))
    return report
