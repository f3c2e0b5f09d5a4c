#!/usr/bin/env bash
# On the H200 (after shared/device staging): the SM90 kernel and runner GPU tests, then the kernel
# bench against cuBLAS BF16 and vLLM's Marlin NVFP4. Writes logs, JUnit XML and bench JSON/MD to $OUT.
set -u
. /opt/stage/env.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ date -u +%FT%TZ; nvidia-smi -L; python3 -c 'import torch, cutlass; print(torch.__version__, cutlass.__version__)'; } >"$OUT/device.txt" 2>&1
run() {  # name timeout cmd...
    local name=$1 t=$2; shift 2
    local s=$SECONDS
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? ${t}s-limit took=$((SECONDS - s))s" | tee -a "$OUT/summary.txt"
}
run test_gemm_sm90 200 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/test_gemm_sm90.xml" tests/test_gemm_sm90.py
run test_runners_gpu 120 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/test_runners_gpu.xml" tests/test_runners_gpu.py
run bench_flash 180 python3 -m cutedsl.bench.gemm_sm90 --model flash --json "$OUT/sm90_gemm_flash.json" --md "$OUT/sm90_gemm_flash.md"
tail -n 3 "$OUT"/test_*.log
