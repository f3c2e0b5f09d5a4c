# shellcheck shell=bash
# The DeepSeek V4 flags of the vLLM recipes, for `vllm serve` (scripts/serve.sh) and for an engine
# built from the same flags (bench/greedy_parity.py offline, scripts/gpu/serving.sh). Sourced.
# Engine: FP8 KV cache (required by the DSv4 attention), the 256-token KV block of its sparse SWA
# backend, full + piecewise CUDA graphs.
DSV4_ENGINE_FLAGS=(--kv-cache-dtype fp8 --block-size 256
    --compilation-config '{"cudagraph_mode":"FULL_AND_PIECEWISE","custom_ops":["all"]}')
# A real DSv4 checkpoint (its tokenizer, tool calls and reasoning parser); not the tiny one.
DSV4_CKPT_FLAGS=(--tokenizer-mode deepseek_v4 --tool-call-parser deepseek_v4 --enable-auto-tool-choice
    --reasoning-parser deepseek_v4)
