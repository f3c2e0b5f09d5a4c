"""cutedsl.vllm.token_index and the two overlaid vLLM metadata builders that call it: the index of
each token's request, as vLLM 0.21.0 builds it on the host (repeat_interleave), into the same
persistent buffer."""

from __future__ import annotations

import difflib
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cutedsl.vllm.token_index import fill_token_to_req_indices  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POISON = -7


def _batch(gen: torch.Generator, num_reqs: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random query lengths (zeros included) and their int32 start offsets."""
    lens = torch.randint(0, max_len + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    return lens, qsl


def _buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n,), POISON, dtype=torch.int32), torch.arange(n, dtype=torch.int32)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # the CPU runs the same torch op; the server runs it on the GPU
@pytest.mark.parametrize("max_len", [1, 3, 300])  # decode-only, MTP-like, prefill chunks
def test_matches_repeat_interleave(max_len: int, device: str) -> None:
    gen = torch.Generator().manual_seed(1000 + max_len)
    for _ in range(50):
        num_reqs = int(torch.randint(1, 130, (1,), generator=gen))
        lens, qsl = _batch(gen, num_reqs, max_len)
        out, ar = (b.to(device) for b in _buffers(int(qsl[-1]) + 40))
        # a padded device copy, as CUDA-graph batches have: entries past num_reqs repeat the end
        qsl_dev = torch.cat([qsl, qsl[-1:].repeat(5)]).to(device)
        got = fill_token_to_req_indices(out, ar, qsl_dev, qsl, num_reqs)
        want = torch.repeat_interleave(torch.arange(num_reqs), lens).to(torch.int32).to(device)
        assert torch.equal(got, want)
        assert want.numel() == 0 or got.data_ptr() == out.data_ptr()  # in place: CUDA graphs
        assert (out[want.numel() :] == POISON).all()  # nothing past the step's tokens written


def test_zero_tokens_and_too_many() -> None:
    out, ar = _buffers(8)
    qsl = torch.zeros(3, dtype=torch.int32)
    assert fill_token_to_req_indices(out, ar, qsl, qsl, 2).numel() == 0
    assert (out == POISON).all()
    qsl = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="9 tokens, over the buffers' 8"):
        fill_token_to_req_indices(out, ar, qsl, qsl, 2)


def test_compressor_builder_fills_its_persistent_buffer() -> None:
    """The overlaid CompressorMetadataBuilder.build, on a stand-in builder and step metadata."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.deepseek_compressor import CompressorMetadataBuilder

    gen = torch.Generator().manual_seed(7)
    lens, qsl = _batch(gen, 37, 5)
    out, ar = _buffers(256)
    fake = types.SimpleNamespace(token_to_req_indices=out, arange=ar, block_size=64)
    table = torch.randint(-1, 50, (37, 4), generator=gen, dtype=torch.int32)
    cam = types.SimpleNamespace(query_start_loc_cpu=qsl, query_start_loc=qsl.clone(), num_reqs=37,
                                block_table_tensor=table, slot_mapping=torch.arange(int(qsl[-1])))  # fmt: skip
    md = CompressorMetadataBuilder.build(fake, 0, cam)
    want = torch.repeat_interleave(torch.arange(37), lens).to(torch.int32)
    assert md.token_to_req_indices.data_ptr() == out.data_ptr()
    assert torch.equal(md.token_to_req_indices, want) and (out[want.numel() :] == POISON).all()
    assert md.block_size == 64 and (md.block_table >= 0).all()


@pytest.mark.parametrize(
    ("overlay", "rel"),
    [
        ("deepseek_compressor.py", "model_executor/layers/deepseek_compressor.py"),
        ("sparse_swa.py", "v1/attention/backends/mla/sparse_swa.py"),
    ],
)
def test_overlay_changes_only_the_index(overlay: str, rel: str) -> None:
    """Each builder overlay differs from vLLM 0.21.0 only in the import, the arange buffer and the
    call that replaces the host-side repeat_interleave / pin_memory / copy."""
    pytest.importorskip("vllm")
    from test_vllm_patches import _pristine

    mine = (REPO / "vllm_patches" / overlay).read_text().splitlines()
    diff = difflib.unified_diff(_pristine(rel).read_text().splitlines(), mine, lineterm="", n=0)
    changed = [ln for ln in diff if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    removed = [ln[1:].strip() for ln in changed if ln.startswith("-")]
    added = [ln[1:].strip() for ln in changed if ln.startswith("+")]
    assert removed == [
        "query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]",
        "x = torch.repeat_interleave(torch.arange(num_reqs), query_lens).pin_memory()",
        "token_to_req_indices = self.token_to_req_indices[: x.shape[0]]",
        "token_to_req_indices.copy_(x, non_blocking=True)",
    ]
    assert (
        "from cutedsl.vllm.token_index import fill_token_to_req_indices  # CuTeDSL: host step"
        in added
    )
    assert "token_to_req_indices = fill_token_to_req_indices(  # CuTeDSL: on the device" in added
    assert "pin_memory" not in "\n".join(mine)
    assert len(added) <= 12, added
