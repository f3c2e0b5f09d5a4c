"""cutedsl.workspace: grow-only reservations at warm-up, allocation-free views on the hot path,
clear errors, roles isolated, no reserve during (or after, for captured buffers) graph capture."""

from __future__ import annotations

import pytest
import torch

from cutedsl import workspace
from cutedsl.workspace import Workspace, WorkspaceError


@pytest.fixture(autouse=True)
def _fresh_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workspace, "_SHARED", {})


def test_get_views_the_reserved_bytes() -> None:
    ws = Workspace("cpu", "t")
    ws.reserve("buf", (4, 8), torch.float32)
    assert ws.reserved("buf") == 128
    v = ws.get("buf", (2, 3), torch.bfloat16)
    assert v.shape == (2, 3) and v.dtype == torch.bfloat16 and v.is_contiguous()
    assert v.stride() == (3, 1) and v.storage_offset() == 0
    v.fill_(1.5)
    w = ws.get("buf", (6,), torch.bfloat16)
    assert w.data_ptr() == v.data_ptr() and (w == 1.5).all()  # one name = one piece of memory
    assert ws.get("buf", (4, 8), torch.float32).shape == (4, 8)  # exactly the reservation


def test_reserve_grows_never_shrinks_and_keeps_old_views_valid() -> None:
    ws = Workspace("cpu", "t")
    ws.reserve("buf", (10,), torch.float32)
    old = ws.get("buf", (10,), torch.float32)
    old.copy_(torch.arange(10.0))
    ws.reserve("buf", (4,), torch.float32)  # smaller: no-op
    assert ws.reserved("buf") == 40 and ws.reserves == 1
    assert ws.get("buf", (10,), torch.float32).data_ptr() == old.data_ptr()
    ws.reserve("buf", (100,), torch.float32)  # larger: a new buffer
    assert ws.reserved("buf") == 400 and ws.reserves == 2
    new = ws.get("buf", (100,), torch.float32)
    new.fill_(-1.0)
    assert torch.equal(old, torch.arange(10.0))  # a held view still owns its (old) memory


def test_too_small_names_buffer_sizes_and_warmup() -> None:
    ws = Workspace("cpu", "main")
    ws.reserve("h", (3, 4), torch.bfloat16)
    with pytest.raises(WorkspaceError) as err:
        ws.get("h", (4, 4), torch.bfloat16)
    msg = str(err.value)
    assert "main/h" in msg and "32 bytes" in msg and "24 reserved" in msg
    assert "warmup(max_tokens)" in msg
    with pytest.raises(WorkspaceError, match=r"main/never: needs 4 bytes .* 0 reserved"):
        ws.get("never", (1,), torch.float32)


def test_roles_are_isolated_and_shared_within_a_role() -> None:
    main, shared = workspace.for_role("cpu", "main"), workspace.for_role("cpu", "shared")
    assert main is not shared and workspace.for_role(torch.device("cpu"), "main") is main
    workspace.reserve("cpu", "main", "h", (8,), torch.float32)
    workspace.reserve("cpu", "shared", "h", (8,), torch.float32)
    a = workspace.get("cpu", "main", "h", (8,), torch.float32)
    b = workspace.get("cpu", "shared", "h", (8,), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    a.fill_(1.0)
    b.fill_(2.0)
    assert (a == 1.0).all() and (b == 2.0).all()
    assert workspace.get("cpu", "main", "h", (8,), torch.float32).data_ptr() == a.data_ptr()


def test_reserve_refused_during_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace(torch.device("cuda", 0), "main")  # no allocation happens before the check
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(WorkspaceError, match=r"main/h: reserve\(\) during CUDA-graph capture"):
        ws.reserve("h", (8,), torch.float32)


def test_growing_a_captured_buffer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get() during capture pins the buffer: a graph holds its address."""
    ws = Workspace("cpu", "main")
    ws.reserve("h", (8,), torch.float32)
    buf = ws._bufs["h"]
    monkeypatch.setattr(type(buf), "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ws.get("h", (8,), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws.reserve("h", (8,), torch.float32)  # no growth: fine
    with pytest.raises(WorkspaceError, match=r"main/h: cannot grow .* captured CUDA graph"):
        ws.reserve("h", (9,), torch.float32)
