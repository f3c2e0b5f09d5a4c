#!/usr/bin/env python3
"""vLLM on a tiny DSv4 checkpoint vs the golden reference: pristine vLLM 0.21.0 on the native
checkpoint (the upstream baseline), or, with `--format nvfp4|nvidia-mixed|ct-nvfp4-fp8` and our
overlay applied, our NVFP4 path end to end (the JSON records the sha256 of the deepseek_v4.py that
ran).

    python bench/upstream_baseline.py --out out/upstream_baseline.json \
        [--format native|nvfp4|nvidia-mixed|ct-nvfp4-fp8] [--ckpt DIR] [--hidden 2048] [--modes eager,graph]
        [--decode 16] [--prompt-lens 17,300] [--hooks] [--no-mhc-check] [--timeout 420]

Needs a GPU and vLLM 0.21.0 (scripts/gpu/e2e.sh runs every format at once). Steps:
 1. Generate the tiny checkpoint (cutedsl.tools.tiny_model, preset tiny, `--hidden` H) unless
    --ckpt is given.
 2. mHC check (see below): call vLLM's torch.ops.vllm.mhc_fused_post_pre directly for T in
    {1,2,4,7,8,16,17} tokens and H in {1024, 2048, 4096} on random data, after poisoning the CUDA
    caching allocator with NaN, and compare with a float64 torch reference of the same maths
    (mhc.py's ROCm branch).
 3. For each mode (eager = enforce_eager; graph = torch.compile + CUDA graphs, capture sizes
    1,2,4,8), in a fresh subprocess: LLM(...).generate on random prompts of --prompt-lens tokens,
    greedy, 1 + --decode new tokens, full-vocabulary logprobs for every prompt position
    (prompt_logprobs) and every generated token. --hooks (eager only): forward pre-hooks record
    per layer and step the abs-max of the attention input (attn_norm input = mHC output), the MoE
    input (ffn_norm input = mhc_fused_post_pre's layer_input), the MoE output and the final norm.
 4. Golden reference (cutedsl.tools.golden, HF transformers 5.17.0, fp32, on the GPU) on prompt +
    vLLM's generated tokens (teacher forcing): per position cosine of the centred log-prob
    vectors and greedy-token agreement, for prefill positions and each decode step; also against
    the golden with `swa_rope="vllm"` (vLLM 0.21.0 applies YaRN to sliding-window layers, HF and
    DeepSeek's reference do not); with an sm100 backend ($CUTEDSL_BACKEND sm100 or
    sm100-emulated) also against the W4A4 golden (`golden_w4a4`: the inputs of the GEMMs that
    backend runs with NVFP4 activations rounded to NVFP4, `golden.load_model(act_quant="nvfp4")`).
 5. One JSON with the command, date, device, versions and all numbers (--out); the dense
    log-prob tensors go next to it as <out>.pt.

The mHC hazard the check measures (H200, 2026-12-02: bench/results/h200/mhc_h1024.json): vLLM
0.21.0 layers/mhc.py:679-683 picks n_splits = 8 when num_tokens < 8 (and H <= 4096) and 4 for
8 <= T <= 16, and calls mhc_fused_tilelang (mhc.py:714-729). That kernel gives each split
h_per_split = H // split_k elements (mhc.py:428) and loops h_iters = h_per_split // n_thr times
with n_thr = 256 (mhc.py:430, 474). For H = 1024 at T < 8: 128 // 256 = 0 iterations, so the
kernel writes neither residual_out (torch.empty_like, mhc.py:689) nor real sums: yp/rp = 0, so
mhc_pre_big_fuse sees mixes = 0 and builds layer_input from the uninitialised residual buffer.
The decode-step layer input (and the carried residual) is stale memory: exactly 0 when the block
the allocator hands out happens to be zero (then the MoE output is exactly 0 and every decode
step's logits are uniform), otherwise garbage. Prefill (T = 17 > 16) takes the unfused path
(mhc_post_tilelang + tf32_hc_prenorm_gemm) and is fine. Any H with (H // 8) % 256 != 0 or
(H // 4) % 256 != 0 is hit (partially when the quotient is not a multiple of 256); H = 2048 and
4096 are not, which is why the tiny preset uses H = 2048.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DEEP_GEMM_WARMUP": "skip",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}.items():
    os.environ.setdefault(_k, _v)


# --------------------------------------------------------------------------- mHC check


def _mhc_reference(x, residual, post, comb, fn, scale, base, eps, iters):
    """float64 maths of mhc_fused_post_pre (mhc.py ROCm branches of mhc_post + mhc_pre)."""
    import torch

    hc, H = residual.shape[-2:]
    r = residual.double()
    new = (
        torch.einsum("tij,tih->tjh", comb.double(), r)
        + post.double().view(-1, hc, 1) * x.double()[:, None]
    )
    new_bf = new.to(torch.bfloat16)
    flat = new_bf.double().reshape(-1, hc * H)
    mixes = flat @ fn.double().t()
    mixes = mixes * torch.rsqrt(flat.square().sum(-1, keepdim=True) / (hc * H) + eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post_o = torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc]) * 2.0
    cl = mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(1, hc, hc)
    c = torch.softmax(cl, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    li = (pre.unsqueeze(-1) * new_bf.double()).sum(1)
    return new_bf, post_o, c, li


def mhc_check(hiddens=(1024, 2048, 4096), tokens=(1, 2, 4, 7, 8, 16, 17)) -> list[dict]:
    import torch
    import vllm.model_executor.layers.mhc  # noqa: F401  (registers torch.ops.vllm.mhc_*)

    rows = []
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for H in hiddens:
        for T in tokens:
            hc, mix = 4, 24
            row = {"hidden": H, "tokens": T}
            try:
                x = torch.randn(T, H, generator=g, device=dev).bfloat16()
                residual = torch.randn(T, hc, H, generator=g, device=dev).bfloat16()
                post = torch.rand(T, hc, 1, generator=g, device=dev) * 2
                comb = torch.softmax(torch.randn(T, hc, hc, generator=g, device=dev), -1)
                fn = torch.randn(mix, hc * H, generator=g, device=dev) * (0.25 / math.sqrt(hc * H))
                scale = torch.ones(3, device=dev) + 0.1 * torch.randn(3, generator=g, device=dev)
                base = 0.1 * torch.randn(mix, generator=g, device=dev)
                # Poison: free NaN blocks of the output sizes so uninitialised outputs show NaN.
                for shape in ((T, hc, H), (T, H)):
                    p = torch.full(shape, float("nan"), device=dev, dtype=torch.bfloat16)
                    del p
                res, post_o, comb_o, li = torch.ops.vllm.mhc_fused_post_pre(
                    x, residual, post, comb, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20
                )
                torch.cuda.synchronize()
                ref = _mhc_reference(x, residual, post, comb, fn, scale, base, 1e-6, 20)
                for name, got, want in zip(
                    ("residual", "post_mix", "comb_mix", "layer_input"),
                    (res, post_o, comb_o, li),
                    ref,
                ):
                    got = got.double().reshape(want.shape)
                    row[f"{name}_nan"] = bool(torch.isnan(got).any())
                    row[f"{name}_max_err"] = float(
                        (got - want).abs().nan_to_num(float("inf")).max()
                    )
                    row[f"{name}_ref_absmax"] = float(want.abs().max())
                row["layer_input_absmax"] = float(li.float().abs().nan_to_num(0).max())
                row["ok"] = (
                    row["residual_max_err"] <= 0.02 * row["residual_ref_absmax"] + 1e-2
                    and row["layer_input_max_err"] <= 0.05 * row["layer_input_ref_absmax"] + 1e-2
                )
            except Exception as e:  # record and go on: one failing shape must not hide the rest
                row["error"] = repr(e)[:500]
                row["ok"] = False
            rows.append(row)
            print(
                f"[mhc] H={H} T={T} ok={row.get('ok')} "
                f"res_err={row.get('residual_max_err')} li_err={row.get('layer_input_max_err')} "
                f"nan={row.get('residual_nan')}",
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- vLLM worker


def _dense(lp_dict, V):
    import torch

    out = torch.full((V,), float("-inf"))
    for tok, lp in lp_dict.items():
        out[int(tok)] = float(lp.logprob)
    return out


def worker(args) -> dict:
    """One vLLM engine (mode args.mode) -> summary dict; dense logprobs saved to args.worker_pt."""
    import torch

    res: dict = {"mode": args.mode}
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    res["import_s"] = round(time.time() - t0, 1)
    res["vllm"] = vllm.__version__
    import hashlib

    import vllm.model_executor.models.deepseek_v4 as d4

    res["vllm_deepseek_v4"] = {
        "file": d4.__file__,
        "sha256": hashlib.sha256(open(d4.__file__, "rb").read()).hexdigest(),
    }
    cfg = json.load(open(os.path.join(args.ckpt, "config.json")))
    V = cfg["vocab_size"]
    kw = dict(
        model=args.ckpt,
        skip_tokenizer_init=True,
        kv_cache_dtype="fp8",
        max_model_len=4096,
        max_num_batched_tokens=4096,
        max_num_seqs=8,
        gpu_memory_utilization=args.gpu_mem,
        seed=0,
        max_logprobs=V,
    )
    if args.kv_bytes:  # fixed KV size: skips profiling, so engines can share one GPU (--parallel)
        kw["kv_cache_memory_bytes"] = args.kv_bytes
    if args.mode == "eager":
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    t0 = time.time()
    llm = LLM(**kw)
    res["llm_init_s"] = round(time.time() - t0, 1)

    rec: list = []
    if args.hooks and args.mode == "eager":

        def add_hooks(model):
            def pre(name):
                def h(mod, inp):
                    x = inp[0]
                    rec.append((name, int(x.shape[0]), float(x.float().abs().max())))

                return h

            def post(name):
                def h(mod, inp, out):
                    o = out[0] if isinstance(out, tuple) else out
                    rec.append((name, int(o.shape[0]), float(o.float().abs().max())))

                return h

            for i, layer in enumerate(model.model.layers):
                layer.attn_norm.register_forward_pre_hook(pre(f"L{i}.attn_in"))
                layer.ffn_norm.register_forward_pre_hook(pre(f"L{i}.moe_in"))
                layer.ffn.register_forward_hook(post(f"L{i}.moe_out"))
            model.model.norm.register_forward_hook(post("final_norm"))
            return True

        llm.apply_model(add_hooks)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in args.prompt_lens]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=args.decode + 1,
        ignore_eos=True,
        logprobs=V,
        prompt_logprobs=V,
        detokenize=False,
    )
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res["generate_s"] = round(time.time() - t0, 2)

    def runners(model) -> dict:
        """Count of the model's cutedsl runners per '<impl class>:<backend>'."""
        names = [f"{type(r).__name__}:{r.backend}" for m in model.modules()
                 if (r := getattr(m, "cutedsl_runner", None)) is not None]  # fmt: skip
        return {n: names.count(n) for n in sorted(set(names))}

    res["cutedsl_runners"] = llm.apply_model(runners)[0]
    dense = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        pl = o.prompt_logprobs or []
        prompt_lp = (
            torch.stack([_dense(d, V) for d in pl[1:]]) if len(pl) > 1 else torch.empty(0, V)
        )
        gen_lp = torch.stack([_dense(d, V) for d in c.logprobs])
        dense.append(
            {
                "prompt": p,
                "tokens": list(c.token_ids),
                "prompt_logprobs": prompt_lp,
                "gen_logprobs": gen_lp,
            }
        )
    torch.save(dense, args.worker_pt)
    res["prompts"] = [{"len": len(d["prompt"]), "tokens": d["tokens"]} for d in dense]
    if rec:
        res["hooks"] = rec
    res["ok"] = True
    return res


