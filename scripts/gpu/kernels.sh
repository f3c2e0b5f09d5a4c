#!/usr/bin/env bash
# The SM90 kernel (tiled and streaming GEMMs) / runner / routing / SwiGLU GPU tests, then the SM90
# GEMM benchmark (every model, every M; ~9 min on an H200 with the default LIMIT) and, with the
# time left, the tactic sweep on the Flash shapes. Results in $OUT: gpu_tests.xml, logs,
# sm90_gemm.json/.md, sm90_gemm_sweep.*, device.txt, summary.txt.
#   LIMIT=560 bash scripts/gpu/kernels.sh          (MODEL=flash: only the Flash shapes)
# IMPLS / MS pick the bench's columns and Ms, e.g. the streaming decode kernel (its persistent grid
# too) at decode: IMPLS=ours,stream,copy MS=1,4,16,32 BENCH_SHARE=100 bash scripts/gpu/kernels.sh
# SWEEP_SHAPES / SWEEP_MS narrow the sweep, e.g. the routed experts at decode:
#   SWEEP_SHAPES="routed_w13(E=256),routed_w2(E=256)" SWEEP_MS=64,16,256 bash scripts/gpu/kernels.sh
# Needs no vLLM (the Marlin and DeepGEMM columns of the bench are then empty); PYTHON, OUT: env.sh.
set -u
. "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-560}
TESTS=${TESTS:-"tests/test_gemm_sm90.py tests/test_stream_sm90.py tests/test_runners_gpu.py tests/test_sharding.py tests/test_moe_routing.py tests/test_swiglu_kernel.py tests/test_rope_kernel_gpu.py"}
device_info
cd "$REPO"
# shellcheck disable=SC2086
step gpu_tests "${TEST_LIMIT:-260}" "$PYTHON" -m pytest -q -m "gpu or sm90" -p no:cacheprovider \
    --junitxml="$R/gpu_tests.xml" $TESTS
tail -n 15 "$R/gpu_tests.log"
left=$((LIMIT - SECONDS - 20))
if [ $left -gt 60 ]; then
    # shellcheck disable=SC2086
    step bench_gemm $((left + 10)) "$PYTHON" -m cutedsl.bench.gemm_sm90 --model "${MODEL:-all}" \
        ${IMPLS:+--impls "$IMPLS"} ${MS:+--ms "$MS"} \
        --time-budget $((left * ${BENCH_SHARE:-70} / 100)) --json "$R/sm90_gemm.json" --md "$R/sm90_gemm.md"
    tail -n 2 "$R/bench_gemm.log"
fi
left=$((LIMIT - SECONDS - 20))
if [ $left -gt 40 ]; then
    step bench_sweep $((left + 10)) "$PYTHON" -m cutedsl.bench.gemm_sm90 --model flash --sweep \
        --impls ours --ms "${SWEEP_MS:-1,16,64,256,1024,16384}" --shapes "${SWEEP_SHAPES:-}" \
        --time-budget $((left - 15)) \
        --json "$R/sm90_gemm_sweep.json" --md "$R/sm90_gemm_sweep.md"
fi
