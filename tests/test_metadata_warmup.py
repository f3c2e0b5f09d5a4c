"""cutedsl.vllm.metadata_warmup: every specialization of vLLM's DSv4 step-metadata Triton kernels
that their call sites can produce is compiled before serving (the keys computed with Triton's own
specialization function), with the arguments vLLM's call sites pass."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import types

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from cutedsl.vllm import metadata_warmup as mw  # noqa: E402

CTX = mw.Context(max_num_seqs=128, max_num_batched_tokens=8192, window_size=128,
                 compress_ratios=(4, 128, 4, 128, 0))  # fmt: skip


class _Ptr:
    """A pointer argument at a given address (Triton reads data_ptr() and dtype)."""

    def __init__(self, dtype, addr: int = 0):
        self.dtype, self._addr = dtype, addr

    def data_ptr(self) -> int:
        return self._addr


def _spec(args: tuple, constexprs: dict) -> tuple:
    """Triton 3.6's specialization of a call: each runtime argument through
    `native_specialize_impl` (integers: 1 / divisible by 16; pointers: dtype and 16-byte
    alignment), plus the constexprs' values."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor

    def one(a):
        a = MockTensor.wrap_dtype(a)
        return native_specialize_impl(BaseBackend, a, False, True, True)

    return tuple(one(a) for a in args), tuple(sorted(constexprs.items()))


def _warmed(name: str, ctx: mw.Context = CTX) -> set:
    out = set()
    for args, kw in mw.calls(ctx)[name]:
        args = tuple(_Ptr(torch.int32, 4) if a == "unaligned" else a for a in args)
        out.add(_spec(args, kw))
    return out


def test_int_class_is_tritons() -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    want = {("constexpr", 1): "1", ("i32", "D"): "16", ("i32", ""): ""}
    for v in [*range(0, 300), 1023, 1024, 4097]:
        assert mw.int_class(v) == want[native_specialize_impl(BaseBackend, v, False, True, True)], v
    assert [mw.int_class(v) for v in mw.CLASS_MEMBERS] == ["16", "1", ""]
    assert [mw.next_pow2(n) for n in (1, 2, 3, 4, 5, 16, 17, 128, 129)] == [
        1, 2, 4, 4, 8, 16, 32, 128, 256,
    ]  # fmt: skip


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 16, 17, 33, 128, 200])
def test_prefill_metadata_cases_cover_every_reachable_call(max_num_seqs: int) -> None:
    """Exhaustive: every (prefills >= 1, decodes >= 0, sum <= max_num_seqs) call specializes as
    one of the warmed calls, and no warmed call is unreachable or repeated."""
    ctx = mw.Context(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, window_size=128)
    i32 = torch.int32
    reachable = {
        _spec((i32, i32, i32, p, d, 128), {"BLOCK_SIZE": mw.next_pow2(p)})
        for p in range(1, max_num_seqs + 1)
        for d in range(0, max_num_seqs - p + 1)
    }
    warmed = _warmed("_compute_prefill_metadata_kernel", ctx)
    assert warmed == reachable
    cases = mw.prefill_cases(max_num_seqs)
    assert len(cases) == len(warmed)
    assert all(p >= 1 and d >= 0 and p + d <= max_num_seqs for p, d in cases)


def test_prefill_metadata_case_count_and_bad_input() -> None:
    # 128: BLOCK 1 (p = 1), 2, 4, 8 (p not a multiple of 16) and 16..128 (both classes), each
    # with 0, 1 or another number of decodes
    assert len(mw.prefill_cases(128)) == 3 * (1 + 3 + 2 * 4)
    assert mw.prefill_cases(2) == [(1, 0), (1, 1), (2, 0)]  # p = 2 leaves no room for decodes
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        mw.prefill_cases(0)


