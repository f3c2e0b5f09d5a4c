"""bench/cache_integrity.py: entries written by cutedsl.jit's own writer pass; a flipped byte,
a truncated or missing object and a garbled record are each named; a writer's leftover temporary
file is not corruption. TileLang entries: complete ones pass, incomplete, empty-file and
unpicklable ones are named (the CLI, in a subprocess: TileLang reads its cache root at import)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "cache_integrity", REPO / "bench" / "cache_integrity.py"
)
ci = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci)


class _Fn:
    """Stands in for a TVM-FFI function: export_to_c writes the object file."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def export_to_c(self, path: str, function_name: str) -> None:
        Path(path).write_bytes(self.data)


def test_cutedsl_entries(tmp_path: Path) -> None:
    from cutedsl import jit

    entries = []
    for i in range(6):
        key = {"arch": "sm_90a", "build": f"k{i}", "args": [i, os.urandom(4).hex()]}
        e = jit.Entry(tmp_path, key)
        assert e.store(_Fn(os.urandom(256 + i)))
        entries.append(e)
    assert ci.check_cutedsl(tmp_path)["corrupt"] == []

    def obj(e) -> Path:
        return e.folder / json.loads(e.record.read_text())["object"]

    flipped = obj(entries[0])
    data = bytearray(flipped.read_bytes())
    data[100] ^= 1
    flipped.write_bytes(bytes(data))
    cut = obj(entries[1])
    cut.write_bytes(cut.read_bytes()[:-10])
    obj(entries[2]).unlink()
    entries[3].record.write_text('{"format": 1, "key": ')
    (entries[4].folder / f".{entries[4].digest}.123.abcd1234.tmp").write_bytes(b"partial")
    res = ci.check_cutedsl(tmp_path)
    assert res["entries"] == 6 and len(res["leftovers"]) == 1
    got = {c["path"]: c["why"] for c in res["corrupt"]}
    assert set(got) == {str(flipped), str(cut), str(obj(entries[2])), str(entries[3].record)}
    assert (
        "does not match" in got[str(flipped)] and got[str(obj(entries[2]))] == "object file missing"
    )
    assert got[str(entries[3].record)].startswith("unreadable record")
    assert ci.main(["--cutedsl", str(tmp_path)]) == 1
    assert ci.main(["--cutedsl", str(tmp_path / "nope")]) == 1


def test_tilelang_entries(tmp_path: Path) -> None:
    pytest.importorskip("tilelang")
    import cloudpickle

    kernels = tmp_path / "0.1.9-x86_64" / "kernels"

    def entry(name: str, skip: str = "", empty: str = "", params: bytes | None = None) -> Path:
        d = kernels / name
        d.mkdir(parents=True)
        for f in ("device_kernel.cu", "host_kernel.cu", "executable.so", "params.pkl"):
            if f == skip:
                continue
            data = b"" if f == empty else b"\x7fELF" + os.urandom(64)
            if f == "params.pkl":
                data = params if params is not None else cloudpickle.dumps([1, 2])
            (d / f).write_bytes(data)
        return d

    entry("good")
    bad = {entry("no_params", skip="params.pkl"): "incomplete",
           entry("empty_so", empty="executable.so"): "empty file",
           entry("bad_pickle", params=b"\x80\x05garbage"): "params.pkl"}  # fmt: skip
    (tmp_path / "0.1.9-x86_64" / "staging" / "x_1_ab").mkdir(parents=True)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cache_integrity.py"), "--tilelang", str(tmp_path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "unused"), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["tilelang"]
    assert res["entries"] == 4 and len(res["leftovers"]) == 1
    got = {c["path"]: c["why"] for c in res["corrupt"]}
    assert set(got) == {str(p) for p in bad}, got
    for p, why in bad.items():
        assert got[str(p)].startswith(why), (p, got[str(p)])
