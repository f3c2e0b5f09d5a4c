#!/usr/bin/env bash
# Serving at depth: ours vs upstream vLLM 0.21.0 on the flash-layers checkpoint at FLASH_LAYERS
# layers (default 8, at real DSv4-Flash layer sizes).
#
#   bash scripts/gpu/serving.sh        # call again until it prints "serving: done"
#
# Each call does what is not done yet, within BUDGET wall seconds (default 570), in this order:
#   1. generate both checkpoints (ours: full NVFP4; upstream: the native FP8 + MXFP4 checkpoint of
#      the same seed), in the background, while vLLM's mHC kernels (TileLang, DeepGEMM) are
#      compiled into their disk caches from each server's vLLM tree (cutedsl/tools/prewarm_mhc.py)
#      and upstream's DeepGEMM kernels into theirs, many
#      at once (bench/deepgemm_prewarm.py; DEEPGEMM_PREWARM=0 leaves them to upstream's own serial
#      warm-up, about 10 min on a fresh machine); refuses to start without the disk space;
#   2. ours, then upstream, each alone on the GPU (ONE_AT_A_TIME=1, the default; 0 keeps both
#      servers up at once, GPU_MEM_UTIL each): start the server (env.sh start_flash: ports
#      8001/8002, identical flags, CUDA graphs for CAPTURE_SIZES, KV_CACHE_BYTES of KV cache),
#      wait until healthy and until the DeepGEMM prewarm has finished (no measurement runs beside
#      it), then
#      a. `vllm bench serve` (bench/serve_bench.py --in-process, one dataset seed per run) on every
#         SHAPES x CONCS point, REPEATS times (default 2), each point's first run after one warm-up
#         wave at its concurrency (its prefill token counts seen once: first-use stalls are
#         startup.sh's), a run during which anything compiled run again (RETRY_ON_COMPILE times
#         at most); all of them before any profiler has attached to the server;
#      b. per concurrency in PROFILE_CONCS, its decode profile (bench/profile_server.py, PROFILE_S s,
#         1024-token prompts); per concurrency in HOST_CONCS, its host profile with no profiler
#         attached (bench/host_profile.py: step time, CPU per server thread, foreign load, and
#         py-spy stacks of the busiest server processes when PYSPY names a py-spy binary);
#      c. its greedy outputs (step 4); then the server is stopped;
#   3. the copy bandwidth, then bench/serving.py report: serving.json/.md/.png;
#   4. for each server GREEDY names (default "ours upstream"; 0: none), its greedy outputs on
#      bench/greedy_parity.py's prompts, taken through the server once before its benchmark
#      (greedy_server_NAME_fresh.json) and once after its profiles (greedy_server_NAME.json), then,
#      the servers stopped, through LLM.generate built from the same flags (GREEDY_MIN_S, default
#      240: the seconds one needs), compared with both: greedy_parity_NAME.json; GREEDY_PROCS=2
#      runs LLM.generate in a second fresh process too, compared with the first
#      (greedy_parity_NAME_2.json).
# Checkpoints go to CKPT_DIR (default $RUN_DIR/checkpoints, outside the checkout: a checkout
# carried to the GPU machine is replaced on every call; /dev/shm/cutedsl-checkpoints when the disk
# lacks the room and memory has it; when neither holds both, upstream's goes to /dev/shm,
# CKPT_DIR_UPSTREAM).
# COMMIT names the code's commit in the results where the checkout has no git metadata.
# Servers and generators run in their own process groups and outlive a call; state accumulates in
# $STATE. Every call copies the results into $OUT (serving.*, serve_*.json, profile_*.json/.md,
# ckpt_bytes_*.txt, the server logs) and appends one line per step to $OUT/summary.txt.
set -u
ONE_AT_A_TIME=${ONE_AT_A_TIME:-1}
GB_PER_LAYER=${GB_PER_LAYER:-7.5}  # both checkpoints together, per layer (3.6 + 3.4 GB, rounded up)
export FLASH_LAYERS=${FLASH_LAYERS:-8} MAX_NUM_SEQS=${MAX_NUM_SEQS:-128}
if [ "$ONE_AT_A_TIME" = 1 ]; then GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.85}; else GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.45}; fi
export GPU_MEM_UTIL CAPTURE_SIZES=${CAPTURE_SIZES:-1 2 4 8 16 32 64 128}
if [ -z "${CKPT_DIR:-}" ]; then
    # the first of these that holds both checkpoints already, else the first with the room for
    # both, else ours in the first with the room for one and upstream's in the other
    dirs=("${RUN_DIR:-${TMPDIR:-/tmp}/cutedsl-gpu}/checkpoints" /dev/shm/cutedsl-checkpoints)
    free_gb() { mkdir -p "$1" 2>/dev/null && df -BG --output=avail "$1" | tail -1 | tr -dc 0-9; }
    need_gb=$(awk -v l="$FLASH_LAYERS" -v g="$GB_PER_LAYER" 'BEGIN { printf "%d", l * g + 4 }')
    half_gb=$(awk -v l="$FLASH_LAYERS" -v g="$GB_PER_LAYER" 'BEGIN { printf "%d", l * g / 2 + 2 }')
    for d in "${dirs[@]}"; do
        if [ -f "$d/flash$FLASH_LAYERS-nvfp4/config.json" ] && [ -f "$d/flash$FLASH_LAYERS-native/config.json" ]; then
            CKPT_DIR=$d; break
        fi
    done
    if [ -z "${CKPT_DIR:-}" ] && [ -f "${dirs[0]}/flash$FLASH_LAYERS-nvfp4/config.json" ] \
        && [ -f "${dirs[1]}/flash$FLASH_LAYERS-native/config.json" ]; then
        CKPT_DIR=${dirs[0]} CKPT_DIR_UPSTREAM=${dirs[1]}
    fi
    for d in "${dirs[@]}"; do
        [ -n "${CKPT_DIR:-}" ] && break
        [ "$(free_gb "$d")" -ge "$need_gb" ] 2>/dev/null && CKPT_DIR=$d
    done
    if [ -z "${CKPT_DIR:-}" ] && [ "$(free_gb "${dirs[0]}")" -ge "$half_gb" ] 2>/dev/null \
        && [ "$(free_gb "${dirs[1]}")" -ge "$half_gb" ] 2>/dev/null; then
        CKPT_DIR=${dirs[0]} CKPT_DIR_UPSTREAM=${dirs[1]}
    fi
    export CKPT_DIR=${CKPT_DIR:-${dirs[0]}} CKPT_DIR_UPSTREAM=${CKPT_DIR_UPSTREAM:-}
