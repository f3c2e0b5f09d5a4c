#!/usr/bin/env bash
# Serving benchmark of ours vs upstream vLLM on the flash-layers checkpoints (DSv4-Flash layer
# sizes, 2 layers), in two phases run back to back (`all`, the default, runs both):
#   bash scripts/gpu/serve_bench.sh 1
#     generate the flash-layers checkpoints if missing, start our server (port 8001, full NVFP4,
#     our overlay; env.sh's start_flash), wait for it, OpenAI client checks on it
#     (bench/openai_smoke.py: completions and chat, streamed and not), then the soak (bench/soak.py:
#     64 clients, SOAK_S = 300 s, mixed lengths, greedy cold/cached/after check, its GPU memory)
#     ALONE on the GPU; only then start upstream (port 8002, pristine vLLM 0.21.0 on the native
#     FP8/MXFP4 checkpoint of the same seed, the same flags). (H200, 2026-12-03: a soak that
#     overlapped upstream's 8.75-minute start had client time-outs and a TTFT p99 of 62 s.) When
#     our server is not ready in time for a full soak, phase 1 says so and exits 1: run it again
#     (the server keeps starting; a finished soak is not repeated).
#   bash scripts/gpu/serve_bench.sh 2
#     the benchmark points not yet ok (`vllm bench serve` through bench/serve_bench.py, ours then
#     upstream per point), keeping RESERVE_S for the GPU profiles of both servers
#     (bench/profile_server.py: decode at batch PROFILE_CONC, per-kernel and per-category time per
#     decode step), their comparison and the plots (bench/plot_serve.py); then stops the servers
#     (STOP_SERVERS=0 keeps them).
# The servers run in their own process groups and outlive each phase. Results accumulate in
# $STATE ($RUN_DIR/serve_bench_state) across the phases; each phase copies them and the server
# logs into $OUT (serve_bench.md/.png/_table.json, serve_*.json, profile_*, soak.json,
# openai_smoke.json), the raw profiler traces into $OUT/traces.tgz, and logs one line per step in
# $OUT/summary.txt. Every step is time-boxed against BUDGET (wall seconds per phase, default 570).
# Upstream needs the vLLM of $PYTHON pristine: see scripts/gpu/env.sh.
set -u
PHASE=${1:-all}
if [ "$PHASE" = all ]; then  # phase 1 exits 1 while our server is still starting: retry it
    for _ in 1 2 3; do bash "$0" 1 && exec bash "$0" 2; done
    exit 1
fi
[ "$PHASE" = 1 ] || [ "$PHASE" = 2 ] || { echo "usage: $0 [1|2|all]" >&2; exit 2; }
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-570}
STATE=${STATE:-$RUN_DIR/serve_bench_state}
SOAK_S=${SOAK_S:-300}
# Decode-heavy points first (the budget may not reach the last ones); the tables sort them.
POINTS=${POINTS:-1024x1024:64 1024x1024:8 8192x1024:64 8192x1024:8 1024x1024:1 8192x1024:1}
PPC=${PPC:-1}                    # prompts per unit of concurrency: one wave per point
RESERVE_S=${RESERVE_S:-180}      # phase 2: kept for the profiles, the plots and the copy
PROFILE_CONC=${PROFILE_CONC:-64}
PROFILE_S=${PROFILE_S:-3}
mkdir -p "$STATE"
left() { echo $((BUDGET - SECONDS)); }
note() { echo "$(date -u +%T) [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
label_of() { case $1 in ours) echo cutedsl-nvfp4 ;; upstream) echo upstream-native ;; esac; }

estimate() {  # estimate SHAPE CONC: seconds one point takes with PPC 1 (the CLI's own start,
    # ~15-20 s, included; TPOT 4-15 ms). Only a gate: a run's timeout is what is left anyway.
    case $1:$2 in
        1024x1024:1 | 1024x1024:8 | 8192x1024:1) echo 30 ;;
        1024x1024:*) echo 40 ;;
        8192x1024:8) echo 35 ;;
        *) echo 60 ;;
    esac
}

