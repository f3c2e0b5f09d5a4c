"""bench/upstream_baseline.py's comparison on synthetic logits: identical log-probs give cosine 1
and full agreement at every position; a perturbed decode step is found at its index; the
per-position prefill lists have one entry per predicted position."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "upstream_baseline", Path(__file__).parents[1] / "bench" / "upstream_baseline.py"
)
ub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ub)


def test_compare_positions(monkeypatch) -> None:
    import cutedsl.tools.golden

    g = torch.Generator().manual_seed(3)
    v, t, steps = 50, 9, 4
    prompt = torch.randint(0, v, (t,), generator=g).tolist()
    logits = torch.randn(t + steps, v, generator=g, dtype=torch.float64)  # golden, all positions
    monkeypatch.setattr(
        cutedsl.tools.golden, "golden_logits", lambda model, ids: logits[: len(ids)]
    )
    lp = torch.log_softmax(logits, -1)
    gen = lp[t - 1 :].clone()
    gen[2] = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)  # step 2 off
    dense = [{
        "prompt": prompt,
        "tokens": [0] * (steps + 1),
        "prompt_logprobs": lp[: t - 1].float(),
        "gen_logprobs": gen.float(),
    }]  # fmt: skip
    (row,) = ub.compare("unused", dense, {"golden": None})
    pre, dec = row["golden"]["prefill"], row["golden"]["decode"]
    assert pre["positions"] == t - 1 == len(pre["cos"]) == len(pre["greedy_agree_per_position"])
    assert min(pre["cos"]) > 0.99999 and all(pre["greedy_agree_per_position"])
    assert dec["steps"] == steps
    assert dec["cos"][1] < 0.9 and min(dec["cos"][:1] + dec["cos"][2:]) > 0.99999
