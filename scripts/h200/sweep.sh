#!/usr/bin/env bash
# On the H200 (a kernels-only staging is enough), one call: the SM90 GEMM / runner / routing GPU
# tests, then the dense tactic grid sweep of issue 5 (every tile_n x token tile x split-K the
# kernel takes, `--sweep grid`) on the Flash dense shapes. Results: $OUT/sweep.tgz + summary.
#   LIMIT=570 SHAPES=fused_wqa_wkv,wq_b MS=64,128 bash scripts/h200/sweep.sh
set -u
. "$(dirname "$0")/env.sh"
LIMIT=${LIMIT:-570}
device_info
cd "$REPO"
if [ "${TESTS:-1}" != 0 ]; then
    step gpu_tests 240 python3 -m pytest -q -m "gpu or sm90" -p no:cacheprovider \
        --junitxml="$R/gpu_tests.xml" tests/test_gemm_sm90.py tests/test_runners_gpu.py \
        tests/test_moe_routing.py
    tail -n 4 "$R/gpu_tests.log"
fi
left=$((LIMIT - SECONDS - 25))
step sweep $((left + 15)) python3 -m cutedsl.bench.gemm_sm90 --model flash --impls ours \
    --sweep grid --ms "${MS:-1,16,32,64,128,256,512,1024,4096}" \
    --shapes "${SHAPES:-fused_wqa_wkv,wq_b,wo_a(G=8),wo_b,shared_w13,shared_w2}" \
    --time-budget "$left" --json "$R/sweep.json" --md "$R/sweep.md"
tail -n 3 "$R/sweep.log"
bundle sweep
