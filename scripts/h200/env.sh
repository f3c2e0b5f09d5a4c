# Sourced by the scripts/h200/*.sh drivers on the GPU machine (after shared/device staging).
# Sets the staged stack's environment, OUT, and two vLLM trees side by side:
#   the staged site's vllm stays pristine (upstream runs use it as is), and OURS is a symlink farm
#   of it in which only the two overlaid files are real copies with our overlay applied.
# "${OURS[@]}" CMD runs CMD with our tree first on PYTHONPATH; "${UPSTREAM[@]}" CMD with the pristine
# site (check_upstream refuses a site that has the overlay applied).
. ${STAGE_ENV:-/opt/stage/env.sh}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export VLLM_NO_USAGE_STATS=1 PYTHON=python3
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}
R=$OUT/r   # everything bundled into $OUT/<name>.tgz by `bundle` (8 files come back at most)
mkdir -p "$R"
# Empty on a kernels-only staging (no vLLM): make_ours then fails, step / device_info still work.
SITE_VLLM=${SITE_VLLM:-$(cd / && python3 -c 'import os, vllm; print(os.path.dirname(vllm.__file__))' 2>/dev/null)}
OURS_DIR=/tmp/vllm_ours
OURS=(env "PYTHONPATH=$OURS_DIR:$PYTHONPATH")
UPSTREAM=(env)

make_ours() {  # idempotent; then checks that the site is still pristine
    [ -n "$SITE_VLLM" ] || { echo "make_ours: vLLM is not installed (kernels-only staging?)" >&2; return 1; }
    if [ ! -f "$OURS_DIR/.ok" ]; then
        rm -rf "$OURS_DIR" && mkdir -p "$OURS_DIR" || return 1
        cp -as "$SITE_VLLM" "$OURS_DIR/vllm" || return 1
        local path
        for path in $(awk '!/^#/ && NF == 3 {print $2}' "$REPO/vllm_patches/UPSTREAM"); do
            rm "$OURS_DIR/vllm/$path" && cp "$SITE_VLLM/$path" "$OURS_DIR/vllm/$path" || return 1
        done
        bash "$REPO/apply_patches.sh" --vllm-root "$OURS_DIR/vllm" --no-install || return 1
        touch "$OURS_DIR/.ok"
    fi
    bash "$REPO/apply_patches.sh" --check --vllm-root "$OURS_DIR/vllm"
    bash "$REPO/apply_patches.sh" --check --vllm-root "$SITE_VLLM"
    [ $? = 1 ] || { echo "make_ours: $SITE_VLLM is not pristine" >&2; return 1; }
}
bundle() {  # bundle NAME: $R -> $OUT/NAME.tgz (keeps the file count under the limit)
    tar -C "$R" -czf "$OUT/$1.tgz" . && ls -la "$OUT"
}
step() {  # step NAME TIMEOUT CMD...: run, log to $R/NAME.log, one summary line
    local name=$1 t=$2 s=$SECONDS rc; shift 2
    timeout "$t" "$@" >"$R/$name.log" 2>&1; rc=$?
    echo "$(date -u +%T) $name rc=$rc took=$((SECONDS - s))s (limit ${t}s)" | tee -a "$OUT/summary.txt"
    return $rc
}
device_info() {
    { date -u +%FT%TZ; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv;
      python3 -c '
import importlib
for name in ("torch", "cutlass", "vllm", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")'
    } >"$R/device.txt" 2>&1
}

# --- The two flash-layers servers of issue 9 (scripts/h200/serve_bench.sh, serve_soak.sh) ---
# Ours: port 8001, full-NVFP4 checkpoint, our overlay; upstream: port 8002, the native FP8/MXFP4
# checkpoint of the same seed, pristine vLLM 0.21.0. Identical flags for both: CUDA graphs only
# for the decode batch sizes the benchmark uses (CAPTURE_SIZES; vLLM's default for
# max-num-seqs 64 is 19 sizes, each captured piecewise and full), prompt-token details (the
# soak's greedy check reads the cached-token counts), and the worker's torch profiler into a
# per-server directory (idle until POST /start_profile; bench/profile_server.py). Each server
# starts in its own session (setsid): it outlives the device call, its pid is kept in
# /tmp/serve_flash_NAME.pid and its log appended to /tmp/serve_flash_NAME.log.
CAPTURE_SIZES=${CAPTURE_SIZES:-1 2 4 8 16 32 64}
# shellcheck disable=SC2206
FLASH_ARGS=(--served-model-name flash --max-model-len 10240 --max-num-seqs 64
    --kv-cache-memory-bytes 16000000000 --gpu-memory-utilization 0.3
    --cudagraph-capture-sizes $CAPTURE_SIZES --enable-prompt-tokens-details)
flash_port() { case $1 in ours) echo 8001 ;; upstream) echo 8002 ;; esac; }
flash_prof_dir() { echo "/tmp/prof_flash_$1"; }
healthy() { curl -sf -m 5 "http://127.0.0.1:$1/health" >/dev/null; }
start_flash() {  # start_flash ours|upstream (no-op when it is healthy or still starting)
    local port prof
    port=$(flash_port "$1") prof=$(flash_prof_dir "$1")
    healthy "$port" && return 0
    local old
    old=$(cat "/tmp/serve_flash_$1.pid" 2>/dev/null)
    if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then  # still starting: one server per port
        return 0
    fi
    mkdir -p "$prof"
    local cfg
    cfg=$(python3 "$REPO/bench/profile_server.py" server-args "$prof") || return 1
    if [ "$1" = ours ]; then
        PORT=$port setsid "${OURS[@]}" bash "$REPO/scripts/serve.sh" /tmp/ckpt/flash-nvfp4 \
            "${FLASH_ARGS[@]}" --profiler-config "$cfg" >>/tmp/serve_flash_ours.log 2>&1 </dev/null &
    else
        PORT=$port SERVE_UPSTREAM=1 setsid "${UPSTREAM[@]}" bash "$REPO/scripts/serve.sh" \
            /tmp/ckpt/flash-native "${FLASH_ARGS[@]}" --profiler-config "$cfg" \
            >>/tmp/serve_flash_upstream.log 2>&1 </dev/null &
    fi
    echo $! >"/tmp/serve_flash_$1.pid"
    echo "$(date -u +%T) started flash server $1 (port $port, pid $!, capture sizes $CAPTURE_SIZES)" \
        | tee -a "$OUT/summary.txt"
}
wait_flash() {  # wait_flash ours|upstream SECONDS: 0 once healthy; 1 on timeout or if it died
    local port pid i
    port=$(flash_port "$1") pid=$(cat "/tmp/serve_flash_$1.pid" 2>/dev/null)
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
        pid=$(cat "/tmp/serve_flash_$n.pid" 2>/dev/null) || continue
        kill -TERM -- "-$pid" 2>/dev/null && pids+=("$pid")
    done
    for ((i = 0; i < 15; i++)); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 1
    done
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    for n in "$@"; do rm -f "/tmp/serve_flash_$n.pid"; done
}
