#!/usr/bin/env bash
# Serve a DeepSeek V4 checkpoint with vLLM (the overlay applied) and the recommended DSv4 flags.
#
#   bash scripts/serve.sh [MODEL] [extra vllm serve args...]
#
# MODEL (argument or $MODEL): a checkpoint directory. Without one, the tiny full-NVFP4 checkpoint is
# generated once into $TINY_DIR (default checkpoints/tiny-nvfp4) and served.
# Environment: PYTHON (default python3), PORT (8000), VLLM_EXTRA_ARGS (more flags, word-split),
# TENSOR_PARALLEL_SIZE (1), PREWARM_MHC=0 (do not compile vLLM's mHC kernels first),
# PREWARM_KERNELS=0 (do not start compiling our kernels beside vLLM's start-up),
# SERVE_UPSTREAM=1 (serve pristine vLLM for comparisons: the overlay must not be applied; nothing
# is changed), CUTEDSL_CACHE_DIR (our compiled kernels, default ~/.cache/cutedsl: a restart loads
# them; they compile in background processes while the weights load, CUTEDSL_COMPILE_WORKERS of
# them), TILELANG_CACHE_DIR (vLLM's mHC kernels, default ~/.tilelang/cache), OMP_NUM_THREADS
# (the server's torch CPU threads, default 1), DSV4_FIXED_REDUCTIONS=0 (Inductor's own reduction
# configs, timed in each process: scripts/dsv4_flags.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$HERE/scripts/dsv4_flags.sh" || exit 2
PYTHON=${PYTHON:-python3}
MODEL=${1:-${MODEL:-}}
[ $# -eq 0 ] || shift

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "serve.sh: error: no CUDA GPU is visible to $PYTHON (torch.cuda.is_available() is False)." >&2
    echo "serve.sh: vLLM serves DeepSeek V4 on SM90 (H100/H200) or SM100 (B200) GPUs only." >&2
    exit 1
fi

EXTRA=()
if [ -z "$MODEL" ]; then
    MODEL=${TINY_DIR:-$HERE/checkpoints/tiny-nvfp4}
    if [ ! -f "$MODEL/config.json" ] || [ ! -f "$MODEL/tokenizer.json" ]; then
        echo "serve.sh: generating the tiny full-NVFP4 DeepSeek V4 checkpoint in $MODEL"
        "$PYTHON" -m cutedsl.tools.tiny_model "$MODEL" --format nvfp4 --force
    fi
    # Random weights with a byte-level tokenizer (cutedsl.tools.tiny_tokenizer): text, chat and
    # token-id prompts all work; the answers are noise.
    EXTRA+=(--max-model-len 4096)
else
    [ -f "$MODEL/config.json" ] || { echo "serve.sh: error: $MODEL/config.json not found" >&2; exit 1; }
    EXTRA+=("${DSV4_CKPT_FLAGS[@]}")
fi

if [ "${SERVE_UPSTREAM:-0}" = 1 ]; then
    rc=0; PYTHON="$PYTHON" bash "$HERE/apply_patches.sh" --check >/dev/null || rc=$?
    [ $rc = 1 ] || { echo "serve.sh: error: SERVE_UPSTREAM=1 but the overlay is applied (apply_patches.sh --check rc=$rc)" >&2; exit 1; }
else
    PYTHON="$PYTHON" bash "$HERE/apply_patches.sh"
fi

# vLLM's mHC TileLang kernels compile per split count on first use (~10 s each, stalling the
# engine mid-serving): compile them into TileLang's disk cache first (cutedsl/tools/prewarm_mhc.py;
# seconds once they are cached). PREWARM_MHC=0 skips it; a failure only warns. It runs for
# SERVE_UPSTREAM=1 too: upstream then serves without the same compile stalls (a fair comparison).
if [ "${PREWARM_MHC:-1}" != 0 ]; then
    "$PYTHON" -m cutedsl.tools.prewarm_mhc "$MODEL" \
        || echo "serve.sh: warning: prewarm_mhc failed; the server compiles those kernels on first use" >&2
fi

# Our CuTeDSL kernels: compiled into their disk cache in the background (cutedsl/tools/
# prewarm_kernels.py) while vLLM imports and spawns its engine, so that its weight loading finds
# them there (a restart with them cached starts no compile at all). One GPU (tensor parallel shards
# the shapes: the engine compiles those itself); the server's max_num_batched_tokens from the flags.
if [ "${PREWARM_KERNELS:-1}" != 0 ] && [ "${SERVE_UPSTREAM:-0}" != 1 ] && [ "${TENSOR_PARALLEL_SIZE:-1}" = 1 ]; then
    MNBT=8192  # vLLM 0.21.0's default for the DSv4 server
    # shellcheck disable=SC2206
    args=("${EXTRA[@]}" ${VLLM_EXTRA_ARGS:-} "$@")
    for i in "${!args[@]}"; do
        case ${args[$i]} in
            --max-num-batched-tokens=*) MNBT=${args[$i]#*=} ;;
            --max-num-batched-tokens) MNBT=${args[$((i + 1))]:-$MNBT} ;;
        esac
    done
    LOG=${CUTEDSL_CACHE_DIR:-$HOME/.cache/cutedsl}/prewarm-kernels.log  # this start's
    mkdir -p "$(dirname "$LOG")"
    echo "serve.sh: compiling our kernels for $MODEL in the background (log: $LOG)"
    "$PYTHON" -m cutedsl.tools.prewarm_kernels "$MODEL" --max-num-batched-tokens "$MNBT" >"$LOG" 2>&1 &
fi

# One torch CPU thread in the server unless OMP_NUM_THREADS says otherwise (both for ours and for
# SERVE_UPSTREAM=1). vLLM 0.21.0 sets this itself only for its multiprocess executor
# (vllm/v1/executor/multiproc_executor.py); on one GPU the engine's per-step metadata build runs
# small CPU ops (torch.repeat_interleave in CompressorMetadataBuilder.build) that fork and join
# torch's OpenMP pool, one thread per core, on the decode step's critical path.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "serve.sh: OMP_NUM_THREADS=$OMP_NUM_THREADS (torch CPU threads of the server)"

# The DeepSeek V4 flags of the vLLM recipes (scripts/dsv4_flags.sh).
# shellcheck disable=SC2086
exec "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL" \
    --port "${PORT:-8000}" \
    --tensor-parallel-size "${TENSOR_PARALLEL_SIZE:-1}" \
    "${DSV4_ENGINE_FLAGS[@]}" "${EXTRA[@]}" ${VLLM_EXTRA_ARGS:-} "$@"
