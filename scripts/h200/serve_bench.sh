#!/usr/bin/env bash
# On the H200, issue 9, as two device calls of under 580 s each, back to back (the machine goes
# back 30 s after a call; the servers started by call 1 outlive it: setsid):
#   call 1: bash scripts/h200/serve_bench.sh 1
#     start both flash-layers servers (ours: port 8001, full NVFP4, our overlay; upstream: port
#     8002, pristine vLLM 0.21.0 on the native FP8/MXFP4 checkpoint of the same seed; env.sh's
#     start_flash: the same flags for both), wait for ours, OpenAI client checks on ours
#     (bench/openai_smoke.py: completions and chat, streamed and not), soak ours (bench/soak.py: 64 clients,
#     SOAK_S = 300 s, mixed lengths, greedy cold/cached/after check, its GPU memory), then
#     benchmark points while time is left.
#   call 2: bash scripts/h200/serve_bench.sh 2
#     the benchmark points not yet ok (`vllm bench serve` through bench/serve_bench.py, ours then
#     upstream per point), keeping RESERVE_S for the GPU profiles of both servers
#     (bench/profile_server.py: decode at batch PROFILE_CONC, per-kernel and per-category time per
#     decode step), their comparison and the plots (bench/plot_serve.py); then stops the servers.
# Results accumulate in $STATE (/tmp/serve_bench_state) across the calls; each call bundles what
# exists into $OUT/serve_bench_<phase>.tgz (raw traces: $OUT/traces.tgz when small enough) and
# logs one line per step in $OUT/summary.txt. Every step is time-boxed against BUDGET (wall
# seconds for this call, default 570).
set -u
PHASE=${1:-}
[ "$PHASE" = 1 ] || [ "$PHASE" = 2 ] || { echo "usage: $0 1|2" >&2; exit 2; }
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-570}
STATE=${STATE:-/tmp/serve_bench_state}
SOAK_S=${SOAK_S:-300}
# Decode-heavy points first (the budget may not reach the last ones); the tables sort them.
POINTS=${POINTS:-1024x1024:64 1024x1024:8 8192x1024:64 8192x1024:8 1024x1024:1 8192x1024:1}
PPC=${PPC:-1}                    # prompts per unit of concurrency: one wave per point
RESERVE_S=${RESERVE_S:-180}      # call 2: kept for the profiles, the plots and the bundle
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
    python3 -c '
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError):
    sys.exit(1)
sys.exit(0 if any(r.get("requested_shape") == sys.argv[2] and r.get("concurrency") == int(sys.argv[3])
                  and r.get("status") == "ok" for r in runs) else 1)' "$@"
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
            step "bench_${label}_${shape}_c$c" $((t + 20)) python3 "$REPO/bench/serve_bench.py" \
                --base-url "http://127.0.0.1:$port" --model flash --tokenizer /tmp/ckpt/flash-nvfp4 \
                --label "$label" --shapes "$shape" --concurrency "$c" --prompts-per-concurrency "$PPC" \
                --num-warmups 0 --warmup-requests 8 --time-budget "$t" --resume \
                --log-dir "$STATE/logs_$label" --out "$STATE/serve_$label.json"
            tail -n 2 "$R/bench_${label}_${shape}_c$c.log" | tee -a "$OUT/summary.txt"
        done
    done
}

finish() {  # copy the state and the server logs into $R, bundle
    cp -r "$STATE"/. "$R"/ 2>/dev/null
    cp /tmp/serve_flash_*.log "$R"/ 2>/dev/null
    ls -la /tmp/prof_flash_* >"$R/trace_files.txt" 2>&1
    bundle "serve_bench_$PHASE"
}

device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; finish; exit 1; }

