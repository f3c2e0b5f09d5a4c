#!/usr/bin/env python3
"""How far bf16 inference alone moves the golden reference: HF DeepseekV4ForCausalLM on the same
dequantized weights in fp32 vs bf16, per-position cosine of the centred log-probs and greedy
agreement (the metric of bench/upstream_baseline.py). vLLM computes in bf16 (plus an FP8 KV
cache), so this is a floor for how close any vLLM run can get to the fp32 golden.

    python bench/golden_precision_floor.py [--ckpt DIR | --format nvfp4] [--prompt-len 300]
        [--seed 1] [--device cpu] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="default: generate the tiny preset (seed 0)")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)

    import torch

    from cutedsl.golden import golden_logits, load_model, logprob_cosine
    from cutedsl.tools.tiny_model import generate

    tmp = None
    if a.ckpt is None:
        tmp = tempfile.TemporaryDirectory()
        a.ckpt = os.path.join(tmp.name, "tiny")
        generate(a.ckpt, a.format, "native", "tiny", seed=0, device=a.device)
    vocab = json.load(open(os.path.join(a.ckpt, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist()
    lp = {}
    for dt in (torch.float32, torch.bfloat16):
        model = load_model(a.ckpt, a.device, dt)
        lp[dt] = torch.log_softmax(golden_logits(model, ids).double().cpu(), -1)
        del model
    x, y = lp[torch.float32], lp[torch.bfloat16]
    cos = logprob_cosine(x, y)
    res = {
        "command": " ".join(shlex.quote(v) for v in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": a.device,
        "torch": torch.__version__,
        "checkpoint": a.ckpt if tmp is None else f"generated: tiny preset, {a.format}, seed 0",
        "positions": len(ids),
        "cos_min": float(cos.min()),
        "cos_mean": float(cos.mean()),
        "positions_below_0.99": int((cos < 0.99).sum()),
        "greedy_agree": float((x.argmax(-1) == y.argmax(-1)).double().mean()),
        "cos": [round(float(v), 5) for v in cos],
    }
    print({k: v for k, v in res.items() if k != "cos"})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
