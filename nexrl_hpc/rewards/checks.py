"""The reward functions' config checks: each configured reward function imports and has a known
calling convention (``rewards.loader.reward_problems``)."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe
from nexrl_hpc.rewards.loader import reward_problems


def reward_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The rollout's reward function, and the task's when it names another one."""
    problems = reward_problems(cfg, "rollout_worker.reward_fn")
    if g_safe(cfg, "task.reward_fn") != g_safe(cfg, "rollout_worker.reward_fn"):
        problems += reward_problems(cfg, "task.reward_fn")
    return problems
