"""scripts/gpu/env.sh on the CPU: PACK_OUT=1 packs a driver's results into few files at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _driver(tmp: Path, body: str, pack: bool = True, timeout: float | None = None) -> int:
    """A driver that sources env.sh (OUT=tmp/out) and runs `body`; its exit status."""
    env = dict(os.environ, OUT=str(tmp / "out"), RUN_DIR=str(tmp / "run"),
               CKPT_DIR=str(tmp / "ck"), PYTHON=sys.executable, SITE_VLLM="none",
               PACK_OUT="1" if pack else "0")  # fmt: skip
    script = f". {ROOT}/scripts/gpu/env.sh\n{body}\n"
    cmd = ["bash", "-c", script]
    if timeout is not None:
        cmd = ["timeout", str(timeout), *cmd]
    return subprocess.run(cmd, env=env, cwd=tmp, timeout=60).returncode


def test_pack_out_keeps_everything_in_one_archive(tmp_path: Path) -> None:
    body = """
echo '{"a": 1}' > "$OUT/e2e_a.json"; mkdir -p "$OUT/logs"; echo x > "$OUT/logs/run.log"
echo step1 > "$OUT/summary.txt"; head -c 1000 /dev/urandom > "$OUT/e2e_a.pt"
for i in 1 2 3 4 5 6 7 8 9; do echo $i > "$OUT/f$i.json"; done
"""
    assert _driver(tmp_path, body) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.txt"]
    with tarfile.open(out / "results.tgz") as t:
        names = set(t.getnames())
        assert {"e2e_a.json", "logs/run.log", "f9.json"} <= names and "e2e_a.pt" not in names
        assert t.extractfile("e2e_a.json").read() == b'{"a": 1}\n'
    assert (out / "summary.txt").read_text() == "step1\n"


def test_pack_out_on_sigterm_and_in_parts(tmp_path: Path) -> None:
    """A driver killed by timeout still packs; an archive over 15 MiB comes in 15 MiB parts
    that concatenate back to it."""
    body = 'head -c $((20 << 20)) /dev/urandom > "$OUT/big.bin"; echo ok > "$OUT/r.json"; sleep 30'
    assert _driver(tmp_path, body, timeout=3) == 124
    out = tmp_path / "out"
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["results.tgz.00", "results.tgz.01"]
    assert (out / "results.tgz.00").stat().st_size == 15 << 20
    whole = tmp_path / "whole.tgz"
    whole.write_bytes(b"".join((out / p).read_bytes() for p in parts))
    with tarfile.open(whole) as t:
        assert sorted(t.getnames()) == ["big.bin", "r.json"]


def test_without_pack_out_nothing_moves(tmp_path: Path) -> None:
    assert _driver(tmp_path, 'echo 1 > "$OUT/a.json"', pack=False) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.json"]
