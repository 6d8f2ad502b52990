"""The reward functions' config checks: each configured reward function imports and has a known
calling convention (``rewards.loader.reward_problems``); a list of them (with ``reward_weights`` of
its length) is for the single-turn worker; none (null) only for a verifiers or OpenEnv environment,
which scores its own episodes."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import REQUIRED_VALUE_HINTS, ConfigError, ConfigProblem, g_safe
from nexrl_hpc.rewards.loader import reward_problems

KEY = "rollout_worker.reward_fn"
WEIGHTS_KEY = "rollout_worker.reward_weights"


def reward_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The rollout's reward function(s), and the task's when it names another one."""
    spec = g_safe(cfg, KEY)
    if spec is None and g_safe(cfg, "rollout_worker.type") not in ("verifiers", "openenv"):
        return [
            ConfigProblem(
                KEY, f"not set (null), expected string or list of string: {REQUIRED_VALUE_HINTS[KEY]}"
            )
        ]
    if isinstance(spec, str) or spec is None:
        problems = reward_problems(cfg, KEY)
        weights = g_safe(cfg, WEIGHTS_KEY)
        if isinstance(spec, str) and isinstance(weights, list) and len(weights) != 1:
            problems.append(
                ConfigProblem(WEIGHTS_KEY, f"{len(weights)} weight(s) for 1 reward function in {KEY}")
            )
    else:
        problems = _reward_list_problems(cfg, spec)
    if g_safe(cfg, "task.reward_fn") != spec:
        problems += reward_problems(cfg, "task.reward_fn")
    return problems


def _reward_list_problems(cfg: Mapping, spec: object) -> list[ConfigProblem]:
    from nexrl_hpc.rewards.combined import load_rewards

    if not isinstance(spec, list) or not all(isinstance(s, str) for s in spec):
        return []  # the schema check names it
    if g_safe(cfg, "rollout_worker.type") != "single_turn":
        return [
            ConfigProblem(
                KEY,
                f"a list of reward functions needs rollout_worker.type=single_turn "
                f"(not {g_safe(cfg, 'rollout_worker.type')}): name one function",
            )
        ]
    weights = g_safe(cfg, WEIGHTS_KEY)
    try:
        load_rewards(spec, weights if isinstance(weights, list) else None, KEY, WEIGHTS_KEY)
    except ConfigError as exc:
        return list(exc.problems)
    return []
