#!/usr/bin/env bash
# On the H200 (after shared/device staging): vLLM on a tiny checkpoint vs the golden reference.
#   bash scripts/h200_e2e.sh native [eager|graph|eager,graph]   # pristine vLLM (overlay reverted)
#   bash scripts/h200_e2e.sh nvfp4  [modes]                       # our overlay, sm90 backend
#   bash scripts/h200_e2e.sh nvidia-mixed [modes]
# Writes $OUT/e2e_<format>.json (+ .pt, log). A cold machine spends ~2 min in TileLang/DeepGEMM JIT
# per mode, so run one mode per call (each call is limited to 10 min).
set -euo pipefail
fmt=${1:?format}
modes=${2:-eager}
. /opt/stage/env.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 CUDA_HOME=/usr/local/cuda
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHON=python3
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "$fmt" = native ]; then bash apply_patches.sh --revert; else bash apply_patches.sh --no-install; fi
bash apply_patches.sh --check || true
python3 bench/upstream_baseline.py --format "$fmt" --modes "$modes" --timeout 540 --no-mhc-check \
    --out "$OUT/e2e_${fmt}.json" 2>&1 | tee "$OUT/e2e_${fmt}.log" | tail -n 40
