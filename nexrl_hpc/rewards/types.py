"""RewardOutput, what agent-style reward functions return, and the reward-function protocols."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RewardOutput:
    """What a reward function returns: the scalar, evaluation details, and correctness."""

    reward: float
    metadata: dict[str, Any] = field(default_factory=dict)
    is_correct: bool | None = None


class RewardFunction(Protocol):
    """``reward_fn(task_info, action) -> RewardOutput``; ``action`` is the model's final answer text."""

    def __call__(self, task_info: dict[str, Any], action: Any) -> RewardOutput: ...


def zero_reward(task_info: dict[str, Any], action: Any) -> RewardOutput:
    """The no-op default: every action earns 0."""
    return RewardOutput(reward=0.0, metadata={}, is_correct=None)
