#!/usr/bin/env bash
# vLLM vs the golden reference on the tiny checkpoints (~8 min on an H200), every engine at once on
# the one GPU (fixed KV size, so they do not disturb each other's memory profiling):
#   native       pristine vLLM 0.21.0 (the upstream baseline)      eager + CUDA graphs
#   nvfp4        our overlay, sm90 backend                          eager + CUDA graphs
#   nvidia-mixed our overlay (NVFP4 experts, FP8 rest)              eager + CUDA graphs
# plus the SM90 runner/kernel GPU tests and the SM100 host-path GPU tests (sm100-emulated), and
# (for serve_bench.sh) the flash-layers checkpoints.
# Results in $OUT: e2e_<format>.json (+ .pt logprob tensors), worker logs, gpu_tests.xml,
# device.txt, summary.txt; `python bench/e2e_table.py $OUT/e2e_*.json` prints the table.
#   bash scripts/gpu/e2e.sh [formats (default native,nvfp4,nvidia-mixed)] [modes (eager,graph)]
# BACKEND=b1[,b2...]: our runs use these cutedsl backends ($CUTEDSL_BACKEND, e.g.
# BACKEND=sm90,sm100-emulated), one run per format and backend, all on one checkpoint per format
# generated first into $CKPT_DIR/tiny-<format>; results e2e_<format>_<backend>.json (one backend's
# runs at a time, beside the GPU tests). Formats
# default to nvfp4,nvidia-mixed then (native runs pristine vLLM, which has no cutedsl backend).
# Environment: see scripts/gpu/env.sh (PYTHON, OUT, ...); LIMIT (500 s per step), GPU_TESTS=0,
# FLASH_CKPTS=0 (skip those steps), START_FLASH=1 (leave our flash-layers server starting for
# serve_bench.sh 1).
set -u
. "$(dirname "$0")/env.sh"
BACKEND=${BACKEND:-}
if [ -n "$BACKEND" ]; then formats=${1:-nvfp4,nvidia-mixed}; else formats=${1:-native,nvfp4,nvidia-mixed}; fi
modes=${2:-eager,graph}
LIMIT=${LIMIT:-500}
device_info
make_ours >"$R/make_ours.log" 2>&1 || { cat "$R/make_ours.log"; exit 1; }
runs=()  # name|format|backend (backend empty: the device's default)
for fmt in ${formats//,/ }; do
    if [ -z "$BACKEND" ]; then runs+=("e2e_$fmt|$fmt|"); continue; fi
    [ "$fmt" = native ] && { echo "e2e.sh: BACKEND=$BACKEND: format native runs pristine vLLM (no cutedsl backend)" >&2; exit 2; }
    step "gen_tiny_$fmt" "$LIMIT" "$PYTHON" -m cutedsl.tools.tiny_model "$CKPT_DIR/tiny-$fmt" --format "$fmt" \
        --preset tiny --seed 0 --device cuda --force || exit 1
    for b in ${BACKEND//,/ }; do runs+=("e2e_${fmt}_$b|$fmt|$b"); done
done
pids=()
engines() {  # engines BACKEND: the runs of that backend ("" with no BACKEND), all at once
    local run name fmt b wrap ckpt epids=()
    for run in "${runs[@]}"; do
        IFS='|' read -r name fmt b <<<"$run"
        [ "$b" = "$1" ] || continue
        wrap=("${OURS[@]}"); [ "$fmt" = native ] && wrap=("${UPSTREAM[@]}")
        ckpt=(); [ -n "$b" ] && { wrap+=("CUTEDSL_BACKEND=$b"); ckpt=(--ckpt "$CKPT_DIR/tiny-$fmt"); }
        step "$name" "$LIMIT" "${wrap[@]}" "$PYTHON" "$REPO/bench/upstream_baseline.py" --format "$fmt" \
            "${ckpt[@]}" --modes "$modes" --parallel --no-mhc-check --gpu-mem 0.06 --kv-bytes 2000000000 \
            --timeout $((LIMIT - 60)) --out "$R/$name.json" &
        epids+=($!)
    done
    wait "${epids[@]}"
}
# one backend's engines at a time: on an 80 GB card, six engines (two backends x three formats,
# two modes each) beside the GPU tests ran out of memory in CUDA-graph capture
(for b in ${BACKEND//,/ }; do engines "$b"; done; [ -n "$BACKEND" ] || engines "") &
pids+=($!)
if [ "${GPU_TESTS:-1}" = 1 ]; then
    step gpu_tests "$LIMIT" "${OURS[@]}" "$PYTHON" -m pytest -q -m "gpu or sm90" -p no:cacheprovider \
        --junitxml="$R/gpu_tests.xml" "$REPO/tests/test_runners_gpu.py" "$REPO/tests/test_gemm_sm90.py" \
        "$REPO/tests/test_sharding.py" "$REPO/tests/test_moe_routing.py" "$REPO/tests/test_swiglu_kernel.py" \
        "$REPO/tests/test_sm100_emulated_gpu.py" "$REPO/tests/test_rope_kernel_gpu.py" &
    pids+=($!)
fi
if [ "${FLASH_CKPTS:-1}" = 1 ]; then
    gen_flash 400 &
    pids+=($!)
fi
wait "${pids[@]}"
# START_FLASH=1: start our flash-layers server of serve_bench.sh now (it outlives this script), so
# its compile and graph capture overlap whatever runs before serve_bench.sh 1. Not upstream's:
# serve_bench.sh starts it after the soak, which must have the GPU to itself.
if [ "${START_FLASH:-0}" = 1 ] && [ -f "$(flash_ckpt ours)/config.json" ]; then
    start_flash ours
fi
for run in "${runs[@]}"; do name=${run%%|*}; grep -h "^\[baseline\]" "$R/$name.log" | sed "s/^/${name#e2e_} /"; done
tail -n 3 "$R/gpu_tests.log" 2>/dev/null
rm -f "$R"/*.json.*.pt  # per-worker tensors; e2e_<fmt>.pt holds every mode
