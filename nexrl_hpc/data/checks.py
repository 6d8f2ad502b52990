"""Pre-flight checks of a run's data (part of the shared config checks: before anything starts, and
on the login node before sbatch): each data file opens as its type, its first rows have the
configured prompt and answer keys, chat prompts have a chat template to go through, and not every
prompt is longer than ``rollout_worker.max_prompt_length``. Every problem names its key path.

Only the first few rows are read, unless all of them are too long: then the files are scanned
until one prompt fits (a dataset that fits is usually known from its first row).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.validate import ConfigProblem
from nexrl_hpc.data.prompts import chat_template_problem, needs_chat_template, prompt_length
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
    if cfg["rollout_worker"]["type"] == "agent":
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
    shortest = min(prompt_length(tokenizer, t["prompt"], apply_template, add_generation) for t in tasks)
    if shortest <= limit:
        return []
    for path in files:  # all first rows too long: is any prompt short enough?
        for _, row, _ in iter_rows(kind, path, data["split"], data["hf_builder"]):
            task = normalise_row(row, data)[0] if row is not None else None  # type: ignore[arg-type]
            if task is not None:
                length = prompt_length(tokenizer, task["prompt"], apply_template, add_generation)
                if length <= limit:
                    return []
                shortest = min(shortest, length)
    return [
        ConfigProblem(
            "rollout_worker.max_prompt_length",
            f"every prompt of {prefix}.data_files is longer than {limit} tokens (the shortest has {shortest} "
            f"after templating): nothing would be left to {'validate' if prefix != 'data' else 'train'} on; "
            "raise the limit or shorten the prompts",
        )
    ]
