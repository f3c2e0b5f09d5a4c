# Sourced by the scripts/gpu/*.sh drivers. Any Linux machine with an NVIDIA GPU and the pinned stack
# (requirements.txt) will do; nothing else is assumed.
#
# Environment (all optional):
#   PYTHON     the interpreter with the pinned stack (default: .venv/bin/python of this checkout,
#              as `make setup` makes it). Its vLLM is the "pristine" one of the upstream runs.
#   OUT        where results go (default: ./out under the current directory); one summary line
#              per step is appended to $OUT/summary.txt.
#   RUN_DIR    working state shared by the drivers: our patched vLLM copy, the flash-layers
#              servers' pid files, logs and profiler traces, the serving benchmark's partial
#              results (default: ${TMPDIR:-/tmp}/cutedsl-gpu).
#   CKPT_DIR   generated checkpoints (default: checkpoints/ of this checkout).
#   CKPT_DIR_UPSTREAM  upstream's flash-layers checkpoint, where it must live apart from ours
#              (default: CKPT_DIR).
#   PACK_OUT=1 when the driver exits (also on SIGTERM), everything in $OUT but summary.txt is
#              packed into $OUT/results.tgz (the .pt tensors left out; 15 MiB parts
#              results.tgz.00, .01, ... when larger): for a transport that returns only a few
#              files of limited size (`pack_out`).
#
# Two vLLM trees side by side, so that upstream and ours can run at the same time on one GPU:
#   "${UPSTREAM[@]}" CMD  runs CMD on the vLLM that $PYTHON imports, which must be pristine
#                         (`make patch-revert` restores it if `make setup` overlaid it);
#   "${OURS[@]}" CMD      runs CMD with $RUN_DIR/vllm_ours first on PYTHONPATH: a symlink copy of
#                         that vLLM in which only the overlaid files are real files, patched by
#                         `apply_patches.sh --vllm-root DIR --no-install` (make_ours).
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$REPO/scripts/dsv4_flags.sh" || exit 2  # DSV4_ENGINE_FLAGS, DSV4_CKPT_FLAGS (as scripts/serve.sh)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
command -v "$PYTHON" >/dev/null 2>&1 || { echo "env.sh: PYTHON=$PYTHON is not an interpreter (run make setup, or set PYTHON)" >&2; exit 2; }
case "$PYTHON" in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac
export PYTHON
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R=$OUT   # every result file of a driver goes here

