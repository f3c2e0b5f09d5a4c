#!/usr/bin/env bash
# The published NVFP4 DSv4 layouts on the GPU (tiny checkpoints, cutedsl.tools.tiny_model) and MTP.
#   phase 1 (~8 min): generate nvidia-mixed (NVIDIA ModelOpt), ct-nvfp4-fp8 (compressed-tensors)
#     and their MTP-bearing twins; convert with dsv4-quantize; LLM.generate vs the golden reference,
#     eager + CUDA graphs (bench/upstream_baseline.py): nvidia-mixed and ct-nvfp4-fp8 served
#     directly, and both through their converted full-NVFP4 checkpoints; whether pristine vLLM
#     0.21.0 loads each raw layout (and its error), and whether ours does.
#     -> $OUT/checkpoints.json (+ ck_*.json per run, probe_*.json)
#   phase 2 (~8 min): --speculative-config '{"method": "mtp", "num_speculative_tokens": k}',
#     k = 0 (no speculation), 1, 2, 3, eager and CUDA graphs, on nvfp4 (NVFP4 MTP block),
#     nvidia-mixed (FP8 MTP block, NVFP4 experts), ct-nvfp4-fp8 (BF16 MTP block) served directly,
#     with our overlay, and native (FP8 + MXFP4) on pristine vLLM: greedy tokens vs k = 0,
#     acceptance rate, TPOT. -> $OUT/mtp.json
#   bash scripts/gpu/checkpoints.sh [1|2]   (both when no argument)
# Environment: scripts/gpu/env.sh; LIMIT (500 s per step).
set -u
. "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-500}
PHASE=${1:-12}
CK=$CKPT_DIR/layouts
mkdir -p "$CK"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_DEEP_GEMM_WARMUP=skip
device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; exit 1; }
MTP='{"num_nextn_predict_layers": 1}'

gen() {  # gen NAME FORMAT [CONFIG]
    [ -f "$CK/$1/config.json" ] && return 0
    step "gen_$1" 300 "$PYTHON" -m cutedsl.tools.tiny_model "$CK/$1" --format "$2" --device cuda \
        --force ${3:+--config "$3"}
}
conv() {  # conv SRC: SRC.nvfp4
    [ -f "$CK/$1.nvfp4/config.json" ] && return 0
    step "convert_$1" 300 "$PYTHON" -m cutedsl.tools.quantize "$CK/$1" "$CK/$1.nvfp4" --force
}

# Loads a checkpoint and greedily generates 4 tokens; writes {"loads", "error"} to argv[2].
PROBE=$(cat <<'EOF'
import json, sys
ckpt, out = sys.argv[1], sys.argv[2]
res = {"checkpoint": ckpt}
try:
    from vllm import LLM, SamplingParams
    llm = LLM(model=ckpt, skip_tokenizer_init=True, kv_cache_dtype="fp8", max_model_len=1024,
              enforce_eager=True, gpu_memory_utilization=0.06, kv_cache_memory_bytes=2_000_000_000)
    o = llm.generate([{"prompt_token_ids": list(range(2, 19))}], SamplingParams(temperature=0, max_tokens=4))
    res.update(loads=True, tokens=list(o[0].outputs[0].token_ids))
except BaseException as e:
    res.update(loads=False, error=f"{type(e).__name__}: {e}"[:2000])
json.dump(res, open(out, "w"), indent=1)
EOF
)

# One checkpoint, one mode: k = 0..3 speculative tokens, greedy 64 tokens on 4 prompts, TPOT at
# batch 1 = (t(65 tokens) - t(1 token)) / 64, median of 3; acceptance from vLLM's counters.
MTPRUN=$(cat <<'EOF'
import gc, json, statistics, sys, time
import torch
from vllm import LLM, SamplingParams
ckpt, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(2, 1000, (n,), generator=g).tolist()} for n in (17, 40, 300, 17)]
greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
res = {"checkpoint": ckpt, "mode": mode, "runs": {}}
def counter(llm, name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name.removesuffix("_total") == name)
for k in (0, 1, 2, 3):
    r = {}
    try:
        kw = dict(model=ckpt, skip_tokenizer_init=True, kv_cache_dtype="fp8", max_model_len=2048,
                  gpu_memory_utilization=0.06, kv_cache_memory_bytes=2_000_000_000,
                  enforce_eager=mode == "eager", disable_log_stats=False, max_num_seqs=8)
        if mode == "graph":
            kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
        if k:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        llm = LLM(**kw)
        r["tokens"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        acc, drafts = counter(llm, "vllm:spec_decode_num_accepted_tokens"), counter(llm, "vllm:spec_decode_num_draft_tokens")
        r["accepted"], r["drafted"] = acc, drafts
        r["acceptance_rate"] = acc / drafts if drafts else None
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1)); t1 = time.perf_counter()
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)); t2 = time.perf_counter()
            ts.append(((t2 - t1) - (t1 - t0)) / 64)
        r["tpot_ms"] = 1e3 * statistics.median(ts)
        del llm
    except BaseException as e:
        r["error"] = f"{type(e).__name__}: {e}"[:2000]
    gc.collect(); torch.cuda.empty_cache()
    res["runs"][str(k)] = r
base = res["runs"]["0"].get("tokens")
for k, r in res["runs"].items():
    if k != "0" and "tokens" in r:
        r["identical_to_no_spec"] = r["tokens"] == base
        if "tpot_ms" in r and "tpot_ms" in res["runs"]["0"]:
            r["tpot_speedup"] = res["runs"]["0"]["tpot_ms"] / r["tpot_ms"]
