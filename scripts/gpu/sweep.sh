#!/usr/bin/env bash
# The SM90 GEMM / runner / routing GPU tests, then the dense tactic grid sweep (every tile_n x token
# tile x split-K the kernel takes, `--sweep grid`) on the Flash dense shapes. Needs no vLLM.
# `python -m cutedsl.bench.tune_sm90 $OUT/sweep.json ... (writes cutedsl/tuned/sm90/<device name>.json)`
# turns sweep JSONs into the measured tactic table. Results in $OUT: sweep.json/.md, gpu_tests.xml,
# logs, device.txt, summary.txt.
#   LIMIT=570 SHAPES=fused_wqa_wkv,wq_b MS=64,128 bash scripts/gpu/sweep.sh     (TESTS=0: no tests)
set -u
. "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-570}
device_info
cd "$REPO"
if [ "${TESTS:-1}" != 0 ]; then
    step gpu_tests 240 "$PYTHON" -m pytest -q -m "gpu or sm90" -p no:cacheprovider \
        --junitxml="$R/gpu_tests.xml" tests/test_gemm_sm90.py tests/test_runners_gpu.py \
        tests/test_moe_routing.py
    tail -n 4 "$R/gpu_tests.log"
fi
left=$((LIMIT - SECONDS - 25))
step sweep $((left + 15)) "$PYTHON" -m cutedsl.bench.gemm_sm90 --model flash --impls ours \
    --sweep grid --ms "${MS:-1,16,32,64,128,256,512,1024,4096}" \
    --shapes "${SHAPES:-fused_wqa_wkv,wq_b,wo_a(G=8),wo_b,shared_w13,shared_w2}" \
    --time-budget "$left" --json "$R/sweep.json" --md "$R/sweep.md"
tail -n 3 "$R/sweep.log"