def test_slot_mapping_cases_cover_every_reachable_call() -> None:
    """Every (num_tokens >= 1, any block-table stride, any block size) call of a KV-cache group
    specializes as one of the warmed calls, with this worker's context-parallel constants."""
    ctx = mw.Context(max_num_seqs=64, max_num_batched_tokens=4096, window_size=128,
                     cp_world_size=2, cp_rank=1, cp_interleave=16)  # fmt: skip
    cp = {"TOTAL_CP_WORLD_SIZE": 2, "TOTAL_CP_RANK": 1, "CP_KV_CACHE_INTERLEAVE_SIZE": 16,
          "PAD_ID": -1, "BLOCK_SIZE": 1024}  # fmt: skip
    i32, i64 = torch.int32, torch.int64
    reachable = {
        _spec((n, 4096, i32, i64, i32, s, b, i64), cp)
        for n in range(1, 70)
        for s in (1, 2, 5, 16, 40, 160, 5120)
        for b in (1, 2, 3, 16, 64, 128, 256)
    }
    warmed = _warmed("_compute_slot_mapping_kernel", ctx)
    assert reachable <= warmed and len(warmed) == len(mw.calls(ctx)["_compute_slot_mapping_kernel"])


def test_prefill_chunk_cases_cover_every_reachable_call() -> None:
    """Every (seq_lens slice at any element offset, 0 <= qs_start < qs_stop) call specializes as
    one of the warmed calls; the kernel is warmed only for a model with compress-ratio-4 layers."""
    i32 = torch.int32
    kw = {"BLOCK_SIZE": 1024, "COMPRESS_RATIO": 4}
    reachable = {
        _spec((i32, _Ptr(i32, 4 * off), i32, i32, i32, i32, a, b), kw)
        for off in range(8)
        for a in range(0, 40)
        for b in range(a + 1, 60)
    }
    warmed = _warmed("_build_prefill_chunk_metadata_kernel")
    assert warmed == reachable
    assert "_build_prefill_chunk_metadata_kernel" not in mw.calls(
        mw.Context(
            max_num_seqs=8, max_num_batched_tokens=64, window_size=128, compress_ratios=(128, 0)
        )  # fmt: skip
    )


def _source(fn) -> str:
    return re.sub(r"\s+", "", inspect.getsource(fn))


def test_the_kernels_and_their_calls_are_vllms() -> None:
    """vLLM 0.21.0's kernels have the parameters the warm-up passes, and their call sites pass
    what the module docstring says."""
    for name, (module, params) in mw.KERNELS.items():
        k = getattr(importlib.import_module(module), name)
        fn = getattr(k, "fn", k)  # a JITFunction on a GPU, the plain function without Triton
        assert tuple(inspect.signature(fn).parameters) == params, name
    from vllm.v1.attention.backends.mla import indexer, sparse_swa
    from vllm.v1.worker import block_table

    swa = _source(sparse_swa.DeepseekSparseSWAMetadataBuilder)
    assert (
        "_compute_prefill_metadata_kernel[(1,)](pfx_gather_lens,seq_lens,query_start_loc,"
        "num_prefills,num_decodes,self.window_size,BLOCK_SIZE=triton.next_power_of_2(num_prefills),)"
    ) in swa
    assert "pfx_gather_lens=torch.empty(num_prefills,dtype=torch.int32" in swa
    slot = _source(block_table.BlockTable.compute_slot_mapping)
    assert (
        "_compute_slot_mapping_kernel[(num_reqs+1,)](num_tokens,self.max_num_batched_tokens,"
        "query_start_loc,positions,self.block_table.gpu,self.block_table.gpu.stride(0),"
        "self.block_size,self.slot_mapping.gpu,TOTAL_CP_WORLD_SIZE=total_cp_world_size,"
        "TOTAL_CP_RANK=total_cp_rank,CP_KV_CACHE_INTERLEAVE_SIZE=self.cp_kv_cache_interleave_size,"
        "PAD_ID=PAD_SLOT_ID,BLOCK_SIZE=1024,)"
    ) in slot
    assert "total_cp_rank=self.pcp_rank*self.dcp_world_size+self.dcp_rank" in slot
    idx = _source(indexer)
    assert (
        "_build_prefill_chunk_metadata_kernel[(num_reqs,)](query_start_loc,"
        "uncompressed_seq_lens[start_idx:end_idx],cu_seq_lens,token_to_seq,cu_seq_len_ks,"
        "cu_seq_len_ke,qs_start,qs_stop,BLOCK_SIZE=1024,COMPRESS_RATIO=compress_ratio,)"
    ) in idx
    # the other pointers are fresh tensors (aligned)
    for fresh in ("token_to_seq=torch.empty(", "cu_seq_lens=torch.empty(",
                  "cu_seq_len_ks=torch.empty(", "cu_seq_len_ke=torch.empty("):  # fmt: skip
        assert fresh in idx
    assert (
        "query_start_loc=(query_start_loc[start_idx:end_idx+1]-query_start_loc[start_idx])" in idx
    )


