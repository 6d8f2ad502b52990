"""The run's tokenizer from its config alone, for parts that need token ids before (or apart from) the model.

The data loader measures prompt lengths with it and the rollout workers apply its chat template, so
both see exactly the ids the policy is trained on: ``model.path``'s own tokenizer (``AutoTokenizer``,
with its chat template), or with ``model.path`` null the tiny model's tokenizer built from
``model.tiny.tokenizer`` (the same one ``materialize_base_model`` saves): char-level, or a byte-level
BPE trained on the configured corpus (training is deterministic, so each process trains the same one).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nexrl_hpc.config.schema import ModelConfig, TokenizerConfig


def load_run_tokenizer(model_cfg: ModelConfig) -> Any:
    """A fast HF tokenizer with a pad token (its EOS when the model defines none)."""
    if model_cfg["path"] is None:
        return build_tiny_tokenizer(model_cfg["tiny"]["tokenizer"])
    return load_tokenizer(model_cfg["path"])


def load_tokenizer(model_dir: str) -> Any:
    """The model's own tokenizer (``AutoTokenizer``: its class, chat template and special tokens),
    with its EOS as the pad token when it defines none. Every part of a run that turns text into
    ids (inference server, data loader, rollout workers) loads it this way, so they agree."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """``model.tiny.tokenizer``: ``kind=char`` or ``kind=chatml_bpe`` (a fresh object on each call)."""
    if cfg["kind"] == "char":
        from nexrl_hpc.models.tokenizer import build_char_tokenizer

        return build_char_tokenizer(cfg["alphabet"], cfg.get("chat_template"))
    from tokenizers import Tokenizer

    from nexrl_hpc.models.chatml import CHATML_TEMPLATE, chatml_tokenizer

    if not cfg["corpus"]:
        raise ValueError("model.tiny.tokenizer.kind=chatml_bpe needs model.tiny.tokenizer.corpus")
    trained = _trained_bpe_json(
        cfg["corpus"], json.dumps(cfg["corpus_args"] or {}, sort_keys=True), cfg["vocab_size"]
    )
    return chatml_tokenizer(Tokenizer.from_str(trained), cfg.get("chat_template") or CHATML_TEMPLATE)


@functools.lru_cache(maxsize=4)
def _trained_bpe_json(corpus: str, corpus_args_json: str, vocab_size: int) -> str:
    """The BPE trained on the corpus, serialised (trained once per process and configuration)."""
    from nexrl_hpc.config.imports import load_object
    from nexrl_hpc.models.chatml import train_bpe

    texts = load_object(corpus)(**json.loads(corpus_args_json))
    return train_bpe(texts, vocab_size).to_str()
