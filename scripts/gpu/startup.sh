#!/usr/bin/env bash
# Start-up benchmark, ours vs upstream vLLM 0.21.0, on the tiny and the flash-layers checkpoints:
# for each (checkpoint, impl) a cold start (every JIT cache emptied) then a warm start (the caches
# the cold start left), each to a healthy /health, then the first request at batch sizes BATCHES
# (bench/startup.py). Results: $OUT/startup.json (one record per impl, checkpoint, cold|warm; copy
# it to bench/results/h200/startup.json), server logs $OUT/server_*.log, one line per run in
# $OUT/summary.txt.
#   bash scripts/gpu/startup.sh                 every run not yet in $OUT/startup.json
#   CHECKPOINTS=tiny IMPLS=ours bash scripts/gpu/startup.sh
# Resumable: a run whose record is already in $OUT/startup.json is skipped (FORCE=1 redoes all);
# a warm run needs its cold run's caches ($RUN_DIR/startup_cache/IMPL-CKPT), so a cold run is
# redone whenever its warm run is. BUDGET (wall seconds, default 540) stops before a run that
# would not fit: call it again. Both servers use the same flags, ports 8001 / 8002, one at a time.
# Upstream needs the vLLM of $PYTHON pristine: see scripts/gpu/env.sh.
set -u
. "$(dirname "$0")/env.sh"
BUDGET=${BUDGET:-540}
CHECKPOINTS=${CHECKPOINTS:-tiny flash}
IMPLS=${IMPLS:-ours upstream}
BATCHES=${BATCHES:-1 8 32 64}
RESULT=$OUT/startup.json
CACHE_ROOT=$RUN_DIR/startup_cache
note() { echo "$(date -u +%T) [${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
have() {  # have IMPL CKPT CACHE: 0 when the record is in $RESULT
    [ "${FORCE:-0}" = 1 ] && return 1
    "$PYTHON" -c '
import json, sys
try:
    recs = json.load(open(sys.argv[1]))["records"]
except FileNotFoundError:
    sys.exit(1)
sys.exit(0 if any((r["impl"], r["checkpoint"], r["cache"]) == tuple(sys.argv[2:]) for r in recs) else 1)
' "$RESULT" "$@"
}
estimate() {  # seconds a run may take (a gate only)
    case $1:$2 in
        *:cold) echo 420 ;;
        *) echo 240 ;;
    esac
}

make_ours || exit 1
device_info
for f in nvfp4 native; do  # the tiny checkpoints (ours: full NVFP4; upstream: native FP8/MXFP4)
    [ -f "$CKPT_DIR/tiny-$f/config.json" ] && continue
    step "gen_tiny_$f" 600 "$PYTHON" -m cutedsl.tools.tiny_model "$CKPT_DIR/tiny-$f" --format "$f" --force || exit 1
done
case " $CHECKPOINTS " in *" flash "*) gen_flash 600 || exit 1 ;; esac

server_cmd() {  # server_cmd IMPL CKPT: the command line bench/startup.py starts
    local ckpt_dir
    if [ "$2" = tiny ]; then  # as `make serve` runs it (serve.sh without MODEL)
        case $1 in
            ours) echo env "TINY_DIR=$CKPT_DIR/tiny-nvfp4" "${OURS[@]}" bash "$REPO/scripts/serve.sh" ;;
            upstream) echo env "TINY_DIR=$CKPT_DIR/tiny-native" SERVE_UPSTREAM=1 "${UPSTREAM[@]}" bash "$REPO/scripts/serve.sh" ;;
        esac
    else
        ckpt_dir=$(flash_ckpt "$1")
        case $1 in
            ours) echo "${OURS[@]}" bash "$REPO/scripts/serve.sh" "$ckpt_dir" "${FLASH_ARGS[@]}" ;;
            upstream) echo env SERVE_UPSTREAM=1 "${UPSTREAM[@]}" bash "$REPO/scripts/serve.sh" "$ckpt_dir" "${FLASH_ARGS[@]}" ;;
        esac
    fi
}

rc=0
for ckpt in $CHECKPOINTS; do
    label=$([ "$ckpt" = flash ] && echo flash-layers || echo tiny)
    for impl in $IMPLS; do
        if have "$impl" "$label" warm && have "$impl" "$label" cold; then continue; fi
        for cache in cold warm; do
            [ "$cache" = cold ] && have "$impl" "$label" warm && continue
            if [ $((BUDGET - SECONDS)) -lt "$(estimate "$label" "$cache")" ]; then
                note "startup: budget left $((BUDGET - SECONDS)) s, stopping before $impl $label $cache; run again"
                exit 1
            fi
            # shellcheck disable=SC2046
            step "startup_${impl}_${label}_${cache}" $((BUDGET - SECONDS)) "$PYTHON" "$REPO/bench/startup.py" \
                --impl "$impl" --checkpoint "$label" --cache "$cache" \
                --root "$CACHE_ROOT/$impl-$label" --port "$(flash_port "$impl")" --out "$RESULT" \
                --log "$OUT/server_${impl}_${label}_${cache}.log" --batch $BATCHES \
                -- $(server_cmd "$impl" "$ckpt") || { rc=1; break; }
            tail -1 "$R/startup_${impl}_${label}_${cache}.log" | tee -a "$OUT/summary.txt"
        done
    done
done
exit $rc
