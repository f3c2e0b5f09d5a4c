"""cutedsl.vllm.metadata_warmup: every specialization of vLLM's prefill-metadata Triton kernel that
a scheduler can produce is compiled before serving (the keys computed with Triton's own
specialization function), with the arguments vLLM's call site passes."""

from __future__ import annotations

import inspect
import logging
import re
import types

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from cutedsl.vllm import metadata_warmup as mw  # noqa: E402

WINDOW = 128  # DSv4's sliding_window


def _triton_key(p: int, d: int, window: int = WINDOW) -> tuple:
    """The specialization Triton 3.6 gives vLLM's call with p prefills and d decodes: each
    argument through `native_specialize_impl` (the three int32 tensors are whole, aligned
    buffers), plus the constexpr BLOCK_SIZE."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor

    args = (MockTensor(torch.int32),) * 3 + (p, d, window)
    spec = tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)
    return spec, 1 << (p - 1).bit_length()


def test_int_class_is_tritons() -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    want = {("constexpr", 1): "1", ("i32", "D"): "16", ("i32", ""): ""}
    for v in [*range(0, 300), 1023, 1024, 4097]:
        assert mw.int_class(v) == want[native_specialize_impl(BaseBackend, v, False, True, True)], v
    assert [mw.next_pow2(n) for n in (1, 2, 3, 4, 5, 16, 17, 128, 129)] == [
        1, 2, 4, 4, 8, 16, 32, 128, 256,
    ]  # fmt: skip


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 16, 17, 33, 128, 200])
def test_cases_cover_every_reachable_specialization(max_num_seqs: int) -> None:
    """Exhaustive: every (prefills >= 1, decodes >= 0, sum <= max_num_seqs) gives a Triton key
    that one of the cases gives, and the cases give no key twice and none unreachable."""
    reachable = {
        _triton_key(p, d)
        for p in range(1, max_num_seqs + 1)
        for d in range(0, max_num_seqs - p + 1)
    }
    cases = mw.cases(max_num_seqs)
    warmed = [_triton_key(p, d) for p, d in cases]
    assert set(warmed) == reachable
    assert len(warmed) == len(set(warmed))
    assert all(p >= 1 and d >= 0 and p + d <= max_num_seqs for p, d in cases)


def test_cases_count_and_bad_input() -> None:
    # 128: BLOCK 1 (p = 1), 2, 4, 8 (p not a multiple of 16) and 16..128 (both classes), each
    # with 0, 1 or another number of decodes
    assert len(mw.cases(128)) == 3 * (1 + 3 + 2 * 4)
    # 2: p = 1 with 0 or 1 decodes, p = 2 with none
    assert mw.cases(2) == [(1, 0), (1, 1), (2, 0)]
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        mw.cases(0)


def test_the_kernel_and_its_call_are_vllms() -> None:
    """vLLM 0.21.0's kernel has the parameters warm() passes, and its builder calls it with
    (prefills, decodes, window) and BLOCK_SIZE = next_power_of_2(prefills), as assumed."""
    from vllm.v1.attention.backends.mla import sparse_swa

    k = sparse_swa._compute_prefill_metadata_kernel
    fn = getattr(k, "fn", k)  # a JITFunction on a GPU, the plain function without Triton
    assert tuple(inspect.signature(fn).parameters) == mw.KERNEL_PARAMS
    src = re.sub(r"\s+", "", inspect.getsource(sparse_swa.DeepseekSparseSWAMetadataBuilder))
    call = (
        "_compute_prefill_metadata_kernel[(1,)](pfx_gather_lens,seq_lens,query_start_loc,"
        "num_prefills,num_decodes,self.window_size,BLOCK_SIZE=triton.next_power_of_2(num_prefills),)"
    )
    assert call in src
    # the tensors are whole buffers (aligned): a fresh one and the common metadata's own
    assert "pfx_gather_lens=torch.empty(num_prefills,dtype=torch.int32" in src


def test_warm_compiles_each_case_with_vllms_arguments() -> None:
    calls = []
    kernel = types.SimpleNamespace(warmup=lambda *a, **kw: calls.append((a, kw)))
    assert mw.warm(20, WINDOW, kernel=kernel) == len(mw.cases(20)) == len(calls)
    for (p, d), (args, kw) in zip(mw.cases(20), calls):
        assert args == (torch.int32, torch.int32, torch.int32, p, d, WINDOW)
        assert kw == {"BLOCK_SIZE": mw.next_pow2(p), "grid": (1,)}


def test_warm_without_triton_does_nothing(monkeypatch) -> None:
    monkeypatch.setattr(mw, "_kernel", lambda: None)
    assert mw.warm(128, WINDOW) == 0


def test_start_never_raises_and_finish_waits(monkeypatch, caplog) -> None:
    seen = []

    def fake_warm(max_num_seqs, window):
        seen.append((max_num_seqs, window))
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(mw, "warm", fake_warm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        mw.start(64, WINDOW)
        mw.finish()
    assert seen == [(64, WINDOW)]
    assert "RuntimeError: ptxas died" in caplog.text and "compiles on first use" in caplog.text
    mw.finish()  # nothing started: returns at once


def test_checked_load_warms_on_a_gpu_and_waits_even_when_loading_fails(monkeypatch) -> None:
    import vllm.config

    from cutedsl.vllm import checks

    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config",
                        lambda: types.SimpleNamespace(
                            scheduler_config=types.SimpleNamespace(max_num_seqs=96)))  # fmt: skip
    monkeypatch.setattr(mw, "start", lambda n, w: events.append(("start", n, w)))
    monkeypatch.setattr(mw, "finish", lambda: events.append(("finish",)))

    class Loader:
        def load_weights(self, weights, mapper):
            events.append(("load",))
            for name, _ in weights:
                if name == "bad":
                    raise ValueError("shape mismatch")
            return set()

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(sliding_window=WINDOW)
    assert checks.checked_load(model, Loader(), iter([]), None) == set()
    assert events == [("start", 96, WINDOW), ("load",), ("finish",)]
    events.clear()
    with pytest.raises(ValueError, match="shape mismatch"):
        checks.checked_load(model, Loader(), iter([("bad", torch.zeros(1))]), None)
    assert events == [("start", 96, WINDOW), ("load",), ("finish",)]

    events.clear()  # a model without the config: no warm-up, the load as before
    checks.checked_load(torch.nn.Module(), Loader(), iter([]), None)
    assert events == [("load",)]
