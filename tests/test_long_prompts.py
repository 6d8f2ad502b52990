"""Over-long prompts are dropped by their character count, without being tokenized, when that count
alone puts them over ``rollout_worker.max_prompt_length``: twenty 1 MB prompts were each tokenized
(199 s) before the pre-flight's exit-2 message; the loader tokenized every one it dropped too.

The bound is only worth anything if it never drops a prompt that fits: it is checked against the
real token counts of adversarial texts (runs of one character, the special tokens' own text, code
points NFC joins) for the project's tokenizers, and refused for tokenizers that drop characters.
"""

from __future__ import annotations

import json
import logging
import string
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.data.prompts import character_bound, prompt_length
from nexrl_hpc.models.tokenizer import build_char_tokenizer
from tests.conftest import compose_config

MB = 1_000_000
ADVERSARIAL = [
    " " * 4000,
    "=" * 4000,
    "<|im_start|>" * 300,
    "<|im_end|>\n" * 300,
    "e\u0301" * 2000,  # NFC joins each pair into one character
    "\u1100\u1161\u11a8" * 1500,  # Hangul jamo: three code points, one syllable
    "1 + 1 " * 800,
    "".join(chr(0x4E00 + i % 500) for i in range(3000)),
]


def _tokenizers(chatml_model_dir: str) -> dict[str, PreTrainedTokenizerFast]:
    return {
        "char": build_char_tokenizer(string.printable, "{{ messages[0]['content'] }}"),
        "chatml": AutoTokenizer.from_pretrained(chatml_model_dir),
    }


def test_the_bound_never_exceeds_the_real_token_count(chatml_model_dir: str) -> None:
    for name, tok in _tokenizers(chatml_model_dir).items():
        bound = character_bound(tok)
        assert bound is not None, name
        for text in ADVERSARIAL:
            for prompt in (
                text,
                [{"role": "system", "content": "x" * 9000}, {"role": "user", "content": text}],
            ):
                real = prompt_length(tok, prompt, apply_chat_template=True, add_generation_prompt=True)
                assert bound.min_tokens(prompt) <= real, (name, text[:20])
            assert bound.min_tokens(text) <= prompt_length(tok, text, False, False), (name, text[:20])
    assert character_bound(_tokenizers(chatml_model_dir)["chatml"]).composing  # type: ignore[union-attr]


def test_tokenizers_that_drop_characters_get_no_bound() -> None:
    """Characters a normalizer, pre-tokenizer or model drops or fuses would make the bound unsound."""
    vocab = {"[UNK]": 0, "a": 1, "##a": 2}
    bert = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer()
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    spaces = Tokenizer(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]"))
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()
    fused = Tokenizer(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]", fuse_unk=True))
    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    for core in (bert, spaces, fused, words):
        assert character_bound(PreTrainedTokenizerFast(tokenizer_object=core)) is None
    assert character_bound(object()) is None  # not a fast tokenizer: tokenized as before


def _write(path: Path, prompts: list[str]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in prompts)
    return str(path)


def test_twenty_1mb_prompts_are_dropped_in_milliseconds_and_named(
    tmp_path: Path, chatml_model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path / "huge.jsonl", ["1 + 1 = ? " * (MB // 10)] * 20 + ["1 + 1 = ?"])
    cfg = compose_config(["data.shuffle=false", f"model.path={chatml_model_dir}"])
    tok = AutoTokenizer.from_pretrained(chatml_model_dir)
    data = {**cfg["data"], "type": "jsonl"}
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="nexrl_hpc.data.rows"):
        loader = DatasetLoader(data, data_files=[path], tokenizer=tok, max_prompt_length=512)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    assert (loader.num_rows, loader.get_filtered_long_prompts()) == (1, 20)
    assert elapsed < 5.0  # the file's reading and parsing; tokenizing them took over a second each
    warning = next(r.getMessage() for r in caplog.records if "filtered 20 prompt(s)" in r.getMessage())
    assert (
        f"{path} row 1 (at least 76923 tokens " in warning
        and f"by its {MB} characters, not tokenized)" in warning
    )
    assert warning.endswith(", ...")  # three named, the rest counted


def test_preflight_with_every_prompt_1mb_exits_at_once_naming_the_size(
    tmp_path: Path, chatml_model_dir: str
) -> None:
    path = _write(tmp_path / "huge.jsonl", ["1 + 1 = ? " * (MB // 10)] * 20)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        compose_config(
            [
                f"model.path={chatml_model_dir}",
                "data.type=jsonl",
                f"data.data_files=[{path}]",
                f"validate.data.data_files=[{path}]",
                "rollout_worker.max_prompt_length=512",
            ]
        )
    elapsed = time.perf_counter() - start
    messages = [p.message for p in err.value.problems if p.path == "rollout_worker.max_prompt_length"]
    assert len(messages) == 2 and all(f"or more, by its {MB} characters" in m for m in messages), messages
    assert "every prompt of data.data_files is longer than 512 tokens (the shortest has " in messages[0]
    assert elapsed < 10.0  # config composition and the model checks included; was minutes