fi
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-570}
STATE=${STATE:-$RUN_DIR/serving_state}
SHAPES=${SHAPES:-1024x1024 8192x1024}
CONCS=${CONCS:-1 4 16 64 128}
REPEATS=${REPEATS:-2}
PROFILE_CONCS=${PROFILE_CONCS-1 4 16 64 128}  # empty: no profiles
PROFILE_S=${PROFILE_S:-2}  # seconds of decode each profile records (the trace write takes ~5x that)
HOST_CONCS=${HOST_CONCS-4 64}  # empty: no host profiles
PYSPY=${PYSPY:-$(command -v py-spy || true)}
MIN_RUN_S=${MIN_RUN_S:-40}  # a bench point is not started with less time than this left
# a run during which the server compiled anything (a log line, or a new file in a JIT cache) is run
# again, up to this many times (serve_bench.py --retry-on-compile: steady state, not a first use)
RETRY_ON_COMPILE=${RETRY_ON_COMPILE:-2}
# requests per bench point = PPC x concurrency: PPC waves of prefill + decode averaged in one point
# (with one wave, two repeats of a point differed by up to 15 %)
PPC=${PPC:-3}
# 1: compile upstream's DeepGEMM kernels in parallel before it starts (bench/deepgemm_prewarm.py)
DEEPGEMM_PREWARM=${DEEPGEMM_PREWARM:-1}
# whose greedy outputs through the server are compared with LLM.generate (step 4;
# bench/greedy_parity.py): names, or 0 for none (1: both)
GREEDY=${GREEDY:-ours upstream}
case $GREEDY in 0) GREEDY= ;; 1) GREEDY="ours upstream" ;; esac
for n in $GREEDY; do
    case $n in ours | upstream) ;; *) echo "serving.sh: GREEDY=$GREEDY: each name is ours or upstream, or 0" >&2; exit 2 ;; esac
