"""A byte-level tokenizer for the tiny generated checkpoints, so the OpenAI server can take text
and chat requests (vLLM 0.21.0 serves DeepseekV4ForCausalLM with `tokenizer_mode=deepseek_v4`:
a PreTrainedTokenizerFast plus DeepSeek V4's own chat encoding).

Vocabulary of `vocab_size` ids: 0 = BOS, 1 = EOS (as the tiny config.json says), then DeepSeek V4's
chat special tokens (User, Assistant, think, ...), then the 256 byte symbols of the GPT-2
byte-level alphabet (any UTF-8 text encodes, one token per byte, and decodes back), then filler
tokens up to `vocab_size`. No merges: the point is a valid, lossless tokenizer, not compression.
"""

from __future__ import annotations

import json

# DeepSeek V4's chat special tokens (vllm/tokenizers/deepseek_v4_encoding.py, 0.21.0).
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL = (
    BOS,
    EOS,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
    "<｜▁pad▁｜>",
)


MIN_VOCAB = len(SPECIAL) + 256


def _byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-unicode table: 256 printable symbols, one per byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tokenizer_files(vocab_size: int) -> dict[str, dict]:
    """{file name: JSON object} for tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    n_fixed = len(SPECIAL) + 256
    if vocab_size < n_fixed:
        raise ValueError(
            f"vocab_size {vocab_size}: the byte-level tiny tokenizer needs >= {n_fixed}"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for sym in _byte_alphabet():
        vocab[sym] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<｜tiny_{i}｜>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<｜▁pad▁｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 65536,
        "clean_up_tokenization_spaces": False,
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": "<｜▁pad▁｜>"}
    return {
        "tokenizer.json": json.loads(tok.to_str()),
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
    }
