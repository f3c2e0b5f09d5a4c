#!/usr/bin/env python3
"""How far bf16 inference alone moves the golden reference: HF DeepseekV4ForCausalLM on the same
dequantized weights in fp32 vs bf16, per-position cosine of the centred log-probs and greedy
agreement (the metric of bench/upstream_baseline.py). vLLM computes in bf16 (plus an FP8 KV
cache), so this is a floor for how close any vLLM run can get to the fp32 golden.

    python bench/golden_precision_floor.py [--ckpt DIR | --format nvfp4] [--prompt-len 300]
        [--seed 1] [--model-seed 0] [--router-gain G] [--expert-shared R] [--device cpu]
        [--act-quant nvfp4] [--out FILE.json]

--act-quant nvfp4: the same for the W4A4 golden of the sm100 backend (`cutedsl.tools.golden`,
activations rounded to NVFP4 with the static input scales), in both dtypes, and that golden's own
distance to the W4A16 fp32 golden (`vs_w4a16_fp32`).

--router-gain / --expert-shared: the tiny generator's conditioning knobs (defaults: its
DEFAULT_ROUTER_GAIN / DEFAULT_EXPERT_SHARED; 1 and 0 give the unconditioned model), used only
when the checkpoint is generated here.
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
    ap.add_argument("--seed", type=int, default=1, help="prompt seed")
    ap.add_argument("--model-seed", type=int, default=0, help="seed of the generated model")
    ap.add_argument("--router-gain", type=float, default=None)
    ap.add_argument("--expert-shared", type=float, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--act-quant", choices=("nvfp4",), default=None)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)

    import torch

    from cutedsl.tools.golden import golden_logits, load_model, logprob_cosine
    from cutedsl.tools.tiny_model import DEFAULT_EXPERT_SHARED, DEFAULT_ROUTER_GAIN, generate

    if a.router_gain is None:
        a.router_gain = DEFAULT_ROUTER_GAIN
    if a.expert_shared is None:
        a.expert_shared = DEFAULT_EXPERT_SHARED

    tmp = None
    if a.ckpt is None:
        tmp = tempfile.TemporaryDirectory()
        a.ckpt = os.path.join(tmp.name, "tiny")
        generate(
            a.ckpt, a.format, "native", "tiny", seed=a.model_seed, device=a.device,
            router_gain=a.router_gain, expert_shared=a.expert_shared,
        )  # fmt: skip
    vocab = json.load(open(os.path.join(a.ckpt, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist()

    def logprobs(dtype: torch.dtype, act_quant: str | None) -> torch.Tensor:
        model = load_model(a.ckpt, a.device, dtype, act_quant=act_quant)
        return torch.log_softmax(golden_logits(model, ids).double().cpu(), -1)

    x, y = logprobs(torch.float32, a.act_quant), logprobs(torch.bfloat16, a.act_quant)
    cos = logprob_cosine(x, y)
    res = {
        "command": " ".join(shlex.quote(v) for v in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": a.device,
        "torch": torch.__version__,
        "checkpoint": a.ckpt
        if tmp is None
        else (
            f"generated: tiny preset, {a.format}, seed {a.model_seed}, "
            f"router_gain {a.router_gain}, expert_shared {a.expert_shared}"
        ),
        "act_quant": a.act_quant,
        "prompt_seed": a.seed,
        "positions": len(ids),
        "cos_min": float(cos.min()),
        "cos_mean": float(cos.mean()),
        "positions_below_0.99": int((cos < 0.99).sum()),
        "positions_below_0.995": int((cos < 0.995).sum()),
        "greedy_agree": float((x.argmax(-1) == y.argmax(-1)).double().mean()),
        "cos": [round(float(v), 5) for v in cos],
    }
    if a.act_quant:
        w16 = logprobs(torch.float32, None)
        c16 = logprob_cosine(x, w16)
        res["vs_w4a16_fp32"] = {
            "cos_min": float(c16.min()),
            "cos_mean": float(c16.mean()),
            "greedy_agree": float((x.argmax(-1) == w16.argmax(-1)).double().mean()),
        }
    print({k: v for k, v in res.items() if k != "cos"})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