done
# which server goes first (ORDER="upstream ours" starts upstream first: its cold start JIT-compiles
# about 1,700 DeepGEMM kernels, about 10 min on a fresh machine)
ORDER=${ORDER:-ours upstream}
for n in $ORDER; do
    case $n in ours | upstream) ;; *) echo "serving.sh: ORDER=$ORDER: each name is ours or upstream" >&2; exit 2 ;; esac
done
mkdir -p "$STATE"
# the settings that shape the results, as the report's command line
SETTINGS="FLASH_LAYERS=$FLASH_LAYERS SHAPES='$SHAPES' CONCS='$CONCS' REPEATS=$REPEATS PPC=$PPC"
SETTINGS+=" PROFILE_CONCS='$PROFILE_CONCS' PROFILE_S=$PROFILE_S HOST_CONCS='$HOST_CONCS' MIN_RUN_S=$MIN_RUN_S"
SETTINGS+=" RETRY_ON_COMPILE=$RETRY_ON_COMPILE"
SETTINGS+=" CAPTURE_SIZES='$CAPTURE_SIZES' MAX_NUM_SEQS=$MAX_NUM_SEQS"
[ -n "${FLASH_EXTRA_ENV:-}" ] && SETTINGS="FLASH_EXTRA_ENV='$FLASH_EXTRA_ENV' $SETTINGS"
[ "$DSV4_FIXED_REDUCTIONS" = 1 ] || SETTINGS="DSV4_FIXED_REDUCTIONS=$DSV4_FIXED_REDUCTIONS $SETTINGS"
left() { echo $((BUDGET - SECONDS)); }
note() { echo "$(date -u +%T) [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
label_of() { case $1 in ours) echo cutedsl-nvfp4 ;; upstream) echo upstream-native ;; esac; }

deepgemm_kernels() {  # DeepGEMM's compiled kernels: mtime, name and template arguments, one per line
    "$PYTHON" - "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/deep_gemm/cache" <<'PY'
import os, re, sys, time
root = sys.argv[1]
for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    cu = os.path.join(root, d, "kernel.cu")
    if not os.path.isfile(cu):
        continue
    args = re.search(r"_impl<([^>]*)>", open(cu, errors="replace").read())
    when = time.strftime("%H:%M:%S", time.gmtime(os.path.getmtime(cu)))
    print(when, d, re.sub(r"\s+", "", args[1]) if args else "?")
PY
}

finish() {
    deepgemm_kernels >"$R/deepgemm_kernels.txt" 2>&1
    cp "$STATE"/serving.* "$STATE"/serve_*.json "$STATE"/profile_*.json "$STATE"/profile_*.md "$STATE"/host_*.* \
        "$STATE"/ckpt_bytes_*.txt "$STATE"/copy.json "$STATE"/gen_*.log "$STATE"/cpu_*.log "$STATE"/greedy_*.json "$R"/ 2>/dev/null
    cp "$RUN_DIR"/serve_flash_*.log "$R"/ 2>/dev/null
    df -h "$CKPT_DIR" ${CKPT_DIR_UPSTREAM:+"$CKPT_DIR_UPSTREAM"} >"$R/df.txt" 2>&1
}