def _zeros_here(monkeypatch) -> None:
    """warm() makes its unaligned view on "cuda"; on the CPU, make it here."""
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: zeros(*a, **kw))


def test_warm_compiles_each_call(monkeypatch) -> None:
    seen: dict[str, list] = {}

    def kernel(name):
        return types.SimpleNamespace(
            warmup=lambda *a, **kw: seen.setdefault(name, []).append((a, kw))
        )

    kernels = {name: kernel(name) for name in mw.KERNELS}
    kernels["_build_prefill_chunk_metadata_kernel"] = None  # a kernel Triton cannot give: skipped
    _zeros_here(monkeypatch)
    n, failed = mw.warm(CTX, kernels=kernels)
    assert failed == []
    want = mw.calls(CTX)
    names = ("_compute_prefill_metadata_kernel", "_compute_slot_mapping_kernel")
    assert n == sum(len(want[name]) for name in names)
    for name in names:
        got = [(a, {k: v for k, v in kw.items() if k != "grid"}) for a, kw in seen[name]]
        assert got == want[name]
        assert all(kw["grid"] == (1,) for _, kw in seen[name])
    assert "_build_prefill_chunk_metadata_kernel" not in seen


def test_warm_passes_an_unaligned_view_for_the_slice(monkeypatch) -> None:
    got = []
    k = types.SimpleNamespace(warmup=lambda *a, **kw: got.append(a[1]))
    _zeros_here(monkeypatch)
    mw.warm(CTX, kernels={"_build_prefill_chunk_metadata_kernel": k})
    views = [a for a in got if isinstance(a, torch.Tensor)]
    assert len(views) == len(got) // 2 and all(v.data_ptr() % 16 == 4 for v in views)
    assert all(a == torch.int32 for a in got if not isinstance(a, torch.Tensor))


def test_a_failing_kernel_does_not_stop_the_others(monkeypatch) -> None:
    calls = []

    def broken(*a, **kw):
        raise RuntimeError("ptxas died")

    kernels = {
        "_compute_prefill_metadata_kernel": types.SimpleNamespace(warmup=broken),
        "_compute_slot_mapping_kernel": types.SimpleNamespace(
            warmup=lambda *a, **kw: calls.append(a)
        ),
    }
    n, failed = mw.warm(CTX, kernels=kernels)
    assert n == len(calls) == len(mw.calls(CTX)["_compute_slot_mapping_kernel"])
    assert failed == ["_compute_prefill_metadata_kernel: RuntimeError: ptxas died"]


def test_context_from_vllms_config() -> None:
    vcfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=96, max_num_batched_tokens=4096),
        parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1),
    )
    hf = types.SimpleNamespace(sliding_window=128, compress_ratios=[4, 128, 0])
    ctx = mw.context(vcfg, hf)  # no parallel groups initialized here: no context parallelism
    assert ctx == mw.Context(max_num_seqs=96, max_num_batched_tokens=4096, window_size=128,
                             compress_ratios=(4, 128, 0))  # fmt: skip


