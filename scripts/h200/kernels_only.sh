#!/usr/bin/env bash
# On a GPU machine staged with the kernels only (shared/device/stage.sh nvidia-cutlass-dsl==4.4.2
# apache-tvm-ffi==0.1.9: no vLLM), one call: the GPU tests that need no vLLM (GEMMs, runners,
# routing, SwiGLU, sharding), the SwiGLU bench, the routed-expert GEMM bench and the
# scheduling-vs-mainloop experiment (bench/experiments/moe_vs_grouped.py).
# Results under $OUT/r and $OUT/summary.txt.
set -u
. "$(dirname "$0")/env.sh"
cd "$REPO"
device_info
rc=0
step gpu_tests "${TEST_LIMIT:-300}" python3 -m pytest -q -m "gpu or sm90" -p no:cacheprovider \
    --junitxml="$R/gpu_tests.xml" tests/test_swiglu_kernel.py tests/test_runners_gpu.py \
    tests/test_gemm_sm90.py tests/test_moe_routing.py tests/test_sharding.py || rc=1
tail -n 4 "$R/gpu_tests.log"
step bench_swiglu 120 python3 -m cutedsl.bench.swiglu --json "$R/swiglu.json" --md "$R/swiglu.md" || rc=1
tail -n 18 "$R/swiglu.md" 2>/dev/null
step bench_moe 150 python3 -m cutedsl.bench.gemm_sm90 --model flash --impls ours --ms 1,16,64,256 \
    --shapes "routed_w13(E=256),routed_w2(E=256)" --time-budget 120 \
    --json "$R/sm90_moe.json" --md "$R/sm90_moe.md" || rc=1
grep "routed" "$R/sm90_moe.md" | cut -d'|' -f2-12
# Issue 5: is the routed GEMM's decode gap its scheduling or its mainloop?
step moe_vs_grouped 120 python3 bench/experiments/moe_vs_grouped.py "$R/moe_vs_grouped.json" || rc=1
cat "$R/moe_vs_grouped.log"
exit $rc
