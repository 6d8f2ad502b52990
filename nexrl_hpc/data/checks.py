"""Pre-flight checks of a run's data (part of the shared config checks: before anything starts, and
on the login node before sbatch): each data file opens as its type, its first rows have the
configured prompt and answer keys, chat prompts have a chat template to go through, and not every
prompt is longer than ``rollout_worker.max_prompt_length``. Every problem names its key path.

Only the first few rows are read, unless all of them are too long: then the files are scanned
until one prompt fits (a dataset that fits is usually known from its first row). A prompt whose
character count alone puts it over the limit is not tokenized (``prompts.character_bound``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nexrl_hpc.config.rollout_schema import AGENT_ROLLOUTS
from nexrl_hpc.config.validate import ConfigProblem, config_value, g_safe, rule_problems
from nexrl_hpc.data.prompts import (
    CharacterBound,
    character_bound,
    chat_template_problem,
    needs_chat_template,
    prompt_chars,
    prompt_length,
)
from nexrl_hpc.data.readers import FILE_TYPES, first_rows, iter_rows
from nexrl_hpc.data.rows import MISSING, get_path, normalise_row, prompt_problem

FIRST_ROWS = 5  # rows of each file the checks read


def _key_paths(row: Mapping[str, Any], prefix: str = "", depth: int = 2) -> list[str]:
    """The dotted key paths of ``row`` (nested dicts down to ``depth`` levels), to suggest a key."""
    out: list[str] = []
    for key, value in row.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(value, Mapping) and depth > 1:
            out += _key_paths(value, f"{path}.", depth - 1)
    return out


def data_file_problems(
    cfg: Mapping[str, Any], prefix: str, files_key: str, files: list[tuple[int, str]]
) -> list[ConfigProblem]:
    """Problems of the data config at ``prefix`` ("data" or "validate.data") reading ``files``
    ((index in ``files_key``, path) of the files the path checks found readable)."""
    data = cfg[prefix] if prefix == "data" else cfg["validate"]["data"]
    kind = data["type"] if data["type"] in FILE_TYPES else "jsonl"  # task data is materialised as jsonl
    problems: list[ConfigProblem] = []
    rows: list[dict[str, Any]] = []
    for i, path in files:
        try:
            results = first_rows(kind, path, FIRST_ROWS, data["split"], data["hf_builder"])
        except Exception as exc:  # DataSourceError, or the reader's own error on a broken file
            problems.append(ConfigProblem(f"{files_key}[{i}]", f"{path!r} cannot be read as {kind}: {exc}"))
            continue
        file_rows = [row for _, row, _ in results if row is not None]
        if not file_rows:
            problems.append(
                ConfigProblem(f"{files_key}[{i}]", f"{path!r}: no readable row among its first {FIRST_ROWS}")
            )
            continue
        keys = sorted(set().union(*(_key_paths(r) for r in file_rows)))
        prompt_key, answer_key = data["prompt_key"], data["answer_key"]
        if all(prompt_problem(get_path(r, prompt_key), prompt_key) for r in file_rows):
            why = prompt_problem(get_path(file_rows[0], prompt_key), prompt_key)
            problems.append(
                ConfigProblem(
                    f"{prefix}.prompt_key",
                    f"{why} in the first rows of {path!r} (a string or chat messages expected; "
                    f"the rows have: {', '.join(keys)})",
                )
            )
            continue
        if answer_key is not None and all(get_path(r, answer_key) is MISSING for r in file_rows):
            problems.append(
                ConfigProblem(
                    f"{prefix}.answer_key",
                    f"no {answer_key!r} in the first rows of {path!r} (the rows have: {', '.join(keys)}; "
                    "null: rows without a ground truth)",
                )
            )
            continue
        rows += file_rows
    if problems or not rows:
        return problems
    return _prompt_fit_problems(cfg, prefix, data, kind, [path for _, path in files], rows)


def _prompt_fit_problems(
    cfg: Mapping[str, Any],
    prefix: str,
    data: Mapping[str, Any],
    kind: str,
    files: list[str],
    rows: list[dict[str, Any]],
) -> list[ConfigProblem]:
    """Chat prompts need a chat template; some prompt must fit rollout_worker.max_prompt_length."""
    if cfg["rollout_worker"]["type"] in AGENT_ROLLOUTS:
        return []  # an agent workflow builds its own turn prompts
    from nexrl_hpc.models.run_tokenizer import load_run_tokenizer

    try:
        tokenizer = load_run_tokenizer(cfg["model"])
    except Exception:
        return []  # a model directory that does not load is the model checks' problem
    tasks = [t for t in (normalise_row(r, data)[0] for r in rows) if t is not None]  # type: ignore[arg-type]
    apply_template, add_generation = data["apply_chat_template"], data["add_generation_prompt"]
    if any(needs_chat_template(t["prompt"], apply_template) for t in tasks):
        why = chat_template_problem(tokenizer, cfg["model"]["path"], prefix)
        if why:
            return [ConfigProblem(f"{prefix}.prompt_key", why)]
    limit = cfg["rollout_worker"]["max_prompt_length"]
    measure = _PromptMeasure(tokenizer, character_bound(tokenizer), apply_template, add_generation, limit)
    shortest = min(measure(t["prompt"]) for t in tasks)
    if shortest[0] <= limit:
        return []
    for path in files:  # all first rows too long: is any prompt short enough?
        for _, row, _ in iter_rows(kind, path, data["split"], data["hf_builder"]):
            task = normalise_row(row, data)[0] if row is not None else None  # type: ignore[arg-type]
            if task is not None:
                size = measure(task["prompt"])
                if size[0] <= limit:
                    return []
                shortest = min(shortest, size)
    tokens, counted = shortest
    return [
        ConfigProblem(
            "rollout_worker.max_prompt_length",
            f"every prompt of {prefix}.data_files is longer than {limit} tokens (the shortest has {tokens} "
            f"after templating{counted}): nothing would be left to "
            f"{'validate' if prefix != 'data' else 'train'} on; raise the limit or shorten the prompts",
        )
    ]


@dataclass(frozen=True)
class _PromptMeasure:
    """A prompt's tokens, ``(n, "")``; or, when its characters alone put it over ``limit``, a lower
    bound ``(n, " or more, by its C characters")`` without tokenizing it (a 1 MB prompt takes seconds)."""

    tokenizer: Any
    bound: CharacterBound | None
    apply_template: bool
    add_generation: bool
    limit: int

    def __call__(self, prompt: Any) -> tuple[int, str]:
        floor = self.bound.min_tokens(prompt) if self.bound is not None else 0
        if floor > self.limit:
            return floor, f" or more, by its {prompt_chars(prompt)} characters"
        return prompt_length(self.tokenizer, prompt, self.apply_template, self.add_generation), ""


GENERATED = ("task", "reasoning_gym", "verifiers")  # data.type values whose rows the run writes


def data_files_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Data read from files names at least one file (task and reasoning-gym data are generated)."""
    g = lambda p: config_value(cfg, p)  # noqa: E731
    return rule_problems(
        lambda: g("data.type") in GENERATED or len(g("data.data_files")) > 0,
        "data.data_files",
        f"data.type={g_safe(cfg, 'data.type')} needs at least one file",
    ) + rule_problems(
        lambda: g("validate.data.type") in GENERATED or len(g("validate.data.data_files")) > 0,
        "validate.data.data_files",
        f"validate.data.type={g_safe(cfg, 'validate.data.type')} needs at least one file",
    )


