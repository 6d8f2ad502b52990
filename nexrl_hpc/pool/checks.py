"""The pools' config checks: the batch-ready rule, and batches that never split a group."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, callable_problems, config_value, g_safe, rule_problems


def batch_ready_rule_problems(cfg: Mapping) -> list[ConfigProblem]:
    """``trajectory_pool.check_batch_ready_function``: a built-in rule or a ``module:function``."""
    rule = g_safe(cfg, "trajectory_pool.check_batch_ready_function")
    if isinstance(rule, str) and ":" in rule:
        return callable_problems(cfg, "trajectory_pool.check_batch_ready_function", None)
    if isinstance(rule, str) and rule not in ("batch_size", "loaded_batch_finished"):
        return [
            ConfigProblem(
                "trajectory_pool.check_batch_ready_function",
                f"{rule!r} is not 'batch_size', 'loaded_batch_finished' or a 'module:function' path",
            )
        ]
    return []


def group_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Grouped pools (``key_list`` set): a batch holds whole groups of one prompt's samples."""
    g = lambda p: config_value(cfg, p)  # noqa: E731
    return rule_problems(
        lambda: (
            not g("trajectory_pool.key_list")
            or g("trajectory_pool.batch_size") % g("trajectory_pool.group_size") == 0
        ),
        "trajectory_pool.batch_size",
        "must be a multiple of trajectory_pool.group_size so a batch never splits a group",
    ) + rule_problems(
        lambda: (
            not g("trajectory_pool.key_list") or g("trajectory_pool.group_size") == g("data.rollout_repeat_n")
        ),
        "trajectory_pool.group_size",
        "must equal data.rollout_repeat_n (the samples of one prompt form one group)",
    )
