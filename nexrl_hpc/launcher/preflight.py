"""Check command-line overrides and the composed config BEFORE Hydra runs (or a job is submitted).

Hydra itself rejects an override of an unknown key with its own message and exit code 1; here
every problem — unknown keys (with the closest valid name), unknown group options, bad values,
wrong types, missing keys — is collected into one ``ConfigError`` (exit code 2). With ``-m``
each point of the sweep is checked; a point that goes to Slurm (``launcher=slurm`` or Hydra's
submitit launcher) is also checked against the cluster (partition, nodes, time limit).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config import register_resolvers
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError, ConfigProblem, unknown_key_hint

HYDRA_SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
_SWEEP_JOB_KEYS = (
    "partition",
    "nodes",
    "tasks_per_node",
    "cpus_per_task",
    "gpus_per_node",
    "gpus_per_task",
    "timeout_min",
)
"""The submitit launcher's settings a sweep point's job is checked with."""

_PASSTHROUGH_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--cfg",
    "-c",
    "--resolve",
    "--shell-completion",
    "-sc",
    "--version",
}


def _groups(config_dir: str) -> set[str]:
    return {d for d in os.listdir(config_dir) if os.path.isdir(os.path.join(config_dir, d))}


def _compose(config_dir: str, config_name: str, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="preflight"):
        return compose(config_name, overrides=overrides, return_hydra_config=with_hydra)


def _suggest(base: DictConfig, key: str) -> str:
    """The hint for an unknown override: searched in the whole composed tree (and verl's names)."""
    tree = OmegaConf.to_container(base, resolve=False)
    assert isinstance(tree, dict)
    return unknown_key_hint(key, tree)


def _key_exists(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


TASK_REWARD_MODULES = "nexrl_hpc.tasks"
"""The package of the generated toy tasks: its rewards score those tasks' rows (e.g. prefix_match:
"the response starts with the answer", right for max_digit's one-digit answers only)."""


def task_reward_problems(config: Mapping[str, Any]) -> list[ConfigProblem]:
    """A toy task's reward scoring rows that are not the task's (``data.type`` other than ``task``):
    the run would train on the wrong measure (a forgotten ``rollout_worker.reward_fn`` override
    with an explicit ``task=<name>``), so it is refused naming the key (each such entry of a list)."""
    data_type = config["data"]["type"]
    configured = config["rollout_worker"]["reward_fn"]
    if data_type == "task" or config["rollout_worker"].get("type") in ("verifiers", "openenv"):
        return []  # the environment scores (its rubric, or the OpenEnv class's reward function)
    several = isinstance(configured, list)
    problems = []
    for i, spec in enumerate(configured if several else [configured]):
        module = spec.split(":")[0] if isinstance(spec, str) else ""
        if module != TASK_REWARD_MODULES and not module.startswith(TASK_REWARD_MODULES + "."):
            continue
        problems.append(
            ConfigProblem(
                f"rollout_worker.reward_fn[{i}]" if several else "rollout_worker.reward_fn",
                f"{spec!r} is a toy task's reward (task={config['task']['name']}) and data.type={data_type} "
                "is your own data: set rollout_worker.reward_fn to your reward function (the shipped scorers "
                "are in nexrl_hpc.rewards, e.g. nexrl_hpc.rewards:exact_match)",
            )
        )
    return problems


def check_point(config_dir: str, config_name: str, overrides: list[Override]) -> list[ConfigProblem]:
    """Every problem of one override set (one run)."""
    register_resolvers()
    groups = _groups(config_dir)
    group_ovr = [
        o
        for o in overrides
        if o.key_or_group.split("/")[0] in groups | {"hydra"} or o.key_or_group.startswith("hydra.")
    ]
    value_ovr = [o for o in overrides if o not in group_ovr]
    problems: list[ConfigProblem] = []
    good_groups = []
    for o in group_ovr:
        group = o.key_or_group
        value = o.value() if not o.is_delete() else None
        if group in groups and isinstance(value, str):
            options = sorted(
                f[:-5] for f in os.listdir(os.path.join(config_dir, group)) if f.endswith(".yaml")
            )
            if value not in options:
                problems.append(
                    ConfigProblem(
                        group,
                        f"no option {value!r} in config group {group!r} (available: {', '.join(options)})",
                    )
                )
                continue
        good_groups.append(o)
    group_ovr = good_groups
    try:
        base = _compose(config_dir, config_name, [o.input_line for o in group_ovr if o.input_line])
    except HydraException as exc:
        return problems + [ConfigProblem("<overrides>", str(exc).split("\n")[0])]
    kept = []
    for o in value_ovr:
        if o.is_add() or o.is_force_add() or o.is_delete() or _key_exists(base, o.key_or_group):
            kept.append(o)
        else:
            problems.append(ConfigProblem(o.key_or_group, f"unknown key{_suggest(base, o.key_or_group)}"))
    try:
        cfg = _compose(
            config_dir, config_name, [o.input_line for o in group_ovr + kept if o.input_line], True
        )
    except HydraException as exc:
        return problems + [ConfigProblem("<overrides>", str(exc).split("\n")[0])]
    launcher = cfg.hydra.launcher  # which launcher Hydra would hand the runs to
    job = None
    if launcher.get("_target_") == HYDRA_SUBMITIT_SLURM:  # each point becomes a job: check it as one
        job = {k: launcher.get(k) for k in _SWEEP_JOB_KEYS}
        job["setup"] = list(launcher.setup or [])
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        config = validate_config(cfg)
    except ConfigError as err:
        return problems + err.problems
    problems += task_reward_problems(config)
    if job is not None:
        from nexrl_hpc.launcher.slurm import check_hydra_submitit_job

        problems += check_hydra_submitit_job(config, job)
    elif config["launcher"]["name"] == "slurm":  # every point of a sweep fits, before the first is submitted
        from nexrl_hpc.launcher.slurm import check_slurm_job

        problems += check_slurm_job(config)
    elif config["launch_mode"] == "local":  # the run is this process, on this machine: CUDA is here or not
        from nexrl_hpc.config.hardware import local_device_problems

        problems += local_device_problems(config)
    return problems + reward_call_check(config)


def reward_call_check(config: RLTrainConfig) -> list[ConfigProblem]:
    """The reward called once on the first training row (a dummy response): a function that cannot
    take the run's arguments is refused in seconds, named by its own name and module."""
    from nexrl_hpc.rewards.probe import reward_call_problems

    return reward_call_problems(config)


def _sweep_points(overrides: list[Override]) -> list[list[Override]]:
    parser = OverridesParser.create()
    choices: list[list[Override]] = []
    for o in overrides:
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            key = o.get_key_element()
            choices.append(parser.parse_overrides([f"{key}={v}" for v in values]))
        else:
            choices.append([o])
    return [list(p) for p in itertools.product(*choices)]


def preflight(config_dir: str, config_name: str, argv: list[str]) -> None:
    """Raise ``ConfigError`` if any run the command line describes has a config problem."""
    if any(a.split("=")[0] in _PASSTHROUGH_FLAGS for a in argv):
        return
    multirun = any(a in ("-m", "--multirun") for a in argv)
    args = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException as exc:
        raise ConfigError([ConfigProblem("<overrides>", str(exc).split("\n")[0])]) from None
    points = _sweep_points(parsed) if multirun else [parsed]
    problems: list[ConfigProblem] = []
    for point in points:
        for p in check_point(config_dir, config_name, point):
            if p not in problems:
                problems.append(p)
    GlobalHydra.instance().clear()
    if problems:
        raise ConfigError(problems)
