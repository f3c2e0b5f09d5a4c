#!/usr/bin/env bash
# On the H200, one call (~8 min), issue 9: `vllm bench serve` on the DSv4-Flash-dimension
# few-layer checkpoint, ours (port 8001: full NVFP4, our overlay) vs upstream vLLM 0.21.0 (port
# 8002: the native FP8/MXFP4 checkpoint of the same seed). The servers were started by
# scripts/h200/serve_soak.sh (or are started here); they are benchmarked one at a time.
# Then (KERNEL_BENCH=1) the SM90 GEMM bench with what time is left. Results: $OUT/serve_bench.tgz.
set -u
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-540}
device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; exit 1; }
bench_args=(--max-model-len 10240 --max-num-seqs 64 --kv-cache-memory-bytes 16000000000 --gpu-memory-utilization 0.3)
if ! curl -sf http://127.0.0.1:8001/health >/dev/null; then
    PORT=8001 setsid "${OURS[@]}" bash "$REPO/scripts/serve.sh" /tmp/ckpt/flash-nvfp4 \
        --served-model-name flash "${bench_args[@]}" >>/tmp/serve_flash_ours.log 2>&1 < /dev/null &
fi
if ! curl -sf http://127.0.0.1:8002/health >/dev/null; then
    PORT=8002 SERVE_UPSTREAM=1 setsid "${UPSTREAM[@]}" bash "$REPO/scripts/serve.sh" /tmp/ckpt/flash-native \
        --served-model-name flash "${bench_args[@]}" >>/tmp/serve_flash_upstream.log 2>&1 < /dev/null &
fi
for port in 8001 8002; do
    for ((i = 0; i < 300; i += 2)); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 2; done
    echo "$(date -u +%T) port $port healthy=$(curl -sf http://127.0.0.1:$port/health >/dev/null && echo yes || echo no) at ${SECONDS}s" | tee -a "$OUT/summary.txt"
done
shapes=${SHAPES:-1024x1024,8192x1024}
conc=${CONCURRENCY:-1,8,64}
per=$(( (BUDGET - SECONDS - 60) / 2 ))
for spec in cutedsl-nvfp4:8001 upstream-native:8002; do
    label=${spec%%:*}; port=${spec##*:}
    step "bench_$label" $((per + 30)) python3 "$REPO/bench/serve_bench.py" --base-url "http://127.0.0.1:$port" \
        --model flash --tokenizer /tmp/ckpt/flash-nvfp4 --label "$label" --shapes "$shapes" \
        --concurrency "$conc" --prompts-per-concurrency 2 --num-warmups 2 --time-budget "$per" --log-dir "$R/logs_$label" \
        --out "$R/serve_$label.json"
done
step plot 60 python3 "$REPO/bench/plot_serve.py" "$R/serve_cutedsl-nvfp4.json" "$R/serve_upstream-native.json" \
    --md "$R/serve_bench.md" --png "$R/serve_bench.png"
cat "$R/serve_bench.md" 2>/dev/null
cp /tmp/serve_flash_*.log "$R/" 2>/dev/null
pkill -f "vllm.entrypoints.cli.main serve" || true
left=$((BUDGET - SECONDS))
if [ "${KERNEL_BENCH:-1}" = 1 ] && [ $left -gt 90 ]; then
    step bench_gemm $((left - 10)) "${OURS[@]}" python3 -m cutedsl.bench.gemm_sm90 --model all \
        --time-budget $((left - 40)) --json "$R/sm90_gemm.json" --md "$R/sm90_gemm.md"
fi
bundle serve_bench
