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
SITE_VLLM=${SITE_VLLM:-$(cd / && python3 -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')}
OURS_DIR=/tmp/vllm_ours
OURS=(env "PYTHONPATH=$OURS_DIR:$PYTHONPATH")
UPSTREAM=(env)

make_ours() {  # idempotent; then checks that the site is still pristine
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
      python3 -c 'import torch, cutlass, vllm, transformers; print("torch", torch.__version__, "cutlass-dsl", cutlass.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
    } >"$R/device.txt" 2>&1
}