if [ "$PHASE" = 1 ]; then
    for f in /tmp/ckpt/flash-nvfp4/config.json /tmp/ckpt/flash-native/config.json; do
        [ -f $f ] || { note "missing $f"; finish; exit 1; }
    done
    start_flash ours
    start_flash upstream
    if ! wait_flash ours $(( $(left) - 120 )); then
        note "ours (8001) not healthy"; tail -n 80 /tmp/serve_flash_ours.log; finish; exit 1
    fi
    note "ours healthy; upstream healthy: $(healthy 8002 && echo yes || echo no)"
    step openai_smoke 60 python3 "$REPO/bench/openai_smoke.py" --url http://127.0.0.1:8001 \
        --model flash --out "$STATE/openai_smoke.json"
    tail -n 3 "$R/openai_smoke.log" | tee -a "$OUT/summary.txt"
    up_note="upstream server (8002) already healthy (idle) during the soak"
    healthy 8002 || up_note="upstream server (8002) was starting (compile, CUDA-graph capture) on the same GPU during the soak"
    soak_s=$(( $(left) - 75 ))
    [ $soak_s -gt "$SOAK_S" ] && soak_s=$SOAK_S
    [ $soak_s -lt "$SOAK_S" ] && note "soak shortened to $soak_s s (the budget)"
    step soak $(( $(left) - 15 )) python3 "$REPO/bench/soak.py" --url http://127.0.0.1:8001 \
        --model flash --clients 64 --duration "$soak_s" --vocab 1000 --timeout 90 --drain-timeout 40 \
        --server-pid "$(cat /tmp/serve_flash_ours.pid)" --prompt-tokens-details --out "$STATE/soak.json"
    python3 - "$STATE/soak.json" "$up_note" <<'PY'
import json, sys
p, note = sys.argv[1], sys.argv[2]
try:
    d = json.load(open(p))
except (OSError, ValueError):
    sys.exit(0)
d["concurrent_on_machine"] = note
json.dump(d, open(p, "w"), indent=2)
keys = ("duration_s", "requests", "errors", "latency_s", "gpu_memory_growth_mib", "memory_flat",
        "greedy_identical", "greedy_verdict", "greedy_verdicts", "greedy_cached_tokens")
print({k: d.get(k) for k in keys})
PY
    [ -f "$STATE/soak.json" ] && python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("soak:", {k: d.get(k) for k in ("requests","errors","memory_flat","greedy_verdict")})' "$STATE/soak.json" >>"$OUT/summary.txt"
    run_points 25
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
    step "profile_$label" "$t" python3 "$REPO/bench/profile_server.py" run \
        --base-url "http://127.0.0.1:$port" --model flash --trace-dir "$(flash_prof_dir $n)" \
        --label "$label" --concurrency "$PROFILE_CONC" --prompt-len 1024 --max-tokens 4096 \
        --profile-s "$PROFILE_S" --trace-timeout $((t - 30)) \
        --out "$STATE/profile_$label.json" --md "$STATE/profile_$label.md"
    [ -f "$STATE/profile_$label.json" ] && profiles+=("$STATE/profile_$label.json")
done
if [ ${#profiles[@]} -ge 2 ]; then
    step profile_compare 60 python3 "$REPO/bench/profile_server.py" compare "${profiles[@]}" \
        --md "$STATE/profile_compare.md" --json "$STATE/profile_compare.json"
    cat "$STATE/profile_compare.md"
fi
results=()
for n in ours upstream; do
    f="$STATE/serve_$(label_of $n).json"
    [ -f "$f" ] && results+=("$f")
done
if [ ${#results[@]} -ge 1 ]; then
    step plot 60 python3 "$REPO/bench/plot_serve.py" "${results[@]}" --md "$STATE/serve_bench.md" \
        --json "$STATE/serve_bench_table.json"
    step plot_png 60 python3 "$REPO/bench/plot_serve.py" "${results[@]}" --png "$STATE/serve_bench.png"
    cat "$STATE/serve_bench.md"
fi
if [ "${STOP_SERVERS:-1}" = 1 ]; then
    stop_flash ours upstream
    note "servers stopped"
fi
# Raw traces: their own archive, only when it stays under the 16 MiB a returned file may have.
tar -C /tmp -czf "$OUT/traces.tgz" $(cd /tmp && ls -d prof_flash_* 2>/dev/null) 2>/dev/null
if [ -f "$OUT/traces.tgz" ] && [ "$(stat -c %s "$OUT/traces.tgz")" -gt 15000000 ]; then
    note "traces.tgz $(stat -c %s "$OUT/traces.tgz") bytes: too large to return, removed"
    rm -f "$OUT/traces.tgz"
fi
finish