json.dump(res, open(out, "w"), indent=1)
EOF
)

if [[ $PHASE == *1* ]]; then
    gen nvidia-mixed nvidia-mixed
    gen ct-nvfp4-fp8 ct-nvfp4-fp8
    conv nvidia-mixed
    conv ct-nvfp4-fp8
    pids=()
    e2e() {  # e2e NAME CKPT FORMAT-LABEL WRAP...
        local name=$1 ckpt=$2 label=$3; shift 3
        step "ck_$name" "$LIMIT" "$@" "$PYTHON" "$REPO/bench/upstream_baseline.py" --format "$label" \
            --ckpt "$ckpt" --modes eager,graph --parallel --no-mhc-check --gpu-mem 0.06 \
            --kv-bytes 2000000000 --timeout $((LIMIT - 60)) --out "$R/ck_$name.json"
    }
    e2e nvidia-mixed "$CK/nvidia-mixed" nvidia-mixed "${OURS[@]}" & pids+=($!)
    e2e ct-nvfp4-fp8 "$CK/ct-nvfp4-fp8" ct-nvfp4-fp8 "${OURS[@]}" & pids+=($!)
    e2e nvidia-mixed.nvfp4 "$CK/nvidia-mixed.nvfp4" nvfp4 "${OURS[@]}" & pids+=($!)
    e2e ct-nvfp4-fp8.nvfp4 "$CK/ct-nvfp4-fp8.nvfp4" nvfp4 "${OURS[@]}" & pids+=($!)
    for l in nvidia-mixed ct-nvfp4-fp8; do
        step "probe_upstream_$l" 400 "${UPSTREAM[@]}" "$PYTHON" -c "$PROBE" "$CK/$l" "$R/probe_upstream_$l.json" & pids+=($!)
    done
    step probe_ours_ct-nvfp4-fp8 400 "${OURS[@]}" "$PYTHON" -c "$PROBE" "$CK/ct-nvfp4-fp8" "$R/probe_ours_ct-nvfp4-fp8.json" & pids+=($!)
    wait "${pids[@]}"
    "$PYTHON" - "$R" "$REPO/bench/e2e_table.py" <<'EOF'
import json, os, subprocess, sys
R = sys.argv[1]
runs = {"nvidia-mixed (served directly)": "ck_nvidia-mixed.json",
        "ct-nvfp4-fp8 (served directly)": "ck_ct-nvfp4-fp8.json",
        "nvidia-mixed -> dsv4-quantize -> nvfp4": "ck_nvidia-mixed.nvfp4.json",
        "ct-nvfp4-fp8 -> dsv4-quantize -> nvfp4": "ck_ct-nvfp4-fp8.nvfp4.json"}
for label, fn in runs.items():  # distinct row labels in the table
    p = os.path.join(R, fn)
    if os.path.exists(p):
        d = json.load(open(p)); d["format"] = label; json.dump(d, open(p, "w"), indent=1)
files = [os.path.join(R, f) for f in runs.values() if os.path.exists(os.path.join(R, f))]
table = os.path.join(R, "checkpoints_e2e.json")
rc = subprocess.run([sys.executable, sys.argv[2], *files, "--json", table]).returncode
out = {"e2e_vs_golden": json.load(open(table)) if os.path.exists(table) else None,
       "e2e_table_rc": rc, "probes": {}}
for f in sorted(os.listdir(R)):
    if f.startswith("probe_") and f.endswith(".json"):
        out["probes"][f[6:-5]] = json.load(open(os.path.join(R, f)))
json.dump(out, open(os.path.join(R, "checkpoints.json"), "w"), indent=1)
print(json.dumps(out["probes"], indent=1)[:4000])
EOF
fi

if [[ $PHASE == *2* ]]; then
    gen nvfp4-mtp nvfp4 "$MTP"
    gen nvidia-mixed-mtp nvidia-mixed "$MTP"
    gen ct-nvfp4-fp8-mtp ct-nvfp4-fp8 "$MTP"
    gen native-mtp native "$MTP"
    pids=()
    for mode in eager graph; do
        for c in nvfp4-mtp nvidia-mixed-mtp ct-nvfp4-fp8-mtp; do
            step "mtp_${c}_$mode" "$LIMIT" "${OURS[@]}" "$PYTHON" -c "$MTPRUN" "$CK/$c" "$mode" "$R/mtp_${c}_$mode.json" & pids+=($!)
        done
        step "mtp_native-mtp_$mode" "$LIMIT" "${UPSTREAM[@]}" "$PYTHON" -c "$MTPRUN" "$CK/native-mtp" "$mode" "$R/mtp_native-mtp_$mode.json" & pids+=($!)
    done
    wait "${pids[@]}"
    "$PYTHON" - "$R" <<'EOF'
import json, os, sys
R = sys.argv[1]
out = {}
for f in sorted(os.listdir(R)):
    if f.startswith("mtp_") and f.endswith(".json") and f != "mtp.json":
        d = json.load(open(os.path.join(R, f)))
        for r in d["runs"].values():
            r.pop("tokens", None)
        out[f[4:-5]] = d
json.dump(out, open(os.path.join(R, "mtp.json"), "w"), indent=1)
for name, d in out.items():
    for k, r in d["runs"].items():
        print(name, "k=" + k, {x: r.get(x) for x in ("identical_to_no_spec", "acceptance_rate", "tpot_ms", "tpot_speedup", "error")})
EOF
fi
