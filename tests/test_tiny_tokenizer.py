"""The tiny checkpoints' byte-level tokenizer: lossless on any text, DSv4 special tokens as single
ids below vocab_size, and loadable by vLLM 0.21.0's DeepseekV4Tokenizer with its chat encoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cutedsl.tools.tiny_tokenizer import BOS, EOS, SPECIAL, tokenizer_files

V = 1024


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    for fn, obj in tokenizer_files(V).items():
        (d / fn).write_text(json.dumps(obj))
    return d


def test_roundtrip_and_ids(tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok_dir)
    assert len(t) == V and t.bos_token_id == 0 and t.eos_token_id == 1
    rng = random.Random()
    alphabet = "abc XYZ,.!?\n\t0123 üñï日本語 emoji 🙂 <>|"
    for _ in range(20):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
        ids = t.encode(s, add_special_tokens=False)
        assert t.decode(ids) == s and max(ids) < V
        assert len(ids) == len(s.encode())  # one token per byte: no merges
    for i, sp in enumerate(SPECIAL):
        assert t.encode(sp, add_special_tokens=False) == [i]


def test_vllm_deepseek_v4_tokenizer_chat(tok_dir: Path) -> None:
    from vllm.tokenizers.deepseek_v4 import DeepseekV4Tokenizer

    t = DeepseekV4Tokenizer.from_pretrained(str(tok_dir))
    ids = t.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True
    )
    assert ids[0] == 0 and max(ids) < V
    text = t.decode(ids)
    assert text.startswith(BOS) and "<｜User｜>Hi there<｜Assistant｜>" in text and EOS not in text


def test_too_small_vocab_is_refused() -> None:
    with pytest.raises(ValueError, match="needs >= 265"):
        tokenizer_files(200)
