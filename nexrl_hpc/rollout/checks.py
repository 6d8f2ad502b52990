"""The rollout's config checks: an agent rollout's agent, workflow, tools and environment; a verifiers
rollout's environment, venv and rows; an OpenEnv rollout's environment class, venv and agent."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe


def rollout_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    problems = verifiers_config_problems(cfg) + openenv_config_problems(cfg)
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
    return problems + venv_problems(cfg, KEY, verifiers_python, "scripts/install_verifiers.sh")


def venv_problems(
    cfg: Mapping, key: str, default_python: Callable[[str | None], str], install: str
) -> list[ConfigProblem]:
    """A hub's venv: its python (``<key>.python``) runs, its ``python_path`` entries exist."""
    problems = []
    configured = g_safe(cfg, f"{key}.python")
    python = default_python(configured if isinstance(configured, str) else None)
    if not os.access(python, os.X_OK):
        problems.append(
            ConfigProblem(
                f"{key}.python",
                f"{python!r} is not an executable: install the venv with `bash {install}` "
                "(or name another venv's python)",
            )
        )
    for i, path in enumerate(g_safe(cfg, f"{key}.python_path") or []):
        if not os.path.isdir(str(path)):
            problems.append(ConfigProblem(f"{key}.python_path[{i}]", f"{path!r} is not a directory"))
    return problems


def openenv_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``rollout_worker.type=openenv``: the environment class is named, the venv exists, the agent
    class is a ToolAgent, and the tiny model (if used) has a chat template."""
    if g_safe(cfg, "rollout_worker.type") != "openenv":
        return []
    from nexrl_hpc.hub.openenv_env import KEY, openenv_python

    problems = []
    factory = g_safe(cfg, f"{KEY}.env_factory")
    if not isinstance(factory, str) or ":" not in factory:
        problems.append(
            ConfigProblem(
                f"{KEY}.env_factory",
                f"name the environment class as module:Class (TRL's environment_factory), got {factory!r}",
            )
        )
    if g_safe(cfg, "data.type") == "verifiers":
        problems.append(ConfigProblem("data.type", "data.type=verifiers needs rollout_worker.type=verifiers"))
    from nexrl_hpc.agents.agent import ToolAgent
    from nexrl_hpc.config.validate import ConfigError
    from nexrl_hpc.rollout.agent import KEY as AGENT_KEY
    from nexrl_hpc.rollout.agent import _load_class

    try:
        _load_class(g_safe(cfg, f"{AGENT_KEY}.agent_cls"), f"{AGENT_KEY}.agent_cls", ToolAgent)
    except ConfigError as exc:
        problems += exc.problems
    model = g_safe(cfg, "model") or {}
    if model.get("path") is None and not (model.get("tiny") or {}).get("tokenizer", {}).get("chat_template"):
        problems.append(
            ConfigProblem(
                "model.tiny.tokenizer.chat_template",
                "rollout_worker.type=openenv sends chat requests: the tiny model's tokenizer needs a chat template",
            )
        )
    return problems + venv_problems(cfg, KEY, openenv_python, "scripts/install_openenv.sh")
