#!/bin/bash
# CPU precision floor before (unconditioned: --router-gain 1 --expert-shared 0) and after (defaults),
# 2 model seeds x 2 prompt seeds, 300 tokens, tiny preset nvfp4.
set -e
cd "$(dirname "$0")/../../.."
D=bench/results/cpu_2026-12-02_conditioning
for ms in 0 1; do for ps in 1 2; do
  if [ "$1" != "after" ]; then
    .venv/bin/python bench/golden_precision_floor.py --model-seed $ms --seed $ps --router-gain 1 \
      --expert-shared 0 --out $D/floor_before_model${ms}_prompt${ps}.json
  fi
  .venv/bin/python bench/golden_precision_floor.py --model-seed $ms --seed $ps \
    --out $D/floor_after_model${ms}_prompt${ps}.json
done; done
