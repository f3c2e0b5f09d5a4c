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


# --------------------------------------------------------------- prefill gather kernels


class _Cache(_Ptr):
    """A KV cache argument: uint8, a block stride, an address."""

    def __init__(self, block_stride: int, addr: int = 0):
        super().__init__(torch.uint8, addr)
        self._stride = block_stride

    def stride(self, dim: int) -> int:
        assert dim == 0
        return self._stride

    def dim(self) -> int:
        return 3


def _layer(ratio: int, table_stride: int = 40, swa_table_stride: int = 40, topk: int = 512):
    return mw.GatherLayer(
        compress_ratio=ratio, window_size=128, head_dim=512, max_model_len=10240,
        max_num_batched_tokens=8192, topk_width=topk, swa_block_size=64,
        swa_table_width=swa_table_stride, swa_table_stride=swa_table_stride,
        **({} if ratio <= 1 else {"block_size": 256, "table_width": table_stride,
                                  "table_stride": table_stride}),
    )  # fmt: skip


def _reachable_gather(layer: mw.GatherLayer, swa_cache, cache) -> set:
    """Every specialization `_forward_prefill` (deepseek_v4_attention.py) and the two launchers
    (cache_utils.py) produce, modelled call by call: decodes before the prefills 0..7, prefills
    1..9 in chunks of PREFILL_CHUNK_SIZE, query rows 0..7 into each chunk's top-k slice."""
    i32, bf16 = torch.int32, torch.bfloat16
    base = 1 << 20  # every buffer starts aligned; slices move the address
    c = mw.GATHER_CONSTANTS
    swa_only = layer.compress_ratio <= 1
    n = 0 if swa_only else -(-layer.max_model_len // layer.compress_ratio)
    if swa_only or layer.compress_ratio == 4:
        top_k, width = (0 if swa_only else layer.topk_width), layer.topk_width
    else:
        top_k = width = -(-n // 128) * 128  # FlashMLASparseMetadataBuilder.c128a_max_compressed
    m = n + layer.window_size + layer.max_num_batched_tokens
    d = layer.head_dim
    combined = -(-(top_k + layer.window_size) // 128) * 128
    out = set()
    for decodes in range(8):
        for prefills in range(1, 10):
            for cs in range(0, prefills, 4):
                row = decodes + cs
                if not swa_only:
                    table = _Ptr(i32, base + 4 * layer.table_stride * row)
                    kw = {"max_blocks_per_seq": layer.table_width, "cache_block_size":
                          layer.block_size // layer.compress_ratio,
                          "block_stride": cache.stride(0), **c}  # fmt: skip
                    out.add(_spec((bf16, m * d, d, cache, i32, table, 0, None), kw))
                seq = _Ptr(i32, base + 4 * row)  # prefill_seq_lens = seq_lens[num_decodes:]
                gl = _Ptr(i32, base + 4 * cs)  # fresh pfx_gather_lens
                table = _Ptr(i32, base + 4 * layer.swa_table_stride * row)
                kw = {"max_blocks_per_seq": layer.swa_table_width,
                      "cache_block_size": layer.swa_block_size,
                      "block_stride": swa_cache.stride(0), **c}  # fmt: skip
                out.add(_spec((bf16, m * d, d, swa_cache, seq, table, n, gl), kw))
                kw = {"TOP_K": top_k, "COMPRESS_RATIO": layer.compress_ratio,
                      "WINDOW_SIZE": layer.window_size, "PADDED_TOP_K": mw.next_pow2(width)}  # fmt: skip
                for qrow in range(8):
                    topk = _Ptr(
                        i32,
                        base
                        + 4
                        * width
                        * (qrow if top_k and not (layer.compress_ratio == 4) else decodes + qrow),
                    )
                    qsl = _Ptr(i32, base + 4 * row)
                    args = (i32, combined, i32, topk, width, qsl, seq, gl, m, n)
                    out.add(_spec(args, kw))
    return out


def _warmed_gather(layer, swa_cache, cache) -> set:
    out = set()
    for _name, args, kw in mw.gather_calls(layer, swa_cache, cache):
        args = tuple(_Ptr(torch.int32, 4) if isinstance(a, str) else a for a in args)
        out.add(_spec(args, kw))
    return out


@pytest.mark.parametrize("ratio", [4, 128, 1])
@pytest.mark.parametrize(("table_stride", "topk"), [(40, 512), (41, 512), (40, 1022)])
def test_gather_calls_cover_every_reachable_call(ratio: int, table_stride: int, topk: int) -> None:
    """C4, C128 and sliding-window-only layers, block tables whose rows keep 16-byte alignment or
    not, a top-k width that does not: the warmed specializations are exactly the reachable ones."""
    layer = _layer(ratio, table_stride=table_stride, swa_table_stride=table_stride, topk=topk)
    swa_cache, cache = _Cache(37440), _Cache(18688)
    assert _warmed_gather(layer, swa_cache, cache) == _reachable_gather(layer, swa_cache, cache)
    calls = mw.gather_calls(layer, swa_cache, cache)
    assert len(calls) == len(_warmed_gather(layer, swa_cache, cache))  # none twice


def test_gather_kernels_and_call_sites_are_vllms() -> None:
    for name, (module, params) in mw.GATHER_KERNELS.items():
        k = getattr(importlib.import_module(module), name)
        fn = getattr(k, "fn", k)
        assert tuple(inspect.signature(fn).parameters) == params, name
    from vllm.model_executor.layers import deepseek_v4_attention as attn
    from vllm.v1.attention.backends.mla import flashmla_sparse, sparse_swa
    from vllm.v1.attention.ops.deepseek_v4_ops import cache_utils

    assert attn.PREFILL_CHUNK_SIZE == 4  # the gather lengths' chunk slices stay aligned
    # the overlay warms from forward, before the step's prefill and decode run
    fwd = re.sub(
        r"\s+", "", re.sub(r"#[^\n]*", "", inspect.getsource(attn.DeepseekV4MLAAttention.forward))
    )
    hook = (
        "ifnotself._gather_warm:self._gather_warm=warm_prefill_gather(self,q,flashmla_metadata,"
        "swa_metadata,self_kv_cache,swa_kv_cache)"
    )
    assert hook in fwd and fwd.index(hook) < fwd.index("ifnum_prefills>0:")
    from vllm.v1.worker import workspace

    # the BF16 workspace the gather writes: each view at a 256-byte offset (aligned)
    assert "aligned_bytes=[round_up(actual,256)foractualinactual_bytes]" in _source(workspace)
    pre = _source(attn.DeepseekV4MLAAttention._forward_prefill)
    for want in (
        "M=N+self.window_size+self.max_num_batched_tokens",
        "N=(self.max_model_len+self.compress_ratio-1)//self.compress_ratio",
        "kv=workspace_manager.get_simultaneous(((PREFILL_CHUNK_SIZE,M,q.shape[-1]),torch.bfloat16),)[0]",
        "dequantize_and_gather_k_cache(kv[:chunk_size],compressed_k_cache,seq_lens=seq_lens["
        "chunk_start:chunk_end]//self.compress_ratio,gather_lens=None,block_table=block_table["
        "chunk_start:chunk_end],block_size=attn_metadata.block_size//self.compress_ratio,offset=0,)",
        "block_table=attn_metadata.block_table[num_decodes:]",
        "dequantize_and_gather_k_cache(kv[:chunk_size],swa_k_cache,seq_lens=seq_lens[chunk_start:"
        "chunk_end],gather_lens=gather_lens[chunk_start:chunk_end],block_table=swa_block_table["
        "chunk_start:chunk_end],block_size=swa_metadata.block_size,offset=N,)",
        "swa_block_table=swa_metadata.block_table[num_decodes:]",
        "combine_topk_swa_indices(topk_indices[query_start:query_end],query_start_loc[num_decodes+"
        "chunk_start:num_decodes+chunk_end+1],seq_lens[chunk_start:chunk_end],gather_lens["
        "chunk_start:chunk_end],self.window_size,self.compress_ratio,top_k,M,N,)",
        "topk_indices=self.topk_indices_buffer[num_decode_tokens:]",
        "topk_indices=attn_metadata.c128a_prefill_topk_indices",
        "top_k=topk_indices.shape[-1]",
    ):  # fmt: skip
        assert want in pre, want
    swa = _source(sparse_swa)
    assert 'result["prefill_seq_lens"]=seq_lens[num_decodes:]' in swa
    assert 'result["prefill_gather_lens"]=pfx_gather_lens' in swa
    cu = _source(cache_utils)
    for want in (
        "_dequantize_and_gather_k_kernel[(num_reqs,NUM_WORKERS)](out,out.stride(0),out.stride(1),"
        "k_cache,seq_lens,block_table,offset,gather_lens,max_blocks_per_seq=block_table.shape[-1],"
        "fp8_dim=TOKEN_FP8_DIM,bf16_dim=TOKEN_BF16_DIM,scale_dim=TOKEN_SCALE_DIM,quant_block="
        "QUANT_BLOCK_SIZE,cache_block_size=block_size,token_data_size=TOKEN_DATA_SIZE,block_stride="
        "k_cache.stride(0),output_dim=512,fp8_max=FP8_MAX,n_quant_blocks=7,)",
        "TOKEN_FP8_DIM=448TOKEN_BF16_DIM=64TOKEN_SCALE_DIM=8QUANT_BLOCK_SIZE=64FP8_MAX=448.0"
        "TOKEN_DATA_SIZE=TOKEN_FP8_DIM+TOKEN_BF16_DIM*2",
        "_combine_topk_swa_indices_kernel[(num_reqs,NUM_WORKERS)](combined_indices,"
        "combined_indices.stride(0),combined_lens,topk_indices,topk_indices.stride(0),"
        "query_start_loc,seq_lens,gather_lens,M,N,TOP_K=topk,COMPRESS_RATIO=compress_ratio,"
        "WINDOW_SIZE=window_size,PADDED_TOP_K=triton.next_power_of_2(topk_indices.shape[-1]),)",
        "combined_topk=((topk+window_size+_SPARSE_PREFILL_TOPK_ALIGNMENT-1)"
        "//_SPARSE_PREFILL_TOPK_ALIGNMENT*_SPARSE_PREFILL_TOPK_ALIGNMENT)",
        "combined_indices=torch.full(", "combined_lens=torch.empty(",
    ):  # fmt: skip
        assert want in cu, want
    assert cache_utils._SPARSE_PREFILL_TOPK_ALIGNMENT == mw.SPARSE_PREFILL_TOPK_ALIGNMENT
    fms = _source(flashmla_sparse)
    assert (
        "_C128A_TOPK_ALIGNMENT=128c128a_max_compressed=cdiv(self.model_config.max_model_len,"
        "self.compress_ratio)c128a_max_compressed=(cdiv(c128a_max_compressed,_C128A_TOPK_ALIGNMENT)"
        "*_C128A_TOPK_ALIGNMENT)" in fms
    )
    assert (
        "self.c128a_prefill_buffer=torch.empty((max_num_batched_tokens,c128a_max_compressed),"
        in fms
    )
    assert "prefill_local=prefill_buffer[:num_prefill_tokens]" in fms


def _attn_layer(ratio: int):
    return types.SimpleNamespace(
        compress_ratio=ratio, window_size=128, max_model_len=10240, max_num_batched_tokens=8192,
        topk_indices_buffer=torch.empty(8, 512, dtype=torch.int32),
    )  # fmt: skip


def _meta(width: int = 40, block_size: int = 256):
    return types.SimpleNamespace(block_size=block_size,
                                 block_table=torch.zeros(4, width, dtype=torch.int32))  # fmt: skip


def test_warm_prefill_gather_compiles_each_layout_once(monkeypatch, caplog) -> None:
    seen = []
    k = types.SimpleNamespace(warmup=lambda *a, **kw: seen.append((a, kw)))
    monkeypatch.setattr(mw, "_kernel", lambda name: k)
    monkeypatch.setattr(mw, "_gather_done", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _zeros_here(monkeypatch)
    swa_cache, cache = (
        torch.zeros(3, 4, 8, dtype=torch.uint8),
        torch.zeros(3, 2, 8, dtype=torch.uint8),
    )
    q = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    layer = _attn_layer(4)
    with caplog.at_level(logging.INFO):
        assert mw.warm_prefill_gather(layer, q, _meta(), _meta(block_size=64), cache, swa_cache)
    want = mw.gather_calls(mw.GatherLayer(4, 128, 512, 10240, 8192, 512, 64, 40, 40, 256, 40, 40),
                           swa_cache, cache)  # fmt: skip
    assert len(seen) == len(want) > 0
    for (args, kw), (_, wargs, wkw) in zip(seen, want):
        assert kw.pop("grid") == (1, 1) and kw == wkw
        for a, w in zip(args, wargs):
            if isinstance(w, str):  # the unaligned int32 view
                assert a.dtype == torch.int32 and a.data_ptr() % 16 == 4
            else:
                assert a is w or a == w
    assert "prefill gather kernels ready for the compress-ratio-4 layers" in caplog.text
    seen.clear()  # another layer of the same layout: nothing more
    assert mw.warm_prefill_gather(
        _attn_layer(4), q, _meta(), _meta(block_size=64), cache, swa_cache
    )
    assert seen == []


def test_warm_prefill_gather_waits_for_caches_and_capture_and_never_raises(monkeypatch, caplog):
    monkeypatch.setattr(mw, "_gather_done", set())
    q = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    swa_cache = torch.zeros(3, 4, 8, dtype=torch.uint8)
    unbound = torch.tensor([])
    # caches not bound, no metadata of a compressed layer: not yet
    assert not mw.warm_prefill_gather(_attn_layer(4), q, _meta(), _meta(), unbound, swa_cache)
    assert not mw.warm_prefill_gather(_attn_layer(4), q, None, _meta(), swa_cache, swa_cache)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not mw.warm_prefill_gather(_attn_layer(1), q, None, _meta(), None, swa_cache)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken(*a, **kw):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(mw, "_kernel", lambda name: types.SimpleNamespace(warmup=broken))
    with caplog.at_level(logging.WARNING):  # a sliding-window-only layer: no compressed cache
        assert mw.warm_prefill_gather(_attn_layer(1), q, None, _meta(), None, swa_cache)
    assert "RuntimeError: ptxas died" in caplog.text and "compile on first use" in caplog.text


def test_each_warmed_kernel_is_loaded_with_its_launcher(monkeypatch) -> None:
    """warm() and warm_prefill_gather() build each specialization's launcher (Triton builds it
    on the first launch otherwise: a C compile mid-serving); a warmup that returns nothing
    (no CompiledKernel) is left at that."""
    inits = []

    class Compiled:
        def _init_handles(self):
            inits.append(self)

    k = types.SimpleNamespace(warmup=lambda *a, **kw: Compiled())
    _zeros_here(monkeypatch)
    n, failed = mw.warm(CTX, kernels={name: k for name in mw.KERNELS})
    assert failed == [] and n == len(inits) > 0
    inits.clear()
    monkeypatch.setattr(mw, "_kernel", lambda name: k)
    monkeypatch.setattr(mw, "_gather_done", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    swa_cache = torch.zeros(3, 4, 8, dtype=torch.uint8)
    assert mw.warm_prefill_gather(_attn_layer(1), q, None, _meta(), None, swa_cache)
    assert len(inits) == len(mw.gather_calls(
        mw.GatherLayer(1, 128, 512, 10240, 8192, 512, 256, 40, 40), swa_cache, None))  # fmt: skip
    bare = types.SimpleNamespace(warmup=lambda *a, **kw: None)
    assert mw.warm(CTX, kernels={"_compute_slot_mapping_kernel": bare})[1] == []


def test_tritons_warmup_returns_the_kernel_and_init_builds_the_launcher() -> None:
    """Triton 3.6 (torch 2.11's): JITFunction.warmup returns run(warmup=True)'s CompiledKernel,
    whose _init_handles creates the launcher and loads the binary."""
    import triton
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    assert triton.__version__.startswith("3.6")
    warm = _source(JITFunction.warmup)
    assert "returnself.run(grid=grid,warmup=True," in warm
    init = _source(CompiledKernel._init_handles)
    assert "self._run=driver.active.launcher_cls(self.src,self.metadata)" in init
    assert "driver.active.utils.load_binary(" in init