def test_start_never_raises_and_finish_waits(monkeypatch, caplog) -> None:
    seen = []

    def fake_warm(ctx):
        seen.append(ctx)
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(mw, "warm", fake_warm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        mw.start(CTX)
        mw.finish()
    assert seen == [CTX]
    assert "RuntimeError: ptxas died" in caplog.text and "compile on first use" in caplog.text
    mw.finish()  # nothing started: returns at once


def test_checked_load_warms_on_a_gpu_and_waits_unless_loading_fails(monkeypatch) -> None:
    import vllm.config

    from cutedsl.vllm import checks

    events = []
    vcfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=96, max_num_batched_tokens=4096),
        parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: vcfg)
    monkeypatch.setattr(mw, "start", lambda ctx: events.append(("start", ctx.max_num_seqs)))
    monkeypatch.setattr(mw, "finish", lambda: events.append(("finish",)))

    class Loader:
        def load_weights(self, weights, mapper):
            events.append(("load",))
            for name, _ in weights:
                if name == "bad":
                    raise ValueError("shape mismatch")
            return set()

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(sliding_window=128, compress_ratios=[4, 128])
    assert checks.checked_load(model, Loader(), iter([]), None) == set()
    assert events == [("start", 96), ("load",), ("finish",)]
    events.clear()
    with pytest.raises(ValueError, match="shape mismatch"):
        checks.checked_load(model, Loader(), iter([("bad", torch.zeros(1))]), None)
    assert events == [("start", 96), ("load",)]  # the error is not held back by the warm-up

    events.clear()  # a model without the config: no warm-up, the load as before
    checks.checked_load(torch.nn.Module(), Loader(), iter([]), None)
    assert events == [("load",)]


@pytest.mark.parametrize(("max_num_seqs", "next_n"), [(1, 1), (31, 1), (64, 1), (100, 1), (128, 1),
                                                      (128, 2), (48, 4)])  # fmt: skip
def test_paged_mqa_batches_cover_every_decode_batch(max_num_seqs: int, next_n: int) -> None:
    """Every decode batch a step can build (1 .. max_num_seqs * next_n rows) rounds up to 32 onto
    one of the warmed batches, and each warmed batch is its own class (no repeats, none beyond)."""
    ctx = mw.Context(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, window_size=128,
                     compress_ratios=(4,), block_size=256, next_n=next_n)  # fmt: skip
    got = mw.paged_mqa_batches(ctx)
    classes = {-(-b // 32) * 32 for b in range(1, max_num_seqs * next_n + 1)}
    assert got == sorted(classes)


def test_paged_mqa_alignment_is_deepgemms() -> None:
    """The class width is the template's (vLLM's vendored DeepGEMM header), and the indexer's
    builder calls the function with the arguments warm_deepgemm passes."""
    import pathlib

    import vllm

    cuh = pathlib.Path(vllm.__file__).parent / (
        "third_party/deep_gemm/include/deep_gemm/scheduler/paged_mqa_logits.cuh"
    )
    src = re.sub(r"\s+", " ", cuh.read_text())
    assert "template <uint32_t kAlignedBatchSize, uint32_t SPLIT_KV, uint32_t kNumSMs" in src
    assert f"kAlignedBatchSize % {mw.PAGED_MQA_ALIGN} == 0" in src
    from vllm.v1.attention.backends.mla import indexer

    idx = _source(indexer)
    assert (
        "get_paged_mqa_logits_metadata(seq_lens,self.kv_cache_spec.storage_block_size,"
        "self.num_sms,)"
    ) in idx
    assert "sm_count=num_compute_units(self.device.index)self.num_sms=sm_count" in idx
    assert "ifseq_lens.dim()==1:seq_lens=seq_lens.unsqueeze(-1)" in idx
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=128, dtype=torch.uint8,
                            compress_ratio=mw.INDEXER_RATIO)  # fmt: skip
    assert spec.storage_block_size == 256 // mw.INDEXER_RATIO


def _fake_deepgemm(monkeypatch, available: bool = True) -> list:
    import vllm.platforms
    import vllm.utils.deep_gemm as dg
    import vllm.utils.platform_utils as pu

    calls = []
    monkeypatch.setattr(dg, "has_deep_gemm", lambda: available)
    monkeypatch.setattr(
        dg, "get_paged_mqa_logits_metadata",
        lambda lens, block, sms: calls.append((tuple(lens.shape), lens.dtype, block, sms)),
    )  # fmt: skip
    monkeypatch.setattr(vllm.platforms.current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(pu, "num_compute_units", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        synchronize=lambda: None))  # fmt: skip
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, device=None, **kw: ones(*a, **kw))
    return calls


