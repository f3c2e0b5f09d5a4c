"""bench/e2e_table.py on synthetic upstream_baseline.py results: the table, the bound, failures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "e2e_table", Path(__file__).parents[1] / "bench" / "e2e_table.py"
)
e2e_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_table)


def _result(decode_cos_min: float, ok: bool = True) -> dict:
    g = {
        "prefill": {"cos_min": 0.995, "cos_mean": 0.998, "greedy_agree": 0.97},
        "first_token": {"cos": 0.996, "agree": True},
        "decode": {"steps": 16, "cos_min": decode_cos_min, "agree_frac": 0.94},
    }
    mode = {"ok": True, "vs_golden": [{"prompt_len": 17, "golden": g, "golden_swa_yarn": g}]}
    return {"format": "nvfp4", "modes": {"eager": mode if ok else {"ok": False, "error": "boom"}}}


def _run(tmp_path: Path, capsys, res: dict) -> tuple[int, str]:
    p = tmp_path / "e2e.json"
    p.write_text(json.dumps(res))
    rc = e2e_table.main([str(p)])
    return rc, capsys.readouterr().out


def test_rows_and_bound(tmp_path: Path, capsys) -> None:
    rc, out = _run(tmp_path, capsys, _result(0.993))
    assert (
        rc == 0
        and "| nvfp4 | eager | golden | 17 | 0.9950 / 0.9980 |" in out
        and out.strip().endswith("yes |")
    )
    rc, out = _run(tmp_path, capsys, _result(0.95))
    assert rc == 1 and out.strip().endswith("NO |")


def test_failed_mode_fails(tmp_path: Path, capsys) -> None:
    rc, out = _run(tmp_path, capsys, _result(0.999, ok=False))
    assert rc == 1 and "failed: boom" in out


def test_named_backend_must_have_run(tmp_path: Path, capsys) -> None:
    """A run that named a backend is labelled with it, and fails unless every cutedsl runner of
    the model ran on it (a silently different backend would pass the cosine bound)."""
    res = _result(0.995)
    res["backend"] = "sm100-emulated"
    mode = res["modes"]["eager"]
    mode["cutedsl_runners"] = {"Nvfp4Linear:sm100-emulated": 9, "Nvfp4MoE:sm100-emulated": 4}
    rc, out = _run(tmp_path, capsys, res)
    assert rc == 0 and "| nvfp4 / sm100-emulated | eager | golden | 17 |" in out
    mode["cutedsl_runners"]["Nvfp4MoE:sm90"] = 1
    rc, out = _run(tmp_path, capsys, res)
    assert rc == 1 and "runners not on sm100-emulated: Nvfp4MoE:sm90" in out
    mode["cutedsl_runners"] = {}
    rc, out = _run(tmp_path, capsys, res)
    assert rc == 1 and "no cutedsl runner recorded" in out


def test_json_output(tmp_path: Path, capsys) -> None:
    res = _result(0.993)
    res.update(backend="sm100-emulated", device="NVIDIA H200", date="2026-12-05T00:00:00+00:00")
    res["modes"]["eager"]["cutedsl_runners"] = {"Nvfp4Linear:sm100-emulated": 1}
    p, out = tmp_path / "e2e.json", tmp_path / "table.json"
    p.write_text(json.dumps(res))
    assert e2e_table.main([str(p), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["all_ok"] is True and d["rows"][0]["meets_min_cos"] is True
    run = d["runs"][0]
    assert (run["file"], run["backend"], run["device"]) == ("e2e.json", "sm100-emulated",
                                                            "NVIDIA H200")  # fmt: skip
    assert run["modes"]["eager"]["cutedsl_runners"] == {"Nvfp4Linear:sm100-emulated": 1}


def test_w4a4_reference(tmp_path: Path, capsys) -> None:
    """--golden auto (the default) compares a run that has the W4A4 golden (sm100 backends)
    against it, others against the golden; naming a reference a run lacks fails that run."""
    res = _result(0.95)  # far from the W4A16 golden (the activation rounding)
    w4a4 = {
        "prefill": {"cos_min": 0.996, "cos_mean": 0.999, "greedy_agree": 0.99},
        "first_token": {"cos": 0.997, "agree": True},
        "decode": {"steps": 16, "cos_min": 0.995, "agree_frac": 1.0},
    }
    res["modes"]["eager"]["vs_golden"][0]["golden_w4a4"] = w4a4
    rc, out = _run(tmp_path, capsys, res)
    assert rc == 0 and "| nvfp4 | eager | golden_w4a4 | 17 | 0.9960 / 0.9990 |" in out
    p = tmp_path / "e2e.json"
    assert e2e_table.main([str(p), "--golden", "golden"]) == 1
    assert "| nvfp4 | eager | golden | 17 |" in capsys.readouterr().out
    rc, out = _run(tmp_path, capsys, _result(0.999))
    assert rc == 0 and "| eager | golden | 17 |" in out  # auto: no W4A4 golden in the run
    p.write_text(json.dumps(_result(0.999)))
    assert e2e_table.main([str(p), "--golden", "golden_w4a4"]) == 1
    assert "failed: no golden_w4a4 in" in capsys.readouterr().out
