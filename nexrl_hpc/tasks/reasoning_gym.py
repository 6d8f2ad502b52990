"""Rows of a reasoning-gym dataset (``data.type=reasoning_gym``), generated procedurally: no download.

Each row: ``prompt`` (the dataset's question, a string), ``answer``, ``data_source``
(``reasoning_gym/<name>``) and ``extra_info`` (``dataset``, ``config``, the entry's ``metadata``):
what nexrl_hpc.rewards.reasoning_gym:reasoning_gym_score needs to call the dataset's own scorer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def reasoning_gym_rows(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``settings``: ``dataset`` (a registered name), ``size``, ``seed``, ``config`` (its other options)."""
    import reasoning_gym  # optional dependency: pip install 'nexrl_hpc[reasoning_gym]'

    name = settings["dataset"]
    config = dict(settings["config"] or {})
    dataset = reasoning_gym.create_dataset(
        name, **{**config, "size": settings["size"], "seed": settings["seed"]}
    )
    rows = []
    for entry in dataset:
        # through JSON once: tuples in the metadata become lists, as the scorer will see them
        metadata = json.loads(json.dumps(entry["metadata"], default=str))
        rows.append(
            {
                "prompt": entry["question"],
                "answer": entry["answer"],
                "data_source": f"reasoning_gym/{name}",
                "extra_info": {"dataset": name, "config": config, "metadata": metadata},
            }
        )
    return rows


def without_overlap(validation: list[dict[str, Any]], train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation rows whose prompt is not a training prompt (small datasets repeat questions)."""
    seen = {row["prompt"] for row in train}
    return [row for row in validation if row["prompt"] not in seen]


def reasoning_gym_problems(settings: Any, key: str) -> list[tuple[str, str]]:
    """(key path, message) for settings that cannot build a dataset: no package, unknown name, bad config."""
    if not isinstance(settings, Mapping):
        return []  # the schema check reports the shape
    try:
        import reasoning_gym
    except ImportError:
        return [(f"{key}.dataset", "data.type=reasoning_gym needs pip install 'nexrl_hpc[reasoning_gym]'")]
    from reasoning_gym.factory import DATASETS

    name = settings.get("dataset")
    if not isinstance(name, str) or name not in DATASETS:
        return [
            (
                f"{key}.dataset",
                f"{name!r} is not a reasoning-gym dataset (e.g. {', '.join(sorted(DATASETS)[:6])}, ...)",
            )
        ]
    try:
        config = dict(settings.get("config") or {})
        reasoning_gym.create_dataset(name, **{**config, "size": 1, "seed": 0})
    except Exception as exc:
        return [(f"{key}.config", f"dataset {name!r} rejects this config: {type(exc).__name__}: {exc}")]
    return []
