#!/usr/bin/env python3
"""Which component makes HF DeepseekV4 bf16 dip vs fp32 at single positions (issue #8)?

Runs the golden model in fp32 and bf16 on one prompt, records every discrete decision (score-routed
MoE top-k expert ids, indexer top-k ids) and the router top-k margins, then reruns bf16 with the
fp32 expert choice forced into the score routers ("bf16 + fp32 routing"). If the dips vanish in the
forced run, routing near-ties explain them.

    python diagnose_dips.py [--ckpt DIR] [--seed 1] [--prompt-len 300] [--model-seed 0]
        [--overrides JSON] [--router-gain G] [--expert-shared R] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from cutedsl.golden import golden_logits, load_model, logprob_cosine  # noqa: E402
from cutedsl.tools.tiny_model import (  # noqa: E402
    DEFAULT_EXPERT_SHARED,
    DEFAULT_ROUTER_GAIN,
    generate,
)


def run(model, ids, force=None, only=None):
    """log-probs [T, V] plus per-router records; force: {layer: fp32 indices} to impose."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    rec: dict = {"router": {}, "indexer": {}}
    patched = []
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if isinstance(gate, M.DeepseekV4TopKRouter) and (only is None or only == i):
            orig = gate.forward

            def fwd(h, _g=gate, _i=i, _orig=orig):
                flat = h.reshape(-1, _g.hidden_dim)
                logits = torch.nn.functional.linear(flat, _g.weight)
                scores = _g.score_fn(logits)
                biased = (scores + _g.e_score_correction_bias).float()
                idx = torch.topk(scores + _g.e_score_correction_bias, _g.top_k, -1).indices
                rec["router"][_i] = {"biased": biased.cpu(), "idx": idx.cpu()}
                if force is not None:
                    idx = force[_i].to(idx.device)
                w = scores.gather(1, idx)
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
                return logits, w * _g.routed_scaling_factor, idx

            gate.forward = fwd
            patched.append((gate, orig))
        attn = layer.self_attn
        idxr = getattr(getattr(attn, "compressor", None), "indexer", None)
        if idxr is not None:
            o = idxr.forward

            def ifwd(*a, _o=o, _i=i, **k):
                r = _o(*a, **k)
                rec["indexer"][_i] = r.cpu()
                return r

            idxr.forward = ifwd
            patched.append((idxr, o))
    try:
        lp = torch.log_softmax(golden_logits(model, ids).double(), -1)
    finally:
        for m, o in patched:
            m.forward = o
    return lp, rec


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--overrides", default=None, help="config overrides (JSON)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--router-gain", type=float, default=DEFAULT_ROUTER_GAIN)
    ap.add_argument("--expert-shared", type=float, default=DEFAULT_EXPERT_SHARED)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    tmp = None
    if a.ckpt is None:
        tmp = tempfile.TemporaryDirectory()
        a.ckpt = os.path.join(tmp.name, "tiny")
        ov = json.loads(a.overrides) if a.overrides else None
        generate(
            a.ckpt,
            a.format,
            "native",
            "tiny",
            seed=a.model_seed,
            overrides=ov,
            router_gain=a.router_gain,
            expert_shared=a.expert_shared,
        )
    vocab = json.load(open(os.path.join(a.ckpt, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist()

    m32 = load_model(a.ckpt, "cpu", torch.float32)
    lp32, r32 = run(m32, ids)
    del m32
    m16 = load_model(a.ckpt, "cpu", torch.bfloat16)
    lp16, r16 = run(m16, ids)
    force = {i: r["idx"] for i, r in r32["router"].items()}
    lp16f, _ = run(m16, ids, force=force)
    per_layer = {}
    for i in force:
        lpi, _ = run(m16, ids, force={i: force[i]}, only=i)
        per_layer[i] = logprob_cosine(lp32, lpi)
    del m16

    cos = logprob_cosine(lp32, lp16)
    cosf = logprob_cosine(lp32, lp16f)
    T = len(ids)
    out = {
        "ckpt": a.ckpt if tmp is None else f"generated tiny {a.format} seed {a.model_seed}",
        "router_gain": a.router_gain,
        "expert_shared": a.expert_shared,
        "overrides": a.overrides,
        "prompt_seed": a.seed,
        "bf16": {
            "min": float(cos.min()),
            "mean": float(cos.mean()),
            "below_0.99": int((cos < 0.99).sum()),
            "below_0.995": int((cos < 0.995).sum()),
            "greedy": float((lp32.argmax(-1) == lp16.argmax(-1)).double().mean()),
        },
        "bf16_fp32_routing": {
            "min": float(cosf.min()),
            "mean": float(cosf.mean()),
            "below_0.99": int((cosf < 0.99).sum()),
            "below_0.995": int((cosf < 0.995).sum()),
            "greedy": float((lp32.argmax(-1) == lp16f.argmax(-1)).double().mean()),
        },
        "layers": {},
    }
    flips_any = torch.zeros(T, dtype=torch.bool)
    for i in sorted(r32["router"]):
        b32 = r32["router"][i]["biased"]
        k = m_k = r32["router"][i]["idx"].shape[1]
        srt = b32.sort(-1, descending=True).values
        margin = srt[:, k - 1] - srt[:, k]  # fp32 gap between k-th and (k+1)-th biased score
        s32 = torch.sort(r32["router"][i]["idx"], -1).values
        s16 = torch.sort(r16["router"][i]["idx"], -1).values
        flip = (s32 != s16).any(-1)
        flips_any |= flip
        # bf16 noise of the biased scores, measured
        noise = (r16["router"][i]["biased"] - b32).abs()
        out["layers"][f"router{i}"] = {
            "flip_positions": flip.nonzero().flatten().tolist(),
            "margin_median": float(margin.median()),
            "margin_p05": float(margin.quantile(0.05)),
            "margin_at_flips": [round(float(v), 5) for v in margin[flip]],
            "score_spread_std": float(b32.std(-1).mean()),
            "bf16_score_noise_median": float(noise.median()),
            "bf16_score_noise_p99": float(noise.flatten().quantile(0.99)),
            "frac_margin_below_p99_noise": float(
                (margin < noise.flatten().quantile(0.99)).double().mean()
            ),
        }
        del m_k
    for i in sorted(r32["indexer"]):
        x32, x16 = r32["indexer"][i], r16["indexer"][i]
        same = bool(torch.equal(torch.sort(x32, -1).values, torch.sort(x16, -1).values))
        out["layers"][f"indexer{i}"] = {"k": int(x32.shape[-1]), "identical_sets": same}
    dips = (cos < 0.995).nonzero().flatten().tolist()
    out["dip_positions"] = {
        p: {
            "cos": round(float(cos[p]), 5),
            "cos_forced": round(float(cosf[p]), 5),
            "routing_flip": bool(flips_any[p]),
            **{f"cos_forced_only_router{i}": round(float(c[p]), 5) for i, c in per_layer.items()},
        }
        for p in dips
    }
    out["flip_positions_total"] = int(flips_any.sum())
    out["cos_at_flips_mean"] = float(cos[flips_any].mean()) if flips_any.any() else None
    out["cos_at_nonflips_min"] = float(cos[~flips_any].min())
    print(json.dumps(out, indent=1))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