# --------------------------------------------------------------------------- comparison


def compare(ckpt: str, dense: list, golden_models: dict) -> list[dict]:
    import torch

    from cutedsl.tools.golden import golden_logits, logprob_cosine

    out = []
    for d in dense:
        p, toks = d["prompt"], d["tokens"]
        T = len(p)
        row = {"prompt_len": T, "vllm_tokens": toks}
        v_prefill = d["prompt_logprobs"]  # [T-1, V]: position t predicts token t+1
        v_gen = d["gen_logprobs"]  # [1+decode, V]: step 0 from prefill, then decode steps
        for gname, model in golden_models.items():
            ref = torch.log_softmax(golden_logits(model, p + toks[:-1]).double().cpu(), -1)
            r_prefill, r_gen = ref[: T - 1], ref[T - 1 :]

            def stats(v, r):
                v = v.double()
                finite = torch.isfinite(v).all(-1)
                cos = logprob_cosine(v, r)
                agree = v.argmax(-1) == r.argmax(-1)
                uniform = v.std(-1) < 1e-6
                return cos, agree, uniform, finite

            cp, ap, up, fp = stats(v_prefill, r_prefill)
            cg, ag, ug, fg = stats(v_gen, r_gen)
            row[gname] = {
                "prefill": {
                    "positions": int(cp.numel()),
                    "cos_min": float(cp.min()) if cp.numel() else None,
                    "cos_mean": float(cp.mean()) if cp.numel() else None,
                    "greedy_agree": float(ap.double().mean()) if ap.numel() else None,
                    "uniform_positions": int(up.sum()),
                    "nonfinite_positions": int((~fp).sum()),
                    "cos": [round(float(x), 5) for x in cp],  # per position t (predicts t+1)
                    "greedy_agree_per_position": [bool(x) for x in ap],
                },
                "first_token": {"cos": float(cg[0]), "agree": bool(ag[0])},
                "decode": {
                    "steps": int(cg.numel() - 1),
                    "cos": [round(float(x), 5) for x in cg[1:]],
                    "greedy_agree": [bool(x) for x in ag[1:]],
                    "uniform": [bool(x) for x in ug[1:]],
                    "cos_min": float(cg[1:].min()),
                    "agree_frac": float(ag[1:].double().mean()),
                },
            }
        out.append(row)
    return out


