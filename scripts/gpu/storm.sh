#!/usr/bin/env bash
# The 20-minute storm (issue 30) on `make serve`'s server (scripts/serve.sh, the tiny full-NVFP4
# checkpoint), with kill -9 restarts and checkpoint faults beside it. One command per call, call
# it again until it prints "storm.sh: done" (each call stops before BUDGET wall seconds, default
# 540; servers and the storm client run under setsid and outlive a call; PACK_OUT=1 (env.sh) packs
# each call's results into results.tgz, for a transport that returns few files):
#   PACK_OUT=1 bash scripts/gpu/storm.sh
# Phases (state and results in $RUN_DIR/storm; every call copies results/ to $OUT):
#  1. setup: device.txt, our vLLM copy (make_ours), the tiny nvfp4 checkpoint.
#  2. storm server on port 8000 (--gpu-memory-utilization 0.4, prompt-token details), its JIT
#     caches in storm/cache (empty at first: a cold start); wait for /health.
#  3. bench/storm.py under setsid as soon as it is healthy: CLIENTS (128) clients for STORM_S
#     (1200) s, --server-pid/--server-log/--cache-dir of this server -> storm.json, storm.md.
#  While the storm runs (other ports and caches, so its cache and log checks see only its own):
#  4. checkpoint faults (bench/checkpoint_faults.py, ports 8100+, --gpu-memory-utilization 0.05
#     so vLLM's free-memory check passes beside the storm server) -> faults.json.
#  5. restarts on port 8010 with cold caches in storm/cache_restart: kill -9 during load (at
#     "Starting to load model" or 300 s), start again and kill -9 during serving (soak load),
#     start again: healthy, greedy answers, clean stop; then bench/cache_integrity.py on those
#     caches -> restart.json, cache_restart.json.
#  6. wait for the storm; stop its server; cache_integrity.py on its caches -> cache_storm.json.
# Expected device time: ~4 min cold start + 20 min storm + ~1 min drain/checks = about 26 min
# in 3-4 calls (phases 4-5 overlap the storm). Copy storm.json to bench/results/h200/storm.json.
set -u
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-540}
STORM_S=${STORM_S:-1200}
CLIENTS=${CLIENTS:-128}
S=$RUN_DIR/storm
CALL_OUT=$OUT
OUT=$S/results R=$S/results
mkdir -p "$R"
TINY=$CKPT_DIR/tiny-nvfp4
note() { echo "$(date -u +%T) [${SECONDS}s] $*" | tee -a "$R/summary.txt"; }
left() { echo $((BUDGET - SECONDS)); }
# a zombie (exited, not yet reaped by whoever adopted it) is not alive
alive() {
    [ -f "$1" ] || return 1
    local st
    st=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "${st:0:1}" != Z ]
}
group_alive() { ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {n++} END {exit !n}'; }
copy_out() { cp -r "$R/." "$CALL_OUT/" 2>/dev/null; cp "$S"/*.log "$CALL_OUT/" 2>/dev/null; true; }
trap 'copy_out; [ "${PACK_OUT:-0}" = 1 ] && pack_out "$CALL_OUT"' EXIT
wait_healthy() {  # wait_healthy PORT PIDFILE SECONDS: 0 healthy, 1 died, 2 not yet
    local i
    for ((i = 0; i < $3; i += 2)); do
        healthy "$1" && return 0
        alive "$2" || return 1
        sleep 2
    done
    healthy "$1" && return 0
    return 2
}
start_server() {  # start_server PORT PIDFILE LOG CACHE EXTRA_ARGS
    mkdir -p "$4"
    CUTEDSL_CACHE_DIR=$4/cutedsl TILELANG_CACHE_DIR=$4/tilelang TINY_DIR=$TINY PORT=$1 \
        VLLM_EXTRA_ARGS="$5" setsid "${OURS[@]}" bash "$REPO/scripts/serve.sh" >>"$3" 2>&1 </dev/null &
    echo $! >"$2"
    note "started server port $1 pid $! ($3)"
}
kill9() {  # kill9 PIDFILE: SIGKILL the process group; 0 when nothing of it is left after 10 s
    local pid i
    pid=$(cat "$1")
    kill -KILL -- "-$pid" 2>/dev/null
    for ((i = 0; i < 10; i++)); do
        group_alive "$pid" || return 0
        sleep 1
    done
    note "left running after kill -9 of group $pid: $(ps -eo pid=,pgid=,stat=,comm= | awk -v g="$pid" '$2 == g')"
    return 1
}
stop_server() {  # stop_server PIDFILE: SIGTERM the group, SIGKILL after 30 s; 0 when it stopped on SIGTERM
    local pid i rc=1
    pid=$(cat "$1" 2>/dev/null) || return 0
    kill -TERM -- "-$pid" 2>/dev/null
    for ((i = 0; i < 30; i++)); do
        group_alive "$pid" || { rc=0; break; }
        sleep 1
    done
    kill -KILL -- "-$pid" 2>/dev/null
    rm -f "$1"
    return $rc
}

# 1. setup
if [ ! -f "$S/setup.done" ]; then
    command -v ps >/dev/null || { note "ps (procps) is missing: process groups cannot be checked"; exit 1; }
    device_info
    make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; exit 1; }
    if [ ! -f "$TINY/config.json" ] || [ ! -f "$TINY/tokenizer.json" ]; then
        step gen_tiny 300 "$PYTHON" -m cutedsl.tools.tiny_model "$TINY" --format nvfp4 --force || exit 1
    fi
    touch "$S/setup.done"
fi

# 2. the storm server
SP=$S/storm_server.pid
if [ ! -f "$R/storm.json" ] && [ -f "$S/storm.started" ]; then
    # never a second server under a running storm (its --server-pid would be stale): storm.py
    # records what the clients saw
    alive "$SP" || note "storm server died during the storm (serve_storm.log)"
elif [ ! -f "$R/storm.json" ] && ! healthy 8000; then
    alive "$SP" || start_server 8000 "$SP" "$S/serve_storm.log" "$S/cache" \
        "--gpu-memory-utilization 0.4 --enable-prompt-tokens-details"
    wait_healthy 8000 "$SP" $(($(left) - 20)); rc=$?
    [ $rc = 1 ] && { note "storm server died"; tail -n 40 "$S/serve_storm.log"; exit 1; }
    [ $rc = 2 ] && { note "storm server not healthy yet; call again"; exit 0; }
    note "storm server healthy"
fi

# 3. the storm
TP=$S/storm.pid
if [ ! -f "$R/storm.json" ] && [ -f "$S/storm.started" ] && ! alive "$TP"; then
    note "storm.py ended without storm.json"; tail -n 40 "$S/storm.log"; exit 1
fi
if [ ! -f "$R/storm.json" ] && ! alive "$TP"; then
    model=$(curl -s http://127.0.0.1:8000/v1/models | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    vocab=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$TINY/config.json")
    setsid "$PYTHON" "$REPO/bench/storm.py" --url http://127.0.0.1:8000 --model "$model" \
        --vocab "$vocab" --clients "$CLIENTS" --duration "$STORM_S" --server-pid "$(cat "$SP")" \
        --server-log "$S/serve_storm.log" --cache-dir "$S/cache/cutedsl" --cache-dir "$S/cache/tilelang" \
        --prompt-tokens-details --require-memory --out "$R/storm.json" >"$S/storm.log" 2>&1 </dev/null &
    echo $! >"$TP"
    touch "$S/storm.started"
    note "storm started: pid $!, $CLIENTS clients, $STORM_S s"
fi

# 4. checkpoint faults (beside the storm)
if [ ! -f "$R/faults.json" ] && [ "$(left)" -gt 200 ]; then
    step faults $(($(left) - 20)) "$PYTHON" "$REPO/bench/checkpoint_faults.py" --src "$TINY" --work "$S/faults" \
        --out "$R/faults.json" --timeout 300 --port 8100 -- \
        env "CUTEDSL_CACHE_DIR=$S/cache_faults/cutedsl" "TILELANG_CACHE_DIR=$S/cache_faults/tilelang" \
        "TINY_DIR={ckpt}" "PORT={port}" PREWARM_MHC=0 PREWARM_KERNELS=0 \
        "VLLM_EXTRA_ARGS=--gpu-memory-utilization 0.05" \
        "${OURS[@]}" bash "$REPO/scripts/serve.sh"
    tail -n 8 "$R/faults.log"
fi

# 5. restarts (beside the storm): kill -9 during load, during serving, then a clean start
RP=$S/restart_server.pid
RL=$S/serve_restart.log
RARGS="--gpu-memory-utilization 0.25 --enable-prompt-tokens-details"
# one file per step, so that a step run again after a killed call replaces its record
record() { echo "$2" >"$S/restart_step.$1.json"; }
tf() { [ "$1" = 0 ] && echo true || echo false; }  # tf RC: JSON true for 0
# (a cold start spends ~90 s compiling the mHC kernels and ~50 s starting vLLM before it loads)
if [ ! -f "$S/restart_load.done" ] && [ "$(left)" -gt 330 ]; then
    rm -rf "$S/cache_restart" "$S"/restart_step.*.json
    start_server 8010 "$RP" "$RL" "$S/cache_restart" "$RARGS"
    t0=$SECONDS at=timeout
    while ((SECONDS - t0 < 300)) && alive "$RP"; do
        grep -q "Starting to load model\|Loading weights\|Loading safetensors" "$RL" && { at=loading; sleep 5; break; }
        sleep 1
    done
    kill9 "$RP"; clean=$?
    note "kill -9 during load ($at, $((SECONDS - t0)) s after start): group gone=$([ $clean = 0 ] && echo yes || echo no)"
    record 1 "{\"kill\": \"during_load\", \"at\": \"$at\", \"after_s\": $((SECONDS - t0)), \"group_gone\": $(tf $clean)}"
    touch "$S/restart_load.done"
fi
if [ -f "$S/restart_load.done" ] && [ ! -f "$S/restart_serving.done" ] && [ "$(left)" -gt 150 ]; then
    healthy 8010 || alive "$RP" || start_server 8010 "$RP" "$RL" "$S/cache_restart" "$RARGS"
    t0=$SECONDS
    wait_healthy 8010 "$RP" $(($(left) - 60)); rc=$?
    [ $rc = 2 ] && { note "restart server not healthy yet; call again"; exit 0; }
    [ $rc = 1 ] && { note "restart server died after the kill during load"; tail -n 40 "$RL"; }
    record 2 "{\"start\": \"after_kill_during_load\", \"healthy\": $(tf $rc), \"waited_s\": $((SECONDS - t0))}"
    if [ $rc = 0 ]; then
        model=$(curl -s http://127.0.0.1:8010/v1/models | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
        "$PYTHON" "$REPO/bench/soak.py" --url http://127.0.0.1:8010 --model "$model" --clients 16 \
            --duration 30 --memory-warmup-s 0 --out "$S/restart_soak.json" >"$S/restart_soak.log" 2>&1 &
        load=$!
        sleep 12
        kill9 "$RP"; clean=$?
        note "kill -9 during serving: group gone=$([ $clean = 0 ] && echo yes || echo no)"
        record 3 "{\"kill\": \"during_serving\", \"group_gone\": $(tf $clean)}"
        wait "$load"  # its requests fail once the server is gone (expected)
    fi
    touch "$S/restart_serving.done"
fi
if [ -f "$S/restart_serving.done" ] && [ ! -f "$R/restart.json" ] && [ "$(left)" -gt 120 ]; then
    healthy 8010 || alive "$RP" || start_server 8010 "$RP" "$RL" "$S/cache_restart" "$RARGS"
    t0=$SECONDS
    wait_healthy 8010 "$RP" $(($(left) - 40)); rc=$?
    [ $rc = 2 ] && { note "restart server not healthy yet; call again"; exit 0; }
    waited=$((SECONDS - t0))
    ok=false
    if [ $rc = 0 ]; then
        model=$(curl -s http://127.0.0.1:8010/v1/models | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
        # serves = its requests answered without error and greedy outputs repeat; the soak's own
        # exit status also weighs GPU memory growth, which a server's first prefills after a cold
        # start show (not what this check is about)
        step restart_check 120 "$PYTHON" "$REPO/bench/soak.py" --url http://127.0.0.1:8010 \
            --model "$model" --clients 8 --duration 10 --memory-warmup-s 0 \
            --out "$R/restart_check.json"
        "$PYTHON" -c 'import json, sys; d = json.load(open(sys.argv[1]))
sys.exit(0 if d["errors"] == 0 and d["requests"] > 0 and d["greedy_ok"] else 1)' \
            "$R/restart_check.json" 2>/dev/null && ok=true
    fi
    stop_server "$RP"; stopped=$?
    record 4 "{\"start\": \"after_kill_during_serving\", \"healthy\": $(tf $rc), \"waited_s\": $waited, \"serves\": $ok, \"stopped_on_sigterm\": $(tf $stopped)}"
    step cache_restart 300 "$PYTHON" "$REPO/bench/cache_integrity.py" --cutedsl "$S/cache_restart/cutedsl" \
        --tilelang "$S/cache_restart/tilelang" --out "$R/cache_restart.json"
    # Corrupt entries the restarted server met and replaced are in its log (jit.py / TileLang warnings).
    "$PYTHON" - "$S" "$RL" "$R/cache_restart.json" "$R/restart.json" "$REPO/bench" <<'PY'
import datetime, glob, json, os, re, sys
sys.path.insert(0, sys.argv[5])
import startup
steps = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "restart_step.*.json")))]
log = open(sys.argv[2], errors="replace").read()
warned = re.findall(r".*(?:recompiling it \(not loaded\)|Cannot build kernel from cache).*", log)
cache = json.load(open(sys.argv[3])) if os.path.exists(sys.argv[3]) else None
ok = (all(s.get("group_gone", True) and s.get("healthy", True) and s.get("serves", True)
          and s.get("stopped_on_sigterm", True) for s in steps)
      and len(steps) == 4 and cache is not None and cache["ok"])
doc = {"command": "bash scripts/gpu/storm.sh (phase 5: restarts)",
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "device": startup._device(), "commit": startup._commit(), "steps": steps,
       "corrupt_entries_met_on_restart": warned[:20], "cache_integrity": cache, "ok": ok}
json.dump(doc, open(sys.argv[4], "w"), indent=1)
print("restart ok" if ok else "restart FAILED", json.dumps(steps))
PY
fi

# 6. the end of the storm
if [ ! -f "$R/storm.json" ]; then
    while [ ! -f "$R/storm.json" ] && alive "$TP" && [ "$(left)" -gt 15 ]; do sleep 10; done
    tail -n 1 "$S/storm.log"
    if [ ! -f "$R/storm.json" ] && alive "$TP"; then note "storm running; call again"; exit 0; fi
    [ -f "$R/storm.json" ] || { note "storm.py ended without storm.json"; tail -n 40 "$S/storm.log"; exit 1; }
fi
if [ -f "$SP" ]; then
    stop_server "$SP"
    step cache_storm 300 "$PYTHON" "$REPO/bench/cache_integrity.py" --cutedsl "$S/cache/cutedsl" \
        --tilelang "$S/cache/tilelang" --out "$R/cache_storm.json"
fi
missing=""
for f in storm.json faults.json restart.json; do [ -f "$R/$f" ] || missing="$missing $f"; done
if [ -n "$missing" ]; then note "still to do:$missing; call again"; exit 0; fi
cat "$R/storm.md"
"$PYTHON" -c '
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f)); print(f.rsplit("/", 1)[-1], "ok" if d.get("ok", d.get("verdict", {}).get("ok")) else "FAILED")
' "$R/storm.json" "$R/faults.json" "$R/restart.json" | tee -a "$R/summary.txt"
echo "storm.sh: done"
