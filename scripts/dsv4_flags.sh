# shellcheck shell=bash
# The DeepSeek V4 flags of the vLLM recipes, for `vllm serve` (scripts/serve.sh) and for an engine
# built from the same flags (bench/greedy_parity.py offline, scripts/gpu/serving.sh). Sourced.
# Engine: FP8 KV cache (required by the DSv4 attention), the 256-token KV block of its sparse SWA
# backend, full + piecewise CUDA graphs, and one Triton config per Inductor reduction kernel.
# Without the last, a reduction compiled with several candidate configs (RBLOCK, warps: each its
# own summation order) is timed at its first run in every process, so the process that compiled
# the graph and one that loads it from vLLM's compile cache can pick different winners and differ
# in the last bit, enough to flip near-tied greedy tokens between a server and a restart of it
# (pytorch/pytorch#189121: the halved-RBLOCK candidates of dynamic_scale_rblock, re-timed per
# process). Both settings are part of vLLM's compile-cache key. DSV4_FIXED_REDUCTIONS=0 leaves
# Inductor's defaults (each process times its candidates: possibly faster kernels, and greedy
# outputs that may differ between processes in near ties).
DSV4_FIXED_REDUCTIONS=${DSV4_FIXED_REDUCTIONS:-1}
case $DSV4_FIXED_REDUCTIONS in
    1) _dsv4_inductor=',"inductor_compile_config":{"test_configs.force_filter_reduction_configs":true,"dynamic_scale_rblock":false}' ;;
    0) _dsv4_inductor= ;;
    *) echo "dsv4_flags.sh: DSV4_FIXED_REDUCTIONS=$DSV4_FIXED_REDUCTIONS: 1 (the default) or 0" >&2; return 2 2>/dev/null || exit 2 ;;
esac
DSV4_ENGINE_FLAGS=(--kv-cache-dtype fp8 --block-size 256
    --compilation-config "{\"cudagraph_mode\":\"FULL_AND_PIECEWISE\",\"custom_ops\":[\"all\"]$_dsv4_inductor}")
unset _dsv4_inductor
# A real DSv4 checkpoint (its tokenizer, tool calls and reasoning parser); not the tiny one.
DSV4_CKPT_FLAGS=(--tokenizer-mode deepseek_v4 --tool-call-parser deepseek_v4 --enable-auto-tool-choice
    --reasoning-parser deepseek_v4)
