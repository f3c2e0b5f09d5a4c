"""Marker handling: GPU tests skip at collection with the reason, never halfway through a test."""

from __future__ import annotations

import pytest


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
        if cap is None and any(m in item.keywords for m in ("gpu", "sm90", "sm100")):
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


@pytest.fixture
def emulated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the launchers' own code on the CPU with each kernel replaced by its torch statement
    (`expected_quant` / `emulate_gemm`), so buffer sizes, views and alphas are exercised."""

    import torch

    from cutedsl.sm100 import emulate
    from cutedsl.sm100 import gemm as launchers

    def quant(x, gs, padded_t, q, sf):
        eq, esf = emulate.expected_quant(x, gs, padded_t)
        q.copy_(eq)
        sf.copy_(esf.view(torch.uint8))

    def gemm(a, a_sf, b, b_sf, alpha, out, **kw):
        emulate.emulate_gemm(
            a, a_sf.view(torch.float8_e4m3fn), b, b_sf.view(torch.float8_e4m3fn), alpha, out, **kw
        )

    # `linear` / `grouped` / `moe` look both up as globals of cutedsl.sm100.gemm at call time.
    monkeypatch.setattr(launchers, "quantize_act", quant)
    monkeypatch.setattr(launchers, "gemm", gemm)
