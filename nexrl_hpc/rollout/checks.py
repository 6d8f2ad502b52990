"""The rollout's config checks: an agent rollout's agent, workflow, tools and environment."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe


def rollout_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    if g_safe(cfg, "rollout_worker.type") != "agent" or not isinstance(
        g_safe(cfg, "rollout_worker.agent"), Mapping
    ):
        return []
    from nexrl_hpc.rollout.agent import agent_config_problems  # agents: only when configured

    return agent_config_problems(cfg)