pack_out() {  # pack_out DIR: DIR's entries but summary.txt into DIR/results.tgz[.NN], then removed
    (
        cd "$1" 2>/dev/null || exit 0
        mapfile -t entries < <(find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name 'results.tgz*' -printf '%P\n')
        [ ${#entries[@]} -gt 0 ] || exit 0
        tar czf results.tgz --exclude='*.pt' -- "${entries[@]}" || exit 1
        rm -rf -- "${entries[@]}"
        if [ "$(stat -c %s results.tgz)" -gt $((15 << 20)) ]; then
            split -b 15M -d results.tgz results.tgz. && rm results.tgz
        fi
    )
}
if [ "${PACK_OUT:-0}" = 1 ]; then trap 'pack_out "$OUT"' EXIT; fi
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/cutedsl-gpu}
CKPT_DIR=${CKPT_DIR:-$REPO/checkpoints}
mkdir -p "$RUN_DIR" "$CKPT_DIR" ${CKPT_DIR_UPSTREAM:+"$CKPT_DIR_UPSTREAM"}
# Empty when $PYTHON has no vLLM: make_ours then fails; step and device_info still work.
SITE_VLLM=${SITE_VLLM:-$(cd / && "$PYTHON" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))' 2>/dev/null)}
OURS_DIR=$RUN_DIR/vllm_ours
OURS=(env "PYTHONPATH=$OURS_DIR:$PYTHONPATH")
UPSTREAM=(env)

make_ours() {  # idempotent: build the patched copy once; then check that $PYTHON's vLLM is pristine
    [ -n "$SITE_VLLM" ] || { echo "make_ours: $PYTHON has no vLLM" >&2; return 1; }
    local rc=0
    bash "$REPO/apply_patches.sh" --check --vllm-root "$SITE_VLLM" || rc=$?
    [ $rc = 1 ] || {
        echo "make_ours: $SITE_VLLM is not pristine (apply_patches.sh --check rc=$rc); restore it with" \
            "PYTHON=$PYTHON bash apply_patches.sh --revert (make patch-revert)" >&2
        return 1
    }
    if [ ! -f "$OURS_DIR/.ok" ] || [ "$(cat "$OURS_DIR/.ok")" != "$SITE_VLLM" ]; then
        rm -rf "$OURS_DIR" && mkdir -p "$OURS_DIR" || return 1
        cp -as "$SITE_VLLM" "$OURS_DIR/vllm" || return 1
        local path
        for path in $(awk '!/^#/ && NF == 3 {print $2}' "$REPO/vllm_patches/UPSTREAM"); do
            rm "$OURS_DIR/vllm/$path" && cp "$SITE_VLLM/$path" "$OURS_DIR/vllm/$path" || return 1
        done
        PYTHON=$PYTHON bash "$REPO/apply_patches.sh" --vllm-root "$OURS_DIR/vllm" --no-install || return 1
        echo "$SITE_VLLM" >"$OURS_DIR/.ok"
    fi
    bash "$REPO/apply_patches.sh" --check --vllm-root "$OURS_DIR/vllm"
}
step() {  # step NAME TIMEOUT CMD...: run, log to $R/NAME.log, one summary line
    local name=$1 t=$2 s=$SECONDS rc pidf="$RUN_DIR/step_$1.pid"; shift 2
    # timeout runs CMD in a process group of its own, which outlives a driver killed mid-step:
    # the same step of a killed earlier call is ended before this one starts
    [ -f "$pidf" ] && kill -KILL -- "-$(cat "$pidf")" 2>/dev/null
    timeout "$t" "$@" >"$R/$name.log" 2>&1 </dev/null &
    echo $! >"$pidf"
    wait $!; rc=$?
    rm -f "$pidf"
    echo "$(date -u +%T) $name rc=$rc took=$((SECONDS - s))s (limit ${t}s)" | tee -a "$OUT/summary.txt"
    return $rc
}
device_info() {  # $R/device.txt: date, GPU, driver, versions and the commit, for the result files
    { date -u +%FT%TZ; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv
      echo "commit $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)$(
          [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] && echo ' (with local changes)')"
      "$PYTHON" -c '
import importlib
for name in ("torch", "cutlass", "vllm", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")'
    } >"$R/device.txt" 2>&1
}

# --- The two flash-layers servers (serve_bench.sh, serve_soak.sh, e2e.sh START_FLASH=1) ---
# Ours: port 8001, full-NVFP4 checkpoint, our overlay; upstream: port 8002, the native FP8/MXFP4
# checkpoint of the same seed, pristine vLLM 0.21.0. Identical flags for both: CUDA graphs only
# for the decode batch sizes the benchmark uses (CAPTURE_SIZES; vLLM's default for
# max-num-seqs 64 is 19 sizes, each captured piecewise and full), prompt-token details (the
# soak's greedy check reads the cached-token counts), and the worker's torch profiler into a
# per-server directory (idle until POST /start_profile; bench/profile_server.py) with the worker's
# phase annotations (VLLM_CUSTOM_SCOPES_FOR_PROFILING: preprocess, forward, sample...). Each server
# runs in its own process group (setsid), so it outlives the driver that started it; its pid is
# kept in $RUN_DIR/serve_flash_NAME.pid and its log appended to $RUN_DIR/serve_flash_NAME.log.
# FLASH_LAYERS sets the checkpoints' depth (default: the preset's 2 layers, checkpoints flash-*;
# otherwise flashN-*); MAX_NUM_SEQS and GPU_MEM_UTIL the servers' batch and memory share;
# KV_CACHE_BYTES their KV cache (vLLM's --kv-cache-memory-bytes: a fixed size that replaces the
# share GPU_MEM_UTIL would leave for it, so each server holds weights + this + activations).
FLASH_LAYERS=${FLASH_LAYERS:-}
FLASH_TAG=flash$FLASH_LAYERS
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-8192}  # vLLM's default for these servers, explicit
GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.3}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-16000000000}
CAPTURE_SIZES=${CAPTURE_SIZES:-1 2 4 8 16 32 64}
# shellcheck disable=SC2206
FLASH_ARGS=(--served-model-name flash --max-model-len 10240 --max-num-seqs "$MAX_NUM_SEQS"
    --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS"
    --kv-cache-memory-bytes "$KV_CACHE_BYTES" --gpu-memory-utilization "$GPU_MEM_UTIL"
    --cudagraph-capture-sizes $CAPTURE_SIZES --enable-prompt-tokens-details)
