"""Every cross-field check of a config, gathered from the rooms that own the settings.

Each room checks its own keys (``<room>/checks.py``); this list only fixes the order in which
their problems are reported. Every check tolerates missing or mistyped keys: the schema check
(``config.validate.check_against_schema``) names those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nexrl_hpc.algorithm.checks import algorithm_problems
from nexrl_hpc.checkpoint.checks import resume_layout_problems, resume_problems
from nexrl_hpc.config.hardware import hardware_problems
from nexrl_hpc.config.validate import ConfigProblem
from nexrl_hpc.data.checks import data_files_problems, input_file_problems
from nexrl_hpc.inference.checks import (
    coalesce_problems,
    inference_backend_problems,
    weight_broadcast_problems,
)
from nexrl_hpc.models.checks import (
    model_path_problems,
    tiny_model_callable_problems,
    tiny_model_shape_problems,
)
from nexrl_hpc.pool.checks import batch_ready_rule_problems, group_problems
from nexrl_hpc.rewards.checks import reward_config_problems
from nexrl_hpc.rollout.checks import rollout_config_problems
from nexrl_hpc.runtime.checks import (
    bind_address_problems,
    gc_threshold_problems,
    placement_config_problems,
    umask_problems,
)
from nexrl_hpc.scoring.checks import reward_model_problems
from nexrl_hpc.tasks.checks import reasoning_gym_config_problems, task_generator_problems
from nexrl_hpc.trainer.checks import (
    deepspeed_problems,
    sequence_parallel_problems,
    shared_prompt_problems,
    train_service_problems,
)
from nexrl_hpc.trainer.lora_checks import lora_problems

ConfigCheck = Callable[[Mapping], list[ConfigProblem]]

ROOM_CHECKS: tuple[ConfigCheck, ...] = (
    placement_config_problems,
    reward_config_problems,
    reward_model_problems,
    reasoning_gym_config_problems,
    tiny_model_callable_problems,
    rollout_config_problems,
    task_generator_problems,
    batch_ready_rule_problems,
    shared_prompt_problems,
    gc_threshold_problems,
    data_files_problems,
    resume_problems,
    resume_layout_problems,
    group_problems,
    train_service_problems,
    sequence_parallel_problems,
    umask_problems,
    coalesce_problems,
    algorithm_problems,
    bind_address_problems,
    deepspeed_problems,
    hardware_problems,
    inference_backend_problems,
    weight_broadcast_problems,
    lora_problems,
)
"""The rooms' checks in the order their problems are listed (the input files and the tiny model's
shape come last, see ``semantic_problems``)."""


def semantic_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Problems that the schema cannot express, every room's, in one list."""
    problems = [p for check in ROOM_CHECKS for p in check(cfg)]
    model_problems = model_path_problems(cfg)  # the files the run reads at start-up exist
    problems += model_problems
    problems += input_file_problems(cfg, model_loads=not model_problems)
    problems += tiny_model_shape_problems(cfg)
    return problems
