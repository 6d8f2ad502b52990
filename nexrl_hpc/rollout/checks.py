"""The rollout's config checks: an agent rollout's agent, workflow, tools and environment; a verifiers
rollout's environment, venv and rows."""

from __future__ import annotations

import os
from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe


def rollout_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    problems = verifiers_config_problems(cfg)
    if g_safe(cfg, "rollout_worker.type") != "agent" or not isinstance(
        g_safe(cfg, "rollout_worker.agent"), Mapping
    ):
        return problems
    from nexrl_hpc.rollout.agent import agent_config_problems  # agents: only when configured

    return problems + agent_config_problems(cfg)


def verifiers_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``rollout_worker.type=verifiers`` and ``data.type=verifiers`` go together (the rows are the
    taskset's tasks, by index); the taskset is named and the venv's python exists."""
    worker, data = g_safe(cfg, "rollout_worker.type"), g_safe(cfg, "data.type")
    if worker != "verifiers" and data != "verifiers":
        return []
    if worker != "verifiers":
        return [ConfigProblem("data.type", "data.type=verifiers needs rollout_worker.type=verifiers")]
    if data != "verifiers":
        return [
            ConfigProblem(
                "data.type",
                f"rollout_worker.type=verifiers runs the taskset's own tasks: set data.type=verifiers (not {data})",
            )
        ]
    from nexrl_hpc.hub.verifiers_env import KEY, verifiers_python

    problems = []
    taskset = g_safe(cfg, f"{KEY}.taskset")
    if not isinstance(taskset, Mapping) or not isinstance(taskset.get("id"), str) or not taskset["id"]:
        problems.append(ConfigProblem(f"{KEY}.taskset.id", "name the verifiers taskset (its package id)"))
    harness = g_safe(cfg, f"{KEY}.harness")
    if not isinstance(harness, Mapping) or not isinstance(harness.get("id"), str) or not harness["id"]:
        problems.append(
            ConfigProblem(f"{KEY}.harness.id", "name the harness (nexrl_chat: in-process, one turn)")
        )
    configured = g_safe(cfg, f"{KEY}.python")
    python = verifiers_python(configured if isinstance(configured, str) else None)
    if not os.access(python, os.X_OK):
        problems.append(
            ConfigProblem(
                f"{KEY}.python",
                f"{python!r} is not an executable: install verifiers' venv with `bash scripts/install_verifiers.sh` "
                "(or name another venv's python)",
            )
        )
    for i, path in enumerate(g_safe(cfg, f"{KEY}.python_path") or []):
        if not os.path.isdir(str(path)):
            problems.append(ConfigProblem(f"{KEY}.python_path[{i}]", f"{path!r} is not a directory"))
    return problems
