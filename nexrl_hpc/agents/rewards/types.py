"""The agent stack's view of rewards: ``fn(task_info, action) -> RewardOutput`` (nexrl_hpc.rewards).

``load_reward_fn`` accepts every signature of the one reward API (verl's ``compute_score``,
``(task_info, action) -> RewardOutput``, ``(task, response) -> float | dict``) and hands back the
function in the agent stack's form.
"""

from __future__ import annotations

from nexrl_hpc.rewards.loader import load_reward
from nexrl_hpc.rewards.types import RewardFunction, RewardOutput, zero_reward

__all__ = ["RewardFunction", "RewardOutput", "load_reward_fn", "zero_reward"]


def load_reward_fn(spec: str, key: str = "reward_fn") -> RewardFunction:
    """Import ``"module:function"`` (or ``"file.py:function"``) as ``fn(task_info, action) -> RewardOutput``.

    Why up front: a wrong path or signature should stop the run before start, with the config
    ``key`` named, not fail inside the first rollout.
    """
    return load_reward(spec, key).as_reward_output_fn()
