"""Reward functions shared by tasks. Signature: ``(task_row, response_text) -> {"reward": float, ...}``."""

from __future__ import annotations

from typing import Any


def prefix_match(task: dict[str, Any], response: str) -> dict[str, float]:
    """1.0 when the stripped response starts with the row's ``answer``; reported as reward and accuracy."""
    correct = float(response.strip().startswith(str(task["answer"])))
    return {"reward": correct, "accuracy": correct}
