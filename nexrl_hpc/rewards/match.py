"""String-matching rewards: ``(task, response) -> {"reward", "accuracy"}`` against the row's ``answer``."""

from __future__ import annotations

from typing import Any


def _answer(task: dict[str, Any]) -> str:
    if task.get("answer") is None:
        raise KeyError(f"the task has no 'answer' to match; keys: {sorted(task)}")
    return str(task["answer"]).strip()


def prefix_match(task: dict[str, Any], response: str) -> dict[str, float]:
    """1.0 when the stripped response starts with the row's ``answer`` (tiny models that run on)."""
    correct = float(response.strip().startswith(_answer(task)))
    return {"reward": correct, "accuracy": correct}


def exact_match(task: dict[str, Any], response: str) -> dict[str, float]:
    """1.0 when the response, stripped of surrounding whitespace, equals the row's ``answer``."""
    correct = float(response.strip() == _answer(task))
    return {"reward": correct, "accuracy": correct}
