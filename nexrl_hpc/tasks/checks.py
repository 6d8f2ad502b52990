"""The tasks' config checks: reasoning-gym datasets that exist, a task generator that can be called."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, callable_problems, g_safe


def reasoning_gym_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``data.type=reasoning_gym``: both splits are generated (``tasks.prepare``) from known datasets."""
    if g_safe(cfg, "data.type") != "reasoning_gym":
        return []
    from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_problems  # only when configured

    problems: list[ConfigProblem] = []
    for key in ("data.reasoning_gym", "validate.data.reasoning_gym"):
        problems += [ConfigProblem(*p) for p in reasoning_gym_problems(g_safe(cfg, key), key)]
    return problems


def task_generator_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``data.type=task`` (either split): ``task.generator`` is a function of (params, seed)."""
    if g_safe(cfg, "data.type") != "task" and g_safe(cfg, "validate.data.type") != "task":
        return []
    if g_safe(cfg, "task.generator") is None:
        return [
            ConfigProblem(
                "data.type",
                f"task={g_safe(cfg, 'task.name')} generates no rows (task.generator is null): set data.type to "
                "jsonl, parquet, hf or reasoning_gym and name the files (data.data_files), or give the task a "
                "generator ('module:function')",
            )
        ]
    return callable_problems(cfg, "task.generator", 2)