def input_file_problems(cfg: Mapping, model_loads: bool) -> list[ConfigProblem]:
    """The files of ``data.data_files`` and ``validate.data.data_files`` exist (read when data.type is
    jsonl, parquet or hf, or validate.data.type for the latter), and their first rows have the
    configured keys; ``model_loads``: ``model.path`` passed its check (the length check tokenizes).
    Checked on the login node before sbatch, instead of failing once the job runs."""
    problems: list[ConfigProblem] = []
    file_types = ("jsonl", "parquet", "hf")  # data.type values read from data_files
    train_files = g_safe(cfg, "data.type") in file_types
    for key, reads in (
        ("data.data_files", train_files),
        ("validate.data.data_files", train_files or g_safe(cfg, "validate.data.type") in file_types),
    ):
        files = g_safe(cfg, key)
        if not reads or not isinstance(files, list):
            continue
        prefix = key.rsplit(".", 1)[0]
        readable: list[tuple[int, str]] = []
        for i, path in enumerate(files):
            if not isinstance(path, str):
                continue  # the schema check reports the type
            why = _unreadable_file(path, allow_dir=g_safe(cfg, f"{prefix}.type") == "hf")
            if why:
                problems.append(ConfigProblem(f"{key}[{i}]", f"{path!r}: {why}"))
            else:
                readable.append((i, path))
        if readable and model_loads:  # their first rows have the configured keys, some prompt fits
            try:
                problems += data_file_problems(cfg, prefix, key, readable)
            except (KeyError, TypeError, AttributeError):
                pass  # the schema check reports the shape problem
    return problems


def _unreadable_file(path: str, allow_dir: bool = False) -> str:
    """Why ``path`` cannot be read as a data file ('' if it can); ``allow_dir``: a datasets.save_to_disk folder."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        if allow_dir:
            return "" if os.access(path, os.R_OK | os.X_OK) else "cannot be read (permission denied)"
        return "is a directory, not a file"
    if not os.path.isfile(path):
        return "not a regular file"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return ""
