"""Materialise the run's datasets as jsonl under ``<run_dir>/data/`` before any module is built.

``data.type=task`` writes the task generator's splits (``train.jsonl``, ``validation.jsonl``);
``data.type=reasoning_gym`` writes the rows the reasoning-gym package generates (validation rows
repeating a training prompt left out); ``data.type=verifiers`` the tasks of the verifiers taskset
(its last ``rollout_worker.verifiers.val_size`` for validation); ``data.type=jsonl|parquet|hf`` uses the configured files. Either way ``<run_dir>/data/validation.jsonl``
ends up holding the validation set the run uses (after the loader's long-prompt filter), with
``prompt`` (a string or chat messages) and ``answer`` (the ground truth of ``answer_key``) fields.
"""

from __future__ import annotations

import json
import os
from typing import Any

from nexrl_hpc.config.imports import load_object
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.data.rows import load_rows, prompt_length_filter


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def prepare_datasets(config: RLTrainConfig, run_dir: str) -> tuple[list[str], list[str]]:
    """Return (train files, validation files) and write ``<run_dir>/data/validation.jsonl``."""
    data_dir = os.path.join(run_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    val_copy = os.path.join(data_dir, "validation.jsonl")
    if config["data"]["type"] == "task":
        spec = config["task"]["generator"]
        assert spec is not None  # tasks.checks: data.type=task needs a generator
        generator = load_object(spec)
        splits = generator(config["task"]["params"], config["data"]["seed"])
        train_path = os.path.join(data_dir, "train.jsonl")
        _write_jsonl(train_path, splits["train"])
        _write_jsonl(val_copy, splits["validation"])
        return [train_path], [val_copy]
    if config["data"]["type"] == "reasoning_gym":
        from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_rows, without_overlap

        train_rows = reasoning_gym_rows(config["data"]["reasoning_gym"])
        train_path = os.path.join(data_dir, "train.jsonl")
        _write_jsonl(train_path, train_rows)
        val_rows = reasoning_gym_rows(config["validate"]["data"]["reasoning_gym"])
        _write_jsonl(val_copy, without_overlap(val_rows, train_rows))
        return [train_path], [val_copy]
    if config["data"]["type"] == "verifiers":
        from nexrl_hpc.hub.verifiers_env import taskset_rows

        train_rows, val_rows = taskset_rows(config, os.path.join(run_dir, "logs", "verifiers_tasks.log"))
        train_path = os.path.join(data_dir, "train.jsonl")
        _write_jsonl(train_path, train_rows)
        _write_jsonl(val_copy, val_rows)
        return [train_path], [val_copy]
    train_files = list(config["data"]["data_files"])
    val_files = list(config["validate"]["data"]["data_files"])
    if val_files and [os.path.abspath(f) for f in val_files] != [os.path.abspath(val_copy)]:
        # the validation loader's own reading: same rows, same long-prompt filter
        tokenizer, max_prompt_length = prompt_length_filter(config)
        loaded = load_rows(
            config["validate"]["data"],
            val_files,
            "validation",
            tokenizer,
            max_prompt_length,
            key_prefix="validate.data",
            model_path=config["model"]["path"],
        )
        _write_jsonl(val_copy, [{"prompt": t["prompt"], "answer": t["answer"]} for t in loaded.tasks])
    return train_files, val_files
