"""One reward API for every rollout worker: load ``rollout_worker.reward_fn``, adapt it, run it safely.

- loader: ``load_reward(spec, key)`` imports ``module:function`` / ``file.py:function`` and adapts
  TRL's batched ``reward_func(completions, **kwargs)`` (batched: its call), verl's ``compute_score``,
  ``(task_info, action) -> RewardOutput`` and ``(task, response)`` functions to one call returning
  ``{"reward": float, ...}``;
- combined: ``load_rewards(specs, weights, ...)``: several functions with weights (TRL's reward_funcs);
- runner: ``RewardRunner`` scores off the event loop with a timeout; failures score 0 and are counted;
- probe: the pre-flight call of the reward on the first training row;
- shipped functions: math (math-verify: ``\\boxed{}``, GSM8K ``#### N``), match (exact / prefix),
  reasoning_gym (a reasoning-gym dataset's own scorer).
"""

from nexrl_hpc.rewards.combined import RewardSet, load_rewards
from nexrl_hpc.rewards.loader import Reward, as_reward, load_reward
from nexrl_hpc.rewards.match import exact_match, prefix_match
from nexrl_hpc.rewards.math import math_reward_fn
from nexrl_hpc.rewards.reasoning_gym import reasoning_gym_score
from nexrl_hpc.rewards.runner import RewardRunner
from nexrl_hpc.rewards.types import RewardFunction, RewardOutput, zero_reward

__all__ = [
    "Reward",
    "RewardFunction",
    "RewardOutput",
    "RewardRunner",
    "RewardSet",
    "as_reward",
    "exact_match",
    "load_reward",
    "load_rewards",
    "math_reward_fn",
    "prefix_match",
    "reasoning_gym_score",
    "zero_reward",
]