# The servers' own environment: the worker's phase annotations for the profiler, and
# FLASH_EXTRA_ENV's K=V words (e.g. TORCHINDUCTOR_* settings for an experiment; the reduction-config
# setting both servers need is in DSV4_ENGINE_FLAGS). vLLM keys its torch.compile cache on its
# VLLM_* variables (vllm/envs.py compile_factors), so an engine built to match a server
# (bench/greedy_parity.py offline) takes these too.
# shellcheck disable=SC2206
FLASH_ENV=(VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 ${FLASH_EXTRA_ENV:-})
flash_port() { case $1 in ours) echo 8001 ;; upstream) echo 8002 ;; esac; }
flash_prof_dir() { echo "$RUN_DIR/prof_flash_$1"; }
flash_ckpt() {  # flash_ckpt ours|upstream|nvfp4|native
    case $1 in
        ours | nvfp4) echo "$CKPT_DIR/$FLASH_TAG-nvfp4" ;;
        upstream | native) echo "${CKPT_DIR_UPSTREAM:-$CKPT_DIR}/$FLASH_TAG-native" ;;
    esac
}
healthy() { curl -sf -m 5 "http://127.0.0.1:$1/health" >/dev/null; }
start_flash() {  # start_flash ours|upstream (no-op when it is healthy or still starting)
    local port prof
    port=$(flash_port "$1") prof=$(flash_prof_dir "$1")
    healthy "$port" && return 0
    local old
    old=$(cat "$RUN_DIR/serve_flash_$1.pid" 2>/dev/null)
    if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then  # still starting: one server per port
        return 0
    fi
    mkdir -p "$prof"
    local cfg
    local -x "${FLASH_ENV[@]}"
    cfg=$("$PYTHON" "$REPO/bench/profile_server.py" server-args "$prof") || return 1
    if [ "$1" = ours ]; then
        PORT=$port setsid "${OURS[@]}" bash "$REPO/scripts/serve.sh" "$(flash_ckpt ours)" \
            "${FLASH_ARGS[@]}" --profiler-config "$cfg" >>"$RUN_DIR/serve_flash_ours.log" 2>&1 </dev/null &
    else
        PORT=$port SERVE_UPSTREAM=1 setsid "${UPSTREAM[@]}" bash "$REPO/scripts/serve.sh" \
            "$(flash_ckpt upstream)" "${FLASH_ARGS[@]}" --profiler-config "$cfg" \
            >>"$RUN_DIR/serve_flash_upstream.log" 2>&1 </dev/null &
    fi
    echo $! >"$RUN_DIR/serve_flash_$1.pid"
    echo "$(date -u +%T) started flash server $1 (port $port, pid $!, capture sizes $CAPTURE_SIZES)" \
        | tee -a "$OUT/summary.txt"
}
wait_flash() {  # wait_flash ours|upstream SECONDS: 0 once healthy; 1 on timeout or if it died
    local port pid i
    port=$(flash_port "$1") pid=$(cat "$RUN_DIR/serve_flash_$1.pid" 2>/dev/null)
    for ((i = 0; i < $2; i += 2)); do
        healthy "$port" && return 0
        [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null && return 1
        sleep 2
    done
    healthy "$port"
}
stop_flash() {  # stop_flash NAME...: SIGTERM each server's process group, SIGKILL after 15 s
    local n pid pids=() i
    for n in "$@"; do
        pid=$(cat "$RUN_DIR/serve_flash_$n.pid" 2>/dev/null) || continue
        kill -TERM -- "-$pid" 2>/dev/null && pids+=("$pid")
    done
    for ((i = 0; i < 15; i++)); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 1
    done
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    for n in "$@"; do rm -f "$RUN_DIR/serve_flash_$n.pid"; done
}
gen_flash() {  # gen_flash TIMEOUT: the flash-layers checkpoints (nvfp4 for ours, native for upstream), once
    local f rc=0
    for f in nvfp4 native; do
        [ -f "$(flash_ckpt "$f")/config.json" ] && continue
        step "gen_flash_$f" "$1" "$PYTHON" -m cutedsl.tools.tiny_model "$(flash_ckpt "$f")" \
            --preset flash-layers ${FLASH_LAYERS:+--layers "$FLASH_LAYERS"} --format "$f" \
            --device cuda --force || rc=1
    done
    return $rc
}