# --- 1. checkpoints and the mHC kernels, in the background ---
gen_done() { [ -f "$(flash_ckpt ours)/config.json" ] && [ -f "$(flash_ckpt upstream)/config.json" ]; }
running() { local pid; pid=$(cat "$1" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }
write_config() {  # write_config DIR FORMAT: the flash-layers checkpoint's config.json alone
    mkdir -p "$1" && "$PYTHON" -c 'import json, sys; from cutedsl.tools.tiny_model import make_config
json.dump(make_config("flash-layers", sys.argv[2], None, int(sys.argv[3])), open(sys.argv[1], "w"))' \
        "$1/config.json" "$2" "$FLASH_LAYERS"
}
start_gen() {
    local f d need free
    for f in nvfp4 native; do
        [ -f "$(flash_ckpt "$f")/config.json" ] && continue
        running "$STATE/gen_$f.pid" && continue
        d=$(dirname "$(flash_ckpt "$f")")
        # both in one directory: the room for both; apart: the room for one
        if [ "$d" = "$(dirname "$(flash_ckpt ours)")" ] && [ "$d" = "$(dirname "$(flash_ckpt upstream)")" ]; then
            need=$(awk -v l="$FLASH_LAYERS" -v g="$GB_PER_LAYER" 'BEGIN { printf "%d", l * g + 4 }')
        else
            need=$(awk -v l="$FLASH_LAYERS" -v g="$GB_PER_LAYER" 'BEGIN { printf "%d", l * g / 2 + 2 }')
        fi
        free=$(df -BG --output=avail "$d" | tail -1 | tr -dc 0-9)
        if [ "$free" -lt "$need" ]; then
            note "not enough room for $FLASH_TAG-$f: $free GB free in $d, need $need GB"
            return 1
        fi
        setsid "$PYTHON" -m cutedsl.tools.tiny_model "$(flash_ckpt "$f")" --preset flash-layers \
            --layers "$FLASH_LAYERS" --format "$f" --device cuda --force \
            >"$STATE/gen_$f.log" 2>&1 </dev/null &
        echo $! >"$STATE/gen_$f.pid"
        note "generating $(flash_ckpt "$f") (pid $!)"
    done
    if [ ! -f "$STATE/prewarm.ok" ] && ! running "$STATE/prewarm.pid"; then
        write_config "$STATE/cfg" nvfp4 || return 1  # the mHC kernels need only the config
        # in each server's vLLM tree: DeepGEMM's mHC GEMM entries are named by a hash of its header
        # path, which differs between the two (prewarm_mhc's docstring)
        setsid bash -c "$(printf '%q ' "${OURS[@]}")'$PYTHON' -m cutedsl.tools.prewarm_mhc '$STATE/cfg' \
            && '$PYTHON' -m cutedsl.tools.prewarm_mhc '$STATE/cfg' && touch '$STATE/prewarm.ok'" \
            >"$STATE/prewarm.log" 2>&1 </dev/null &
        echo $! >"$STATE/prewarm.pid"
    fi
    # upstream's DeepGEMM kernels, compiled in parallel into the cache its serial warm-up reads
    if [ "$DEEPGEMM_PREWARM" = 1 ] && [ ! -f "$STATE/deepgemm.ok" ] && ! running "$STATE/deepgemm.pid"; then
        write_config "$STATE/cfg_native" native || return 1  # before the checkpoint has its own
        setsid bash -c "'$PYTHON' '$REPO/bench/deepgemm_prewarm.py' '$STATE/cfg_native' \
            --max-tokens $MAX_NUM_BATCHED_TOKENS && touch '$STATE/deepgemm.ok'" \
            >"$STATE/deepgemm.log" 2>&1 </dev/null &
        echo $! >"$STATE/deepgemm.pid"
        note "DeepGEMM prewarm for upstream (pid $!)"
    fi
}

# --- 3./5. one bench pass of one server ---
cpu_watch() {  # cpu_watch FILE: load and the busiest processes, every 20 s until killed (or this script ends)
    while kill -0 $$ 2>/dev/null; do
        { echo "== $(date -u +%T)"; top -b -n 2 -d 1 -c -o %CPU -w 220 | awk '/^top -/ { f++ } f == 2' \
            | sed -n '1,3p;7,18p'; } >>"$1" 2>&1
        sleep 19
    done
}
bench_pass() {  # bench_pass ours|upstream REPEATS: every point up to that many repeats
    local n=$1 reps=$2 label port t
    label=$(label_of "$n") port=$(flash_port "$n")
    healthy "$port" || { note "bench $label: server not healthy"; return 1; }
    t=$(( $(left) - 30 ))
    [ "$t" -gt 60 ] || { note "bench $label x$reps: not started ($t s left)"; return 1; }
    # what else runs on the host during the pass (a repeat measured slower than the next one
    # otherwise leaves no trace)
    cpu_watch "$STATE/cpu_${label}_r$reps.log" &
    local watch=$!
    # shellcheck disable=SC2086
    step "bench_${label}_r$reps" $((t + 20)) "$PYTHON" "$REPO/bench/serve_bench.py" \
        --base-url "http://127.0.0.1:$port" --model flash --tokenizer "$(flash_ckpt ours)" \
        --label "$label" --shapes "$(echo $SHAPES | tr ' ' ,)" --concurrency "$(echo $CONCS | tr ' ' ,)" \
        --prompts-per-concurrency "$PPC" --repeats "$reps" --seed-per-run --in-process \
        --num-warmups 0 --warmup-per-concurrency --time-budget "$t" --min-run-s "$MIN_RUN_S" --resume \
        --retry-on-compile "$RETRY_ON_COMPILE" \
        --log-dir "$STATE/logs_$label" --server-log "$RUN_DIR/serve_flash_$n.log" \
        --out "$STATE/serve_$n.json"
    kill "$watch" 2>/dev/null
    tail -n 3 "$R/bench_${label}_r$reps.log" | tee -a "$OUT/summary.txt"
}
bench_done() {  # bench_done ours|upstream REPEATS: every point has that many ok repeats
    "$PYTHON" - "$STATE/serve_$1.json" "$2" "$SHAPES" "$CONCS" <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError):
    sys.exit(1)
ok = {(r["requested_shape"], r["concurrency"], r.get("repeat", 0)) for r in runs if r.get("status") == "ok"}
need = {(s, int(c), k) for s in sys.argv[3].split() for c in sys.argv[4].split() for k in range(int(sys.argv[2]))}
sys.exit(0 if need <= ok else 1)
PY
}

