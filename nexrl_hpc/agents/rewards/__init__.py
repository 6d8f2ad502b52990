"""Reward functions of the agent model: ``fn(task_info, action) -> RewardOutput``."""

from nexrl_hpc.agents.rewards.code import code_reward_fn
from nexrl_hpc.agents.rewards.math import math_reward_fn
from nexrl_hpc.agents.rewards.types import RewardFunction, RewardOutput, load_reward_fn, zero_reward

__all__ = [
    "RewardFunction",
    "RewardOutput",
    "code_reward_fn",
    "load_reward_fn",
    "math_reward_fn",
    "zero_reward",
]