point_ok() {  # point_ok RESULT.json SHAPE CONC: 0 when that point has an ok run there
    "$PYTHON" -c '
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError):
    sys.exit(1)
sys.exit(0 if any(r.get("requested_shape") == sys.argv[2] and r.get("concurrency") == int(sys.argv[3])
                  and r.get("status") == "ok" for r in runs) else 1)' "$@"
}

soak_ok() {  # 0 when $STATE/soak.json holds a finished soak of at least SOAK_S seconds
    "$PYTHON" -c '
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(1)
sys.exit(0 if d.get("duration_s", 0) >= float(sys.argv[2]) else 1)' "$STATE/soak.json" "$SOAK_S"
}

run_points() {  # run_points RESERVE: the points not yet ok, ours then upstream, while time is left
    # (ours starts a point only when both fit, so that what runs comes in pairs)
    local reserve=$1 point shape c n label port t est need
    for point in $POINTS; do
        shape=${point%:*} c=${point#*:}
        for n in ours upstream; do
            label=$(label_of $n) port=$(flash_port $n)
            point_ok "$STATE/serve_$label.json" "$shape" "$c" && continue
            if ! healthy "$port"; then note "bench $label $point: server not healthy, not run"; continue; fi
            t=$(( $(left) - reserve )) est=$(estimate "$shape" "$c") need=$est
            if [ $n = ours ] && ! point_ok "$STATE/serve_upstream-native.json" "$shape" "$c"; then
                need=$((2 * est))
            fi
            if [ $t -lt $need ]; then note "bench $label $point: not started ($t s left < $need s)"; continue; fi
            step "bench_${label}_${shape}_c$c" $((t + 20)) "$PYTHON" "$REPO/bench/serve_bench.py" \
                --base-url "http://127.0.0.1:$port" --model flash --tokenizer "$(flash_ckpt ours)" \
                --label "$label" --shapes "$shape" --concurrency "$c" --prompts-per-concurrency "$PPC" \
                --num-warmups 0 --warmup-requests 8 --time-budget "$t" --resume \
                --log-dir "$STATE/logs_$label" --out "$STATE/serve_$label.json"
            tail -n 2 "$R/bench_${label}_${shape}_c$c.log" | tee -a "$OUT/summary.txt"
        done
    done
}

finish() {  # copy the state and the server logs into $R
    cp -r "$STATE"/. "$R"/ 2>/dev/null
    cp "$RUN_DIR"/serve_flash_*.log "$R"/ 2>/dev/null
    ls -la "$RUN_DIR"/prof_flash_* >"$R/trace_files.txt" 2>&1
}

device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; finish; exit 1; }

if [ "$PHASE" = 1 ]; then
    # The flash-layers checkpoints (also made by e2e.sh).
    gen_flash 120 || { note "gen_flash failed"; finish; exit 1; }
    start_flash ours
    if ! soak_ok; then
        if ! wait_flash ours $(( $(left) - SOAK_S - 40 )); then
            note "ours (8001) not healthy yet: run phase 1 again (the server keeps starting)"
            tail -n 40 "$RUN_DIR/serve_flash_ours.log"; finish; exit 1
        fi
        note "ours healthy; upstream: $(healthy 8002 && echo healthy || echo not started)"
        step openai_smoke 60 "$PYTHON" "$REPO/bench/openai_smoke.py" --url http://127.0.0.1:8001 \
            --model flash --out "$STATE/openai_smoke.json"
        tail -n 3 "$R/openai_smoke.log" | tee -a "$OUT/summary.txt"
        if [ "$(left)" -lt $((SOAK_S + 45)) ]; then
            note "soak not started ($(left) s left < $((SOAK_S + 45)) s): run phase 1 again"
            finish; exit 1
        fi
        # Alone on the GPU: no other server compiling or capturing graphs meanwhile.
        log_lines=$(wc -l <"$RUN_DIR/serve_flash_ours.log" 2>/dev/null || echo 0)
        step soak $((SOAK_S + 45)) "$PYTHON" "$REPO/bench/soak.py" --url http://127.0.0.1:8001 \
            --model flash --clients 64 --duration "$SOAK_S" --vocab 1000 --timeout 90 \
            --drain-timeout 30 --server-pid "$(cat "$RUN_DIR/serve_flash_ours.pid")" \
            --prompt-tokens-details --out "$STATE/soak.json"
        "$PYTHON" - "$STATE/soak.json" "$RUN_DIR/serve_flash_ours.log" "$log_lines" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
