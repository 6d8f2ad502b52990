"""Pre-flight of ``model.path``: the directory loads as an HF causal LM would, without its weights.

Why up front: a model directory without weights, with a broken tokenizer or an architecture
transformers does not know would otherwise fail after the run (or the Slurm job) has started.
"""

from __future__ import annotations

import os
from typing import Any

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def model_dir_problem(path: str) -> str:
    """Why ``path`` is not a usable model directory ("" when it is)."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "no config.json in it"
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoConfig.from_pretrained(path)
    except Exception as exc:  # ValueError (unknown model_type), OSError, JSON errors
        return f"its config.json does not load ({type(exc).__name__}: {str(exc)[:300]})"
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        return f"no weights in it (none of {', '.join(WEIGHT_FILES)})"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        return f"its tokenizer does not load ({type(exc).__name__}: {str(exc)[:300]})"
    if tokenizer.eos_token_id is None:
        return "its tokenizer has no EOS token (responses could not end)"
    return ""


def vocabulary_mismatch(student: Any, teacher: Any, teacher_vocab_size: int) -> str:
    """Why a teacher cannot score the student's token ids ("" when it can): both tokenizers must map
    the same strings to the same ids, and the teacher's output layer must cover every id (a bigger,
    padded embedding is fine: same-family models of different sizes often pad differently)."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        s_ids = {i: tok for tok, i in s_vocab.items()}
        t_ids = {i: tok for tok, i in t_vocab.items()}
        first = next((i for i in sorted(set(s_ids) | set(t_ids)) if s_ids.get(i) != t_ids.get(i)), None)
        return (
            f"its tokenizer differs from the student's: {len(t_vocab)} tokens vs {len(s_vocab)}; "
            f"id {first} is {t_ids.get(first)!r} for the teacher and {s_ids.get(first)!r} for the student"
        )
    if teacher_vocab_size < len(s_vocab):
        return (
            f"its output layer has {teacher_vocab_size} rows (config.json vocab_size) but the tokenizer "
            f"has {len(s_vocab)} ids"
        )
    return ""
