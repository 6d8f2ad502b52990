"""The model's config checks. Pre-flight of ``model.path``: the directory loads as an HF causal LM
would, without its weights; with ``model.path`` null, the tiny model's shape and its callables.

Why up front: a model directory without weights, with a broken tokenizer or an architecture
transformers does not know would otherwise fail after the run (or the Slurm job) has started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.validate import ConfigProblem, callable_problems, config_value, g_safe, rule_problems

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


def vocabulary_mismatch(
    student: Any, teacher: Any, teacher_vocab_size: int, student_vocab_size: int | None = None
) -> str:
    """Why a teacher cannot score the student's token ids ("" when it can): both tokenizers must map
    the same strings to the same ids, and the teacher's output layer must cover every id the student
    can sample: its tokenizer's, and those of its embedding's padding (``student_vocab_size``, its
    config.json vocab_size; a padded student samples ids without a token). A bigger, padded
    teacher is fine: same-family models of different sizes often pad differently."""
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
    if student_vocab_size is not None and teacher_vocab_size < student_vocab_size:
        return (
            f"its output layer has {teacher_vocab_size} rows (config.json vocab_size) but the student's "
            f"has {student_vocab_size}: the student samples ids up to {student_vocab_size - 1}, past its "
            f"tokenizer's {len(s_vocab)}, and the teacher must score them"
        )
    return ""


def tiny_model_callable_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``model.path`` null: the tiny model's warm-up and its tokenizer's corpus are callables."""
    if g_safe(cfg, "model.path") is not None:
        return []
    warmup_args = g_safe(cfg, "model.tiny.warmup_args")
    problems = callable_problems(
        cfg, "model.tiny.warmup", 3, warmup_args if isinstance(warmup_args, Mapping) else None
    )
    if g_safe(cfg, "model.tiny.tokenizer.kind") == "chatml_bpe":
        if not g_safe(cfg, "model.tiny.tokenizer.corpus"):
            problems.append(
                ConfigProblem(
                    "model.tiny.tokenizer.corpus",
                    "kind=chatml_bpe trains its BPE on a corpus: set 'module:function' returning texts",
                )
            )
        corpus_args = g_safe(cfg, "model.tiny.tokenizer.corpus_args")
        kwargs = corpus_args if isinstance(corpus_args, Mapping) else None
        problems += callable_problems(cfg, "model.tiny.tokenizer.corpus", 0, kwargs)
    return problems


def model_path_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``model.path`` is an HF-layout directory whose config and tokenizer load and that holds weights."""
    model_path = g_safe(cfg, "model.path")
    if not isinstance(model_path, str):
        return []
    why = model_dir_problem(model_path)
    if not why:
        return []
    return [
        ConfigProblem(
            "model.path",
            f"{model_path!r}: {why} (expected an HF-layout model directory with config.json; "
            "null builds the tiny model of model.tiny)",
        )
    ]


def tiny_model_shape_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``model.path`` null: heads that divide, a context that fits the rollout's lengths, an alphabet."""
    if g_safe(cfg, "model.path") is not None:
        return []
    g = lambda p: config_value(cfg, p)  # noqa: E731
    rules: list[tuple[Any, str, str]] = [
        (
            lambda: g("model.tiny.hidden_size") % g("model.tiny.num_attention_heads") == 0,
            "model.tiny.num_attention_heads",
            "must divide model.tiny.hidden_size",
        ),
        (
            lambda: g("model.tiny.num_attention_heads") % g("model.tiny.num_key_value_heads") == 0,
            "model.tiny.num_key_value_heads",
            "must divide model.tiny.num_attention_heads",
        ),
        (
            lambda: (
                g("rollout_worker.max_prompt_length") + g("rollout_worker.max_response_length")
                <= g("model.tiny.max_position_embeddings")
            ),
            "rollout_worker.max_response_length",
            "max_prompt_length + max_response_length must fit model.tiny.max_position_embeddings",
        ),
        (
            lambda: g("model.tiny.tokenizer.kind") != "char" or len(g("model.tiny.tokenizer.alphabet")) > 0,
            "model.tiny.tokenizer.alphabet",
            "must not be empty",
        ),
    ]
    return [p for holds, path, message in rules for p in rule_problems(holds, path, message)]