def test_warm_deepgemm_runs_each_batch_class_as_the_builder(monkeypatch) -> None:
    calls = _fake_deepgemm(monkeypatch)
    ctx = mw.Context(max_num_seqs=128, max_num_batched_tokens=8192, window_size=128,
                     compress_ratios=(4, 128, 0), block_size=256)  # fmt: skip
    assert mw.warm_deepgemm(ctx) == 4
    assert calls == [((b, 1), torch.int32, 64, 132) for b in (32, 64, 96, 128)]
    calls.clear()  # no indexer layer, an unknown block size: nothing
    assert mw.warm_deepgemm(mw.Context(8, 64, 128, compress_ratios=(128, 0), block_size=256)) == 0
    assert mw.warm_deepgemm(mw.Context(8, 64, 128, compress_ratios=(4,))) == 0
    assert calls == []


def test_warm_deepgemm_without_deepgemm(monkeypatch) -> None:
    ctx = mw.Context(max_num_seqs=8, max_num_batched_tokens=64, window_size=128,
                     compress_ratios=(4,), block_size=256)  # fmt: skip
    calls = _fake_deepgemm(monkeypatch, available=False)
    assert mw.warm_deepgemm(ctx) == 0 and calls == []


def test_finish_warms_deepgemm_after_the_thread_and_never_raises(monkeypatch, caplog) -> None:
    ctx = mw.Context(max_num_seqs=8, max_num_batched_tokens=64, window_size=128,
                     compress_ratios=(4,), block_size=256)  # fmt: skip
    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mw, "warm", lambda c: order.append(("triton", c)) or (3, []))
    monkeypatch.setattr(mw, "warm_deepgemm", lambda c: order.append(("deepgemm", c)) or 1)
    with caplog.at_level(logging.INFO):
        mw.start(ctx)
        mw.finish()
    assert order == [("triton", ctx), ("deepgemm", ctx)]
    assert "paged MQA schedule kernel ready for 1 batch classes" in caplog.text

    def broken(c):
        raise RuntimeError("nvcc died")

    monkeypatch.setattr(mw, "warm_deepgemm", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        mw.start(ctx)
        mw.finish()  # does not raise
    assert "RuntimeError: nvcc died" in caplog.text and "compiles on first use" in caplog.text
    order.clear()
    mw.finish()  # nothing started: nothing run
    assert order == []


def test_context_block_size_and_mtp_tokens() -> None:
    vcfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=32, max_num_batched_tokens=2048),
        parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1),
        cache_config=types.SimpleNamespace(block_size=256),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=2),
    )
    hf = types.SimpleNamespace(sliding_window=128, compress_ratios=[4, 0])
    ctx = mw.context(vcfg, hf)
    assert (ctx.block_size, ctx.next_n) == (256, 3)
    vcfg.speculative_config = None
    assert mw.context(vcfg, hf).next_n == 1