d["concurrent_on_machine"] = "none: the upstream server starts after the soak"
# Kernels the server compiled while the soak ran (each stalls every request in the step).
new = open(sys.argv[2], errors="replace").read().split("\n")[int(sys.argv[3] or 0):]  # as wc -l counts
d["server_jit_compiles_during_soak"] = [
    line[-160:] for line in new
    if "begins to compile" in line or "JIT compilation during inference" in line
]
json.dump(d, open(sys.argv[1], "w"), indent=2)
keys = ("duration_s", "requests", "errors", "latency_s", "ttft_s", "gpu_memory_growth_mib",
        "memory_flat", "greedy_verdict", "greedy_cached_tokens", "server_jit_compiles_during_soak")
print("soak:", {k: d.get(k) for k in keys})
PY
    fi
    start_flash upstream  # after the soak: it warms up now and in the gap before phase 2
    finish
    exit 0
fi

# Phase 2.
for n in ours upstream; do
    healthy "$(flash_port $n)" || { note "$n not healthy: starting it (costs minutes)"; start_flash $n; }
done
for n in ours upstream; do
    wait_flash $n $(( $(left) - RESERVE_S )) || note "$n not healthy after waiting"
done
run_points "$RESERVE_S"

profiles=()
for n in ours upstream; do
    label=$(label_of $n) port=$(flash_port $n)
    t=$(( $(left) - 45 ))
    [ $t -gt 150 ] && t=150
    if ! healthy "$port" || [ $t -lt 40 ]; then note "profile $label: not run ($t s left)"; continue; fi
    step "profile_$label" "$t" "$PYTHON" "$REPO/bench/profile_server.py" run \
        --base-url "http://127.0.0.1:$port" --model flash --trace-dir "$(flash_prof_dir $n)" \
        --label "$label" --concurrency "$PROFILE_CONC" --prompt-len 1024 --max-tokens 4096 \
        --profile-s "$PROFILE_S" --trace-timeout $((t - 30)) \
        --out "$STATE/profile_$label.json" --md "$STATE/profile_$label.md"
    [ -f "$STATE/profile_$label.json" ] && profiles+=("$STATE/profile_$label.json")
done
if [ ${#profiles[@]} -ge 2 ]; then
    step profile_compare 60 "$PYTHON" "$REPO/bench/profile_server.py" compare "${profiles[@]}" \
        --md "$STATE/profile_compare.md" --json "$STATE/profile_compare.json"
    cat "$STATE/profile_compare.md"
fi
results=()
for n in ours upstream; do
    f="$STATE/serve_$(label_of $n).json"
    [ -f "$f" ] && results+=("$f")
done
if [ ${#results[@]} -ge 1 ]; then
    step plot 60 "$PYTHON" "$REPO/bench/plot_serve.py" "${results[@]}" --md "$STATE/serve_bench.md" \
        --json "$STATE/serve_bench_table.json"
    step plot_png 60 "$PYTHON" "$REPO/bench/plot_serve.py" "${results[@]}" --png "$STATE/serve_bench.png"
    cat "$STATE/serve_bench.md"
fi
if [ "${STOP_SERVERS:-1}" = 1 ]; then
    stop_flash ours upstream
    note "servers stopped"
fi
# Raw profiler traces: their own archive.
# shellcheck disable=SC2046
tar -C "$RUN_DIR" -czf "$OUT/traces.tgz" $(cd "$RUN_DIR" && ls -d prof_flash_* 2>/dev/null) 2>/dev/null
finish
