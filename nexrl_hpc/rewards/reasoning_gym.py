"""reasoning_gym_score: a reasoning-gym dataset's own ``score_answer`` as a reward function.

Rows come from ``data.type=reasoning_gym`` (nexrl_hpc.tasks.reasoning_gym): ``answer`` is the
dataset's answer and ``extra_info`` holds ``dataset`` (its registered name), ``config`` (what it was
built with; some scorers read their dataset's config) and the entry's ``metadata``. The answer
judged is the last ``<answer>...</answer>`` of the response when it has one (reasoning-gym's prompt
convention), else the whole response, stripped.
"""

from __future__ import annotations

import functools
import json
from typing import Any


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
    """The dataset object whose ``score_answer`` judges rows of ``name`` built with that config."""
    import reasoning_gym  # optional dependency: pip install 'nexrl_hpc[reasoning_gym]'

    return reasoning_gym.create_dataset(name, **{**json.loads(config_json), "size": 1})


def reasoning_gym_score(task: dict[str, Any], response: str) -> dict[str, float]:
    """The dataset's score of the response (0..1; partial credit where the dataset gives it)."""
    from reasoning_gym.utils import extract_answer

    extra = task.get("extra_info") or {}
    metadata = extra.get("metadata") or {}
    name = extra.get("dataset") or metadata.get("source_dataset")
    if not name:
        raise KeyError(
            "the task names no reasoning-gym dataset (extra_info.dataset / metadata.source_dataset)"
        )
    dataset = _dataset(str(name), json.dumps(extra.get("config") or {}, sort_keys=True))
    entry = {"question": task.get("prompt"), "answer": task.get("answer"), "metadata": metadata}
    tagged = extract_answer(response)
    score = float(dataset.score_answer(tagged if tagged is not None else response.strip(), entry))
    return {"reward": score, "accuracy": float(score >= 1.0)}