def hooks_summary(rec: list) -> dict:
    """Per decode forward (T < prompt), layers whose MoE input / output is exactly zero."""
    steps, cur = [], {}
    for name, t, amax in rec:
        if name.startswith("L0.attn_in") and cur:
            steps.append(cur)
            cur = {}
        cur[name] = (t, amax)
    if cur:
        steps.append(cur)
    out = []
    for i, s in enumerate(steps):
        out.append(
            {
                "forward": i,
                "tokens": next(iter(s.values()))[0],
                "zero": sorted(k for k, (_, a) in s.items() if a == 0.0),
                "moe_in_absmax": {
                    k: round(a, 4) for k, (_, a) in s.items() if k.endswith("moe_in")
                },
            }
        )
    return {"forwards": len(steps), "per_forward": out}


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join("out", "upstream_baseline.json"))
    ap.add_argument("--ckpt", default=None)
    ap.add_argument(
        "--hidden",
        type=int,
        default=2048,
        help="tiny preset hidden size (1024 shows the mHC hazard)",
    )
    ap.add_argument(
        "--format",
        default="native",
        choices=["native", "nvfp4", "nvidia-mixed", "ct-nvfp4-fp8"],
        help="tiny checkpoint to generate; all but native need our overlay applied",
    )
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--prompt-lens", default="17,300")
    ap.add_argument("--hooks", action="store_true")
    ap.add_argument("--no-mhc-check", action="store_true")
    ap.add_argument("--timeout", type=int, default=420, help="per-mode worker timeout (s)")
    ap.add_argument("--parallel", action="store_true", help="run the mode workers at the same time")
    ap.add_argument("--gpu-mem", type=float, default=0.4, help="gpu_memory_utilization")
    ap.add_argument(
        "--kv-bytes", type=int, default=0, help="kv_cache_memory_bytes (0 = vLLM profiles)"
    )
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--worker-pt", help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prompt_lens = [int(x) for x in str(args.prompt_lens).split(",")]

    if args.mode:  # subprocess worker
        try:
            res = worker(args)
        except Exception as e:
            res = {
                "mode": args.mode,
                "ok": False,
                "error": repr(e)[:2000],
                "traceback": traceback.format_exc()[-6000:],
            }
        with open(args.worker_json, "w") as f:
            json.dump(res, f, default=str)
        sys.stdout.flush()
        os._exit(0)

    import torch

    result: dict = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "capability": list(torch.cuda.get_device_capability(0))
        if torch.cuda.is_available()
        else None,
        "torch": torch.__version__,
        "format": args.format,
        "backend": os.environ.get("CUTEDSL_BACKEND"),  # None: the device's default
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    if args.ckpt is None:
        from cutedsl.tools.tiny_model import generate

        args.ckpt = f"/tmp/tiny_dsv4_{args.format}_h{args.hidden}"
        t0 = time.time()
        generate(
            args.ckpt,
            args.format,
            "native",
            "tiny",
            seed=0,
            overrides={"hidden_size": args.hidden},
            device="cuda" if torch.cuda.is_available() else "cpu",
            force=True,
        )
        result["generate_s"] = round(time.time() - t0, 1)
        from cutedsl.tools.tiny_model import DEFAULT_EXPERT_SHARED, DEFAULT_ROUTER_GAIN

        result["conditioning"] = {
            "router_gain": DEFAULT_ROUTER_GAIN,
            "expert_shared": DEFAULT_EXPERT_SHARED,
        }
    cfg = json.load(open(os.path.join(args.ckpt, "config.json")))
    result["checkpoint"] = {
        "path": args.ckpt,
        **{
            k: cfg[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "o_groups",
                "compress_ratios",
                "num_hash_layers",
                "n_routed_experts",
                "vocab_size",
            )
        },
    }
    from cutedsl.tools.tiny_model import mhc_decode_hazard

    result["checkpoint"]["mhc_decode_hazard"] = mhc_decode_hazard(cfg)

    def dump():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    if not args.no_mhc_check:
        try:
            result["mhc_check"] = mhc_check()
        except Exception as e:
            result["mhc_check_error"] = repr(e)[:2000]
        dump()
        torch.cuda.empty_cache()

    def launch(mode: str) -> tuple[subprocess.Popen, float]:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--mode",
            mode,
            "--worker-json",
            f"{args.out}.{mode}.json",
            "--worker-pt",
            f"{args.out}.{mode}.pt",
            "--ckpt",
            args.ckpt,
            "--decode",
            str(args.decode),
            "--prompt-lens",
            ",".join(map(str, args.prompt_lens)),
            "--gpu-mem",
            str(args.gpu_mem),
            "--kv-bytes",
            str(args.kv_bytes),
        ] + (["--hooks"] if args.hooks else [])
        log = open(f"{args.out}.{mode}.log", "w")  # the worker's whole log, next to the JSON
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.time()

    def collect(mode: str, proc: subprocess.Popen, t0: float) -> None:
        wj, wp = f"{args.out}.{mode}.json", f"{args.out}.{mode}.pt"
        try:
            proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with open(f"{args.out}.{mode}.log", errors="replace") as f:
            log_tail = f.read()[-4000:]
        res = json.load(open(wj)) if os.path.exists(wj) else {"mode": mode, "ok": False}
        res["wall_s"] = round(time.time() - t0, 1)
        if not res.get("ok"):
            res["log_tail"] = log_tail
            if proc.returncode and proc.returncode < 0:
                res["killed_after_s"] = args.timeout
        if "hooks" in res:
            res["hooks_summary"] = hooks_summary(res.pop("hooks"))
        result["modes"][mode] = res
        if res.get("ok"):
            dense_all[mode] = torch.load(wp)
        dump()
        print(f"[baseline] {mode}: ok={res.get('ok')} {res.get('error', '')}", flush=True)

    dense_all = {}
    result["modes"] = {}
    modes = [m for m in args.modes.split(",") if m]
    if args.parallel:
        running = [(m, *launch(m)) for m in modes]
        for m, proc, t0 in running:
            collect(m, proc, t0)
    else:
        for m in modes:
            collect(m, *launch(m))

    if dense_all:
        from cutedsl.tools.golden import load_model

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t0 = time.time()
        golden = {
            "golden": load_model(args.ckpt, dev),
            "golden_swa_yarn": load_model(args.ckpt, dev, swa_rope="vllm"),
        }
        if (result.get("backend") or "").startswith("sm100"):
            # what the W4A4 backend computes: its NVFP4 activations rounded the same way
            golden["golden_w4a4"] = load_model(args.ckpt, dev, act_quant="nvfp4")
        result["golden_load_s"] = round(time.time() - t0, 1)
        for mode, dense in dense_all.items():
            result["modes"][mode]["vs_golden"] = compare(args.ckpt, dense, golden)
        torch.save(dense_all, os.path.splitext(args.out)[0] + ".pt")
    dump()
    for mode, r in result["modes"].items():
        for v in r.get("vs_golden", []):
            gd = v["golden"]
            print(
                f"[baseline] {mode} prompt {v['prompt_len']}: prefill cos_min "
                f"{gd['prefill']['cos_min']} agree {gd['prefill']['greedy_agree']}; decode cos_min "
                f"{gd['decode']['cos_min']:.4f} agree {gd['decode']['agree_frac']:.2f} "
                f"uniform steps {sum(gd['decode']['uniform'])}",
                flush=True,
            )
    print(f"[baseline] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
