#!/usr/bin/env python3
"""Does the conditioning keep the tiny model realistic and bug-sensitive? fp32 golden of the tiny
nvfp4 model (seed 0, 300 random tokens, prompt seed 1), unconditioned vs default knobs:
activation RMS per layer (cutedsl.golden.layer_rms), greedy-token variety, and how far three
injected routing bugs move the logits (per-position cosine vs the correct model):
  shift: score-routed layers use expert id (e + 1) % E (a wrong expert mapping),
  nobias: e_score_correction_bias ignored in the selection,
  noshared: the shared expert's output dropped (not routing; a control).

    python sensitivity.py [--out FILE.json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from cutedsl.golden import golden_logits, layer_rms, load_model, logprob_cosine  # noqa: E402
from cutedsl.tools.tiny_model import generate  # noqa: E402


def bugged(model, ids, bug):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    saved = []
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if bug in ("shift", "nobias") and isinstance(gate, M.DeepseekV4TopKRouter):
            o = gate.forward

            def fwd(h, _g=gate, _o=o):
                if bug == "nobias":
                    b = _g.e_score_correction_bias.clone()
                    _g.e_score_correction_bias.zero_()
                    try:
                        return _o(h)
                    finally:
                        _g.e_score_correction_bias.copy_(b)
                lg, w, idx = _o(h)
                return lg, w, (idx + 1) % _g.num_experts

            gate.forward = fwd
            saved.append((gate, o))
        if bug == "noshared":
            se = layer.mlp.shared_experts
            o = se.forward
            se.forward = lambda x, _o=o: torch.zeros_like(x)
            saved.append((se, o))
    try:
        return golden_logits(model, ids)
    finally:
        for m, o in saved:
            m.forward = o


def main():
    out = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 1024, (300,), generator=g).tolist()
    for label, kw in (("unconditioned", dict(router_gain=1.0, expert_shared=0.0)), ("default", {})):
        with tempfile.TemporaryDirectory() as d:
            ck = os.path.join(d, "tiny")
            generate(ck, "nvfp4", "native", "tiny", seed=0, **kw)
            m = load_model(ck, "cpu", torch.float32)
            ref = golden_logits(m, ids)
            r = {
                "layer_rms": layer_rms(m, ids),
                "distinct_greedy_tokens": len(set(ref.argmax(-1).tolist())),
            }
            for bug in ("shift", "nobias", "noshared"):
                c = logprob_cosine(ref, bugged(m, ids, bug))
                r[f"bug_{bug}"] = {
                    "cos_min": float(c.min()),
                    "cos_mean": float(c.mean()),
                    "below_0.99": int((c < 0.99).sum()),
                }
            out[label] = r
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 2 and sys.argv[1] == "--out":
        json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
