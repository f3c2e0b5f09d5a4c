"""bench/golden_precision_floor.py runs on the CPU: fp32 vs bf16 golden on one generated tiny
checkpoint, a cosine per position, close to but not exactly 1 (bf16 really differs); the same for
the W4A4 golden, with its distance to the W4A16 one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "golden_precision_floor", Path(__file__).parents[1] / "bench" / "golden_precision_floor.py"
)
gpf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpf)


def test_runs_and_reports_every_position(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    assert gpf.main(["--prompt-len", "24", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["positions"] == 24 == len(res["cos"])
    assert 0.9 < res["cos_min"] < 1.0 and res["cos_mean"] < 1.0
    assert 0.0 <= res["greedy_agree"] <= 1.0


def test_w4a4_golden_floor_and_its_distance_to_w4a16(tmp_path: Path) -> None:
    out = tmp_path / "floor_w4a4.json"
    assert gpf.main(["--prompt-len", "24", "--act-quant", "nvfp4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["act_quant"] == "nvfp4" and res["positions"] == 24 == len(res["cos"])
    assert 0.5 < res["cos_min"] < 1.0
    w16 = res["vs_w4a16_fp32"]
    assert 0.5 < w16["cos_min"] <= w16["cos_mean"] < 1.0  # the rounding changes the logits
    assert 0.0 <= w16["greedy_agree"] <= 1.0
