"""The runtime's own config checks: placement, GC thresholds, the run files' umask, bind addresses.

Gathered with the other rooms' checks by ``nexrl_hpc.assembly.checks``; each tolerates missing or
mistyped keys (the schema check names those).
"""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, config_value, g_safe, rule_problems
from nexrl_hpc.runtime.network import spec_problem
from nexrl_hpc.runtime.placement import placement_problems
from nexrl_hpc.runtime.run_files import umask_problem


def placement_config_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The placement fits the job (``runtime.placement.placement_problems``)."""
    try:
        return placement_problems(cfg)
    except (KeyError, TypeError, AttributeError):
        return []  # the schema check reports the shape problem


def gc_threshold_problems(cfg: Mapping) -> list[ConfigProblem]:
    return rule_problems(
        lambda: len(config_value(cfg, "runtime.gc_thresholds")) == 3,
        "runtime.gc_thresholds",
        "needs 3 values: gen0, gen1, gen2",
    )


def umask_problems(cfg: Mapping) -> list[ConfigProblem]:
    umask = umask_problem(g_safe(cfg, "runtime.umask"))
    return [] if umask is None else [ConfigProblem("runtime.umask", umask)]


def bind_address_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The form of the bind-address settings (each rank resolves them on its own host at start)."""
    problems = []
    for key, unspecified_ok in (
        ("runtime.rpc.interface", False),  # exchanged with the other ranks: must be reachable
        ("service.inference_service.local.host", True),  # the rank's own server: 0.0.0.0 is a choice
        ("service.inference_service.vllm.host", True),
    ):
        value = g_safe(cfg, key)
        problem = spec_problem(value, allow_unspecified=unspecified_ok) if value is not None else None
        if problem:
            problems.append(ConfigProblem(key, problem))
    return problems