profile() {  # profile ours|upstream C
    local n=$1 c=$2 label port t
    label=$(label_of "$n") port=$(flash_port "$n")
    [ -f "$STATE/profile_${n}_c$c.json" ] && return 0
    t=$(( $(left) - 20 ))
    [ $t -gt 120 ] && t=120
    [ $t -ge 50 ] || { note "profile $label c$c: not run ($t s left)"; return 1; }
    step "profile_${label}_c$c" "$t" "$PYTHON" "$REPO/bench/profile_server.py" run \
        --base-url "http://127.0.0.1:$port" --model flash --trace-dir "$(flash_prof_dir "$n")" \
        --label "$label" --concurrency "$c" --prompt-len 1024 --max-tokens 4096 \
        --profile-s "$PROFILE_S" --trace-timeout $((t - 25)) \
        --out "$STATE/profile_${n}_c$c.json" --md "$STATE/profile_${n}_c$c.md"
    rm -f "$(flash_prof_dir "$n")"/*  # the raw traces are large; the JSON keeps the numbers
}

host_profile() {  # host_profile ours|upstream C: where the server's CPU goes at decode batch C
    local n=$1 c=$2 label port pid t
    label=$(label_of "$n") port=$(flash_port "$n")
    [ -f "$STATE/host_${n}_c$c.json" ] && return 0
    pid=$(cat "$RUN_DIR/serve_flash_$n.pid" 2>/dev/null) || return 1
    t=$(( $(left) - 20 ))
    [ $t -gt 90 ] && t=90
    [ $t -ge 45 ] || { note "host profile $label c$c: not run ($t s left)"; return 1; }
    step "host_${label}_c$c" "$t" "$PYTHON" "$REPO/bench/host_profile.py" \
        --base-url "http://127.0.0.1:$port" --model flash --pid "$pid" --label "$label" \
        --concurrency "$c" ${PYSPY:+--py-spy "$PYSPY"} --warm-timeout 40 \
        --out "$STATE/host_${n}_c$c.json" --md "$STATE/host_${n}_c$c.md"
    touch "$STATE/host_${n}_c$c.tried"
    grep -m1 "decode step" "$STATE/host_${n}_c$c.md" 2>/dev/null | tee -a "$OUT/summary.txt"
}

greedy_on() { [[ " $GREEDY " == *" $1 "* ]]; }  # greedy_on ours|upstream
greedy_server() {  # greedy_server ours|upstream [TAG], while it serves: its greedy outputs on the parity prompts
    local f=greedy_server_$1${2:+_$2}
    greedy_on "$1" && [ ! -f "$STATE/$f.json" ] || return 0
    step "$f" 120 "$PYTHON" "$REPO/bench/greedy_parity.py" server \
        --base-url "http://127.0.0.1:$(flash_port "$1")" --model flash --out "$STATE/$f.json"
    touch "$STATE/$f.tried"  # (impl_done: run, whatever came of it)
}
greedy_offline() {  # greedy_offline ours|upstream: the same prompts through LLM.generate (GPU to itself)
    local n=$1 t env k out cmp
    greedy_on "$n" || return 0
    if [ ! -f "$STATE/greedy_server_$n.json" ]; then
        note "greedy parity $n: not run (no server outputs: see greedy_server_$n.log)"
        return 0
    fi
    if [ "$n" = ours ]; then env=("${OURS[@]}"); else env=("${UPSTREAM[@]}"); fi
    # the servers' environment (env.sh FLASH_ENV): with it LLM.generate loads the graph the
    # server compiled instead of compiling (and autotuning) its own
    local -x "${FLASH_ENV[@]}"
    # GREEDY_PROCS (default 1) fresh processes, each after the last: from the second on, each also
    # compared with the first (two processes that differ point at the process, not the server)
    for k in $(seq 1 "${GREEDY_PROCS:-1}"); do
        out=$STATE/greedy_parity_$n.json cmp=()
        # the same prompts through the same server before it had served anything
        [ -f "$STATE/greedy_server_${n}_fresh.json" ] && cmp+=(--compare "server_fresh=$STATE/greedy_server_${n}_fresh.json")
        [ "$k" -gt 1 ] && out=$STATE/greedy_parity_${n}_$k.json cmp+=(--compare "offline_1=$STATE/greedy_parity_$n.json")
        [ -f "$out" ] && continue
        t=$(( $(left) - 20 ))
        [ "$t" -ge "${GREEDY_MIN_S:-240}" ] || { note "greedy parity $n ($k): not started ($t s left)"; return 1; }
        stop_flash ours upstream
        step "$(basename "$out" .json)" "$t" "${env[@]}" "$PYTHON" "$REPO/bench/greedy_parity.py" offline \
            --server "$STATE/greedy_server_$n.json" --out "$out" "${cmp[@]}" -- \
            "$(flash_ckpt "$n")" "${DSV4_ENGINE_FLAGS[@]}" "${DSV4_CKPT_FLAGS[@]}" "${FLASH_ARGS[@]}"
        tail -n 1 "$R/$(basename "$out" .json).log" | tee -a "$OUT/summary.txt"
        [ -f "$out" ] || return 1
    done
}

device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; finish; exit 1; }

if ! gen_done; then
    start_gen || { finish; exit 1; }
    while ! gen_done && [ "$(left)" -gt 20 ]; do
        for f in nvfp4 native; do
            if ! running "$STATE/gen_$f.pid" && [ ! -f "$(flash_ckpt "$f")/config.json" ]; then
                note "generating $FLASH_TAG-$f failed:"; tail -n 5 "$STATE/gen_$f.log"; finish; exit 1
            fi
        done
        sleep 5
    done
    gen_done || { note "checkpoints still generating: call again"; finish; exit 1; }
    note "checkpoints ready: $(du -sh "$(flash_ckpt ours)" "$(flash_ckpt upstream)" | tr '\n' ' ')"
fi
for n in ours upstream; do
    [ -f "$STATE/ckpt_bytes_$n.txt" ] || "$PYTHON" "$REPO/bench/serving.py" bytes "$(flash_ckpt "$n")" \
        >"$STATE/ckpt_bytes_$n.txt" 2>&1
done
while running "$STATE/prewarm.pid" && [ "$(left)" -gt 60 ]; do sleep 3; done
[ -f "$STATE/prewarm.ok" ] || note "mHC prewarm did not finish (see prewarm.log); servers compile them"
cp "$STATE/prewarm.log" "$R/" 2>/dev/null

impl_done() {  # impl_done ours|upstream: every bench point and profile of it done, the rest tried
    local c
    bench_done "$1" "$REPEATS" || return 1
    for c in $PROFILE_CONCS; do [ -f "$STATE/profile_${1}_c$c.json" ] || return 1; done
    for c in $HOST_CONCS; do
        [ -f "$STATE/host_${1}_c$c.json" ] || [ -f "$STATE/host_${1}_c$c.tried" ] || return 1
    done
    ! greedy_on "$1" || [ -f "$STATE/greedy_server_$1.json" ] || [ -f "$STATE/greedy_server_$1.tried" ]
}
other() { case $1 in ours) echo upstream ;; upstream) echo ours ;; esac; }

wait_deepgemm() {  # before upstream starts: its serial warm-up then finds the kernels compiled
    running "$STATE/deepgemm.pid" && note "waiting for the DeepGEMM prewarm"
    while running "$STATE/deepgemm.pid" && [ "$(left)" -gt 90 ]; do sleep 3; done
    [ "$DEEPGEMM_PREWARM" = 1 ] && [ ! -f "$STATE/deepgemm.ok" ] \
        && note "DeepGEMM prewarm did not finish (see deepgemm.log): upstream compiles them itself"
    cp "$STATE/deepgemm.log" "$R/" 2>/dev/null
    return 0
}

[ "$ONE_AT_A_TIME" = 1 ] || for n in $ORDER; do
    impl_done "$n" && continue
    [ "$n" = upstream ] && wait_deepgemm
    start_flash "$n"
done
for n in $ORDER; do
    if impl_done "$n"; then
        [ "$ONE_AT_A_TIME" = 1 ] && stop_flash "$n"
        continue
    fi
    [ "$ONE_AT_A_TIME" = 1 ] && stop_flash "$(other "$n")"
    [ "$n" = upstream ] && wait_deepgemm
    start_flash "$n"
    wait_flash "$n" $(( $(left) - 40 )) || { note "$n not healthy yet: call again"; finish; exit 1; }
    note "$n healthy"
    # nothing of this script's own runs beside a measurement: the DeepGEMM prewarm's compile
    # processes take the CPU cores a server's host-bound decode steps need
    running "$STATE/deepgemm.pid" && wait_deepgemm  # (upstream waited for it before it started)
    if running "$STATE/deepgemm.pid"; then note "DeepGEMM prewarm still running: call again"; finish; exit 1; fi
    greedy_server "$n" fresh  # before the server has served anything
    # every measured run before a profiler (torch's, py-spy) has attached to this server
    bench_done "$n" "$REPEATS" || bench_pass "$n" "$REPEATS"
    bench_done "$n" "$REPEATS" || { note "$n: not done yet: call again"; finish; exit 1; }
    for c in $PROFILE_CONCS; do profile "$n" "$c"; done
    for c in $HOST_CONCS; do host_profile "$n" "$c"; done
    greedy_server "$n"
    impl_done "$n" || { note "$n: not done yet: call again"; finish; exit 1; }
    if [ "$ONE_AT_A_TIME" = 1 ]; then stop_flash "$n"; note "$n: done, server stopped"; fi
done

if bench_done ours "$REPEATS" && bench_done upstream "$REPEATS"; then
    [ -f "$STATE/copy.json" ] || step copy_bw 60 "$PYTHON" "$REPO/bench/serving.py" copy-bw --out "$STATE/copy.json"
    profs=()
    for f in "$STATE"/profile_*_c*.json; do
        [ -f "$f" ] || continue
        b=$(basename "$f" .json); b=${b#profile_}
        profs+=(--profile "${b%_c*}:${b##*_c}=$f")
    done
    step report 120 "$PYTHON" "$REPO/bench/serving.py" report \
        --ckpt "ours=$(flash_ckpt ours)" --ckpt "upstream=$(flash_ckpt upstream)" \
        --serve "ours=$STATE/serve_ours.json" --serve "upstream=$STATE/serve_upstream.json" \
        "${profs[@]}" --copy "$STATE/copy.json" --command "$SETTINGS bash scripts/gpu/serving.sh" \
        --commit "${COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not recorded')}" \
        --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
        --versions "$(tail -n 4 "$R/device.txt" | tr '\n' ' ')" \
        --json "$STATE/serving.json" --md "$STATE/serving.md" --png "$STATE/serving.png"
    if [ "${STOP_SERVERS:-1}" = 1 ]; then stop_flash ours upstream; note "servers stopped"; fi
    if greedy_offline ours && greedy_offline upstream; then note "serving: done"; else note "serving: not done yet: call again"; fi
else
    note "serving: not done yet: call again"
fi
finish
