"""Dataset rows -> normalised tasks: every downstream part sees the same fields, whatever the source schema.

A task holds the row's own fields plus ``prompt`` (a string or chat messages, from ``prompt_key``),
``answer`` (the ground truth, from ``answer_key``; None if the row has none), ``data_source`` and
``extra_info`` (the row's, None if absent) and ``uid``. Keys are dotted paths into nested rows, so
verl's rows (``data_source``, ``prompt`` as messages, ``reward_model.ground_truth``, ``extra_info``)
need only ``answer_key=reward_model.ground_truth`` and TRL's (``prompt`` or ``messages``,
``solution``/``answer``) at most ``prompt_key``/``answer_key``. Bad rows are skipped and counted,
each named by file and row; prompts over ``max_prompt_length`` tokens are filtered and counted (one
far over it by its character count alone without being tokenized: ``prompts.character_bound``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nexrl_hpc.data.prompts import (
    CharacterBound,
    character_bound,
    chat_template_problem,
    is_messages,
    needs_chat_template,
    prompt_chars,
    prompt_length,
)
from nexrl_hpc.data.readers import FILE_TYPES, iter_rows

if TYPE_CHECKING:
    from nexrl_hpc.config.schema import DataConfig, RLTrainConfig

logger = logging.getLogger(__name__)

MISSING: Any = object()  # a key path that is not in the row
LONG_EXAMPLES = 3  # over-long prompts named in the filter's warning


def get_path(row: Mapping[str, Any], path: str) -> Any:
    """The value at dotted ``path`` (``reward_model.ground_truth``; a list index as a number), or ``MISSING``.
    A key that itself contains the dots wins over the nested walk."""
    if path in row:
        return row[path]
    node: Any = row
    for part in path.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def prompt_problem(prompt: Any, prompt_key: str) -> str:
    """Why ``prompt`` is not usable ('' if it is)."""
    if prompt is MISSING or prompt is None:
        return f"no {prompt_key!r}"
    if isinstance(prompt, str):
        return "" if prompt else f"{prompt_key!r} is empty"
    if is_messages(prompt):
        return ""
    return f"{prompt_key!r} is neither a non-empty string nor a list of chat messages {{role, content}}"


def normalise_row(row: dict[str, Any], cfg: DataConfig) -> tuple[dict[str, Any] | None, str]:
    """(task, '') or (None, why the row is unusable)."""
    prompt = get_path(row, cfg["prompt_key"])
    problem = prompt_problem(prompt, cfg["prompt_key"])
    if problem:
        return None, problem
    answer = get_path(row, cfg["answer_key"]) if cfg["answer_key"] is not None else MISSING
    task = dict(row)
    task["prompt"] = [dict(m) for m in prompt] if isinstance(prompt, list) else prompt
    task["answer"] = None if answer is MISSING else answer
    task["data_source"] = row.get("data_source")
    task["extra_info"] = row.get("extra_info")
    task.pop("uid", None)  # the loader's own field: the id_key value, else the row's index
    if cfg["id_key"]:
        uid = get_path(row, cfg["id_key"])
        if uid is not MISSING and uid is not None:
            task["uid"] = str(uid)
    return task, ""


@dataclass
class LoadedRows:
    tasks: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # unreadable rows and rows without a usable prompt
    filtered_long: int = 0  # prompts over max_prompt_length tokens (after templating)
    long_examples: list[str] = field(default_factory=list)  # the first few of them: file, row, size


def prompt_length_filter(config: RLTrainConfig) -> tuple[Any, int | None]:
    """(tokenizer, max_prompt_length) the loaders filter prompts with, or (None, None): an agent
    workflow (or a verifiers environment) builds its own turn prompts and ends an episode whose
    prompt grows too long itself."""
    if config["rollout_worker"]["type"] in ("agent", "verifiers"):
        return None, None
    from nexrl_hpc.models.run_tokenizer import load_run_tokenizer

    return load_run_tokenizer(config["model"]), config["rollout_worker"]["max_prompt_length"]


def reader_type(cfg: DataConfig) -> str:
    """The file reader of ``cfg``: generated data (task, reasoning_gym) is materialised as jsonl
    (tasks/prepare.py)."""
    return cfg["type"] if cfg["type"] in FILE_TYPES else "jsonl"


def load_rows(
    cfg: DataConfig,
    files: list[str],
    split_name: str,
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    key_prefix: str = "data",
    model_path: str | None = None,
) -> LoadedRows:
    """Read, normalise and length-filter every row of ``files`` (``split_name`` names uids without an id)."""
    out = LoadedRows()
    kind = reader_type(cfg)
    bound = character_bound(tokenizer) if tokenizer is not None and max_prompt_length is not None else None
    template_checked = False
    for path in files:
        for row_no, row, problem in iter_rows(kind, path, cfg["split"], cfg["hf_builder"]):
            task = None
            if row is not None:
                task, problem = normalise_row(row, cfg)
            if task is None:
                out.skipped += 1
                logger.warning("%s: row %d: %s; row skipped", path, row_no, problem)
                continue
            if tokenizer is not None and max_prompt_length is not None:
                if not template_checked and needs_chat_template(task["prompt"], cfg["apply_chat_template"]):
                    why = chat_template_problem(tokenizer, model_path, key_prefix)
                    if why:
                        raise ValueError(f"{key_prefix}.prompt_key: {why}")
                    template_checked = True
                over = _over_long(tokenizer, bound, task["prompt"], cfg, max_prompt_length)
                if over:
                    out.filtered_long += 1
                    if len(out.long_examples) < LONG_EXAMPLES:
                        out.long_examples.append(f"{path} row {row_no} ({over})")
                    logger.debug("%s: row %d: prompt of %s filtered", path, row_no, over)
                    continue
            task.setdefault("uid", f"{split_name}-{len(out.tasks)}")
            out.tasks.append(task)
    if out.skipped:
        logger.warning("%s data: skipped %d bad row(s) in %s", split_name, out.skipped, files)
    if out.filtered_long:
        logger.warning(
            "%s data: filtered %d prompt(s) longer than rollout_worker.max_prompt_length=%s tokens in %s: %s%s",
            split_name,
            out.filtered_long,
            max_prompt_length,
            files,
            ", ".join(out.long_examples),
            ", ..." if out.filtered_long > len(out.long_examples) else "",
        )
    return out


def _over_long(
    tokenizer: Any, bound: CharacterBound | None, prompt: Any, cfg: DataConfig, max_prompt_length: int
) -> str:
    """Why ``prompt`` is over ``max_prompt_length`` tokens ('' if it is not): its token count, or a
    count from its characters alone when that already says so (then it is not tokenized)."""
    floor = bound.min_tokens(prompt) if bound is not None else 0
    if floor > max_prompt_length:
        return f"at least {floor} tokens by its {prompt_chars(prompt)} characters, not tokenized"
    length = prompt_length(tokenizer, prompt, cfg["apply_chat_template"], cfg["add_generation_prompt"])
    return f"{length} tokens" if length > max_prompt_length else ""
