"""`cutedsl.vllm.prefetch.kernel_jobs`: from a built (not yet loaded) model, the kernels each
runner's warm-up will compile, read off the layers' checkpoint-layout parameter shapes. CPU: the
layers are stand-in modules carrying our real method classes; the sm90 backend and an H200 are
assumed (the backend choice is read per layer device)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from cutedsl import grouped_oproj  # noqa: E402
from cutedsl.sm90 import runners, tactics  # noqa: E402
from cutedsl.vllm import prefetch  # noqa: E402
from cutedsl.vllm.linear_kernel import CuTeDSLNvFp4LinearMethod  # noqa: E402
from cutedsl.vllm.moe_experts import CuTeDSLModelOptNvFp4FusedMoE  # noqa: E402
from cutedsl.vllm.shared_mlp import CuTeDSLSharedMlpMethod  # noqa: E402

H200 = tactics.GpuSpec("NVIDIA H200", 132)


def _linear(n: int, k: int, max_tokens: int, groups: int | None = None) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.empty(n, k // 2, dtype=torch.uint8), requires_grad=False)
    method = object.__new__(CuTeDSLNvFp4LinearMethod)
    method.kernel = types.SimpleNamespace(max_tokens=max_tokens)
    m.quant_method = method
    if groups is not None:
        m.is_bmm, m.bmm_batch_size = True, groups
    return m


def _model(max_tokens: int) -> torch.nn.Module:
    h, i, e, g, r, d = 2048, 512, 16, 4, 256, 512
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(head_dim=128)  # the hf_config: wo_a's inverse RoPE
    model.wq_b = _linear(4096, 1024, max_tokens)
    model.wo_a = _linear(g * r, d, max_tokens, groups=g)
    mlp = torch.nn.Module()
    mlp.gate_up_proj = _linear(2 * i, h, max_tokens)
    mlp.down_proj = _linear(h, i, max_tokens)
    mlp.gate_up_proj.cutedsl_fused = mlp.down_proj.cutedsl_fused = True  # as shared_mlp_method does
    shared = object.__new__(CuTeDSLSharedMlpMethod)
    shared.swiglu_limit, shared.max_tokens = 10.0, max_tokens
    mlp.quant_method = shared
    model.mlp = mlp
    moe = torch.nn.Module()
    moe.w2_weight = torch.nn.Parameter(torch.empty(e, h, i // 2, dtype=torch.uint8), False)
    moe.quant_method = object.__new__(CuTeDSLModelOptNvFp4FusedMoE)
    moe.swiglu_limit = 10.0
    moe.vllm_config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens)
    )
    model.moe = moe
    return model


def _keys(jobs) -> set:
    return {(j.build.__module__, j.build.__qualname__, j.args, j.kwargs) for j in jobs}


@pytest.mark.parametrize("max_tokens", [1, 256, 8192])
def test_jobs_are_what_the_warmups_compile(max_tokens: int, monkeypatch) -> None:
    monkeypatch.setattr(prefetch, "select_backend", lambda device: "sm90")
    monkeypatch.setattr(tactics, "gpu_spec", lambda device: H200)
    got = _keys(prefetch.kernel_jobs(_model(max_tokens)))
    want = _keys(
        runners.linear_jobs(4096, 1024, 1, max_tokens, H200)
        + runners.linear_jobs(256, 512, 4, max_tokens, H200)
        + runners.shared_mlp_jobs(2048, 512, 10.0, max_tokens, H200)
        + runners.moe_jobs(16, 2048, 512, 10.0, max_tokens, H200)
        + [grouped_oproj.rope_job(128)]
    )
    assert got == want
    assert ("cutedsl.sm90.swiglu", "_build", (10.0,), ()) in got
    # wo_a is planned with its groups: the grouped tactic set, not the dense one of N = G*R
    wo_a = _keys(runners.linear_jobs(256, 512, 4, max_tokens, H200))
    assert wo_a <= got


def test_fused_linears_get_no_jobs_of_their_own(monkeypatch) -> None:
    """A linear run by the fused shared-expert runner builds no runner, so nothing may be
    compiled for it (a compile worker nobody waits for would still run after the server is up)."""
    monkeypatch.setattr(prefetch, "select_backend", lambda device: "sm90")
    monkeypatch.setattr(tactics, "gpu_spec", lambda device: H200)
    model = torch.nn.Module()
    model.gate_up_proj = _linear(1024, 2048, 256)
    assert prefetch.kernel_jobs(model)
    model.gate_up_proj.cutedsl_fused = True
    assert prefetch.kernel_jobs(model) == []


def test_other_backends_get_no_jobs(monkeypatch) -> None:
    monkeypatch.setattr(prefetch, "select_backend", lambda device: "sm100")
    assert prefetch.kernel_jobs(_model(64)) == []


def test_start_never_raises(monkeypatch) -> None:
    def broken(model):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(prefetch, "kernel_jobs", broken)
    prefetch.start(torch.nn.Module())  # logs, does not raise


def test_our_log_lines_go_through_vllms_handler() -> None:
    """Inside vLLM, an INFO line of a cutedsl module reaches vLLM's handler (formatted like vLLM's
    own lines), not Python's last-resort handler, which drops INFO."""
    import logging

    import cutedsl.vllm  # noqa: F401

    theirs = logging.getLogger("vllm")
    assert theirs.handlers, "vLLM's logging is not configured in this test process"
    seen: list[logging.LogRecord] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    probe = Probe()
    theirs.addHandler(probe)
    ours = logging.getLogger("cutedsl")
    ours.addHandler(
        probe
    )  # the handler list was copied at import; a probe on both sees either path
    try:
        logging.getLogger("cutedsl.vllm.prefetch").info("probe %d", 7)
    finally:
        theirs.removeHandler(probe)
        ours.removeHandler(probe)
    assert [r.getMessage() for r in seen] == ["probe 7"]
    assert set(theirs.handlers) <= set(ours.handlers) and not ours.propagate
