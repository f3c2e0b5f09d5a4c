#!/usr/bin/env bash
# `make serve`'s path (scripts/serve.sh, no MODEL: the tiny full-NVFP4 checkpoint, generated once)
# with our overlay, OpenAI client checks (completions and chat, streaming and not), then the soak
# (64 clients, SOAK_S = 300 s, mixed lengths; errors, latency, GPU memory of the server's
# processes, greedy outputs cold / prefix-cached / after, see bench/soak.py). ~8 min on an H200.
# With BENCH_SERVERS=1 (default) and the flash-layers checkpoints present, the two flash-layers
# servers of serve_bench.sh start meanwhile (env.sh's start_flash; they outlive this script), so
# their JIT warm-up overlaps the soak; the soak JSON records that (concurrent_on_machine).
# serve_bench.sh 1 soaks the flash-layers server alone on the GPU instead.
# Results in $OUT: openai_smoke.json, soak.json, serve_tiny.log, device.txt, summary.txt.
#   bash scripts/gpu/serve_soak.sh            (PYTHON, OUT, ...: see scripts/gpu/env.sh)
set -u
. "$(dirname "$0")/env.sh"
SOAK_S=${SOAK_S:-300}
device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; exit 1; }

wait_health() {  # wait_health PORT SECONDS PID
    local i
    for ((i = 0; i < $2; i += 2)); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$3" 2>/dev/null || return 1
        sleep 2
    done
    return 1
}

s=$SECONDS
# A bounded share of the GPU, so the benchmark servers can start beside it.
PORT=8000 VLLM_EXTRA_ARGS="--gpu-memory-utilization 0.25 --kv-cache-memory-bytes 8000000000 --enable-prompt-tokens-details" \
    setsid "${OURS[@]}" bash "$REPO/scripts/serve.sh" >"$R/serve_tiny.log" 2>&1 < /dev/null &
srv=$!
if ! wait_health 8000 360 $srv; then
    echo "tiny server did not become healthy ($((SECONDS - s)) s)" | tee -a "$OUT/summary.txt"
    tail -n 60 "$R/serve_tiny.log"; kill -TERM -- -$srv 2>/dev/null; exit 1
fi
echo "$(date -u +%T) tiny server healthy after $((SECONDS - s)) s" | tee -a "$OUT/summary.txt"
model=$(curl -s http://127.0.0.1:8000/v1/models | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
step openai_smoke 120 "$PYTHON" "$REPO/bench/openai_smoke.py" --url http://127.0.0.1:8000 --out "$R/openai_smoke.json"

note=""
if [ "${BENCH_SERVERS:-1}" = 1 ] && [ -f "$(flash_ckpt ours)/config.json" ] && [ -f "$(flash_ckpt upstream)/config.json" ]; then
    start_flash ours
    start_flash upstream
    note="flash-layers servers (ports 8001, 8002) started at the soak's start and warmed up (JIT) during it"
fi
step soak $((SOAK_S + 200)) "$PYTHON" "$REPO/bench/soak.py" --url http://127.0.0.1:8000 --model "$model" \
    --clients 64 --duration "$SOAK_S" --vocab 1024 --server-pid $srv --prompt-tokens-details \
    --drain-timeout 60 --out "$R/soak.json"
[ -n "$note" ] && "$PYTHON" - "$R/soak.json" "$note" <<'PY'
import json, sys
p, note = sys.argv[1], sys.argv[2]
d = json.load(open(p)); d["concurrent_on_machine"] = note; json.dump(d, open(p, "w"), indent=2)
PY
# Stop the server's whole process group; SIGKILL if it has not exited after 30 s (H200,
# 2026-12-02: the API server logged a clean shutdown and then never exited).
kill -TERM -- -$srv 2>/dev/null
for ((i = 0; i < 30; i++)); do kill -0 $srv 2>/dev/null || break; sleep 1; done
kill -KILL -- -$srv 2>/dev/null
"$PYTHON" -c 'import json, sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ("requests","errors","latency_s","ttft_s","gpu_memory_growth_mib","memory_flat","greedy_identical","greedy_verdict","greedy_cached_tokens")})' "$R/soak.json"
