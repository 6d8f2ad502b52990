"""Cross-field rules of the algorithm keys: the estimator, off-policy correction, dynamic sampling,
overlong shaping, and on-policy distillation's teacher (a model that loads, with the student's
tokenizer, and a place to run)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nexrl_hpc.config.rollout_schema import AGENT_ROLLOUTS
from nexrl_hpc.config.validate import ConfigProblem, config_value, g_safe


def algorithm_problems(cfg: Mapping) -> list[ConfigProblem]:
    """Problems the schema cannot express; every rule tolerates missing or mistyped keys (the schema
    check names those)."""
    problems: list[ConfigProblem] = []

    def check(cond_fn: Any, path: str, message: str) -> None:
        try:
            if not cond_fn():
                problems.append(ConfigProblem(path, message))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass

    g = lambda p: config_value(cfg, p)  # noqa: E731
    check(
        lambda: g("algorithm.off_policy_correction") == "none" or g("algorithm.recompute_old_log_prob"),
        "algorithm.off_policy_correction",
        f"{g_safe(cfg, 'algorithm.off_policy_correction')} needs the proximal policy's logprobs: "
        "set algorithm.recompute_old_log_prob=true",
    )
    check(
        lambda: g("algorithm.advantage_granularity") != "step" or g("rollout_worker.type") in AGENT_ROLLOUTS,
        "algorithm.advantage_granularity",
        "step needs per-turn returns, which only rollout_worker.type=agent or openenv produces "
        f"(rollout_worker.type={g_safe(cfg, 'rollout_worker.type')})",
    )
    check(
        lambda: g("algorithm.advantage_granularity") != "step" or g("algorithm.adv_estimator") == "grpo",
        "algorithm.adv_estimator",
        f"{g_safe(cfg, 'algorithm.adv_estimator')} gives one advantage per sequence; "
        "advantage_granularity=step (per-turn returns) is normalised the GRPO way: use adv_estimator=grpo",
    )
    check(
        lambda: g("algorithm.off_policy_correction") != "tis" or g("algorithm.is_cap") is not None,
        "algorithm.is_cap",
        "off_policy_correction=tis truncates the importance weight at is_cap: it must be a number",
    )
    check(
        lambda: not g("algorithm.filter_groups.enable") or bool(g("trajectory_pool.key_list")),
        "algorithm.filter_groups.enable",
        "dynamic sampling drops groups whose rewards are all equal: it needs groups "
        "(trajectory_pool.key_list is empty)",
    )
    check(
        lambda: not g("algorithm.filter_groups.enable") or g("trajectory_pool.group_size") > 1,
        "algorithm.filter_groups.enable",
        "dynamic sampling compares the rewards of a group: a group of one sample (data.rollout_repeat_n=1) "
        "would always be dropped",
    )
    check(
        lambda: g("data.rollout_repeat_n") > 1 or not _group_baseline_trains(cfg),
        "data.rollout_repeat_n",
        f"1 sample per prompt with algorithm.adv_estimator={g_safe(cfg, 'algorithm.adv_estimator')}: "
        "its baseline is the mean of the prompt's group, so a group of one has advantage 0 and every "
        "step would train nothing; sample several per prompt (e.g. data.rollout_repeat_n=8) or use an "
        "estimator without groups (reinforce_pp, gae)",
    )
    check(
        lambda: g("algorithm.overlong.buffer_len") < g("rollout_worker.max_response_length"),
        "algorithm.overlong.buffer_len",
        f"must be below rollout_worker.max_response_length={g_safe(cfg, 'rollout_worker.max_response_length')} "
        "(the penalty zone is the end of the response budget)",
    )
    check(
        lambda: g("algorithm.overlong.buffer_len") == 0 or g("rollout_worker.type") not in AGENT_ROLLOUTS,
        "algorithm.overlong.buffer_len",
        "the soft overlong penalty compares a response's length with rollout_worker.max_response_length, "
        "which is per turn for rollout_worker.type=agent: set it to 0 (algorithm.overlong.filter works per turn)",
    )
    problems += _teacher_problems(cfg)
    problems += _critic_problems(cfg)
    return problems


def _critic_problems(cfg: Mapping) -> list[ConfigProblem]:
    """PPO's value model: a model directory that loads, reading the policy's token ids; its ranks."""
    if g_safe(cfg, "algorithm.adv_estimator") != "gae":
        return []
    key = "service.train_service.critic"
    if g_safe(cfg, f"{key}.head_on_policy") is True:
        return _value_head_problems(cfg)
    size, engine = g_safe(cfg, f"{key}.world_size"), g_safe(cfg, f"{key}.engine")
    problems: list[ConfigProblem] = []
    if isinstance(size, int) and size > 1 and g_safe(cfg, "launch_mode") != "mpi":
        problems.append(
            ConfigProblem(
                f"{key}.world_size", "more than one critic rank needs launch_mode=mpi (its own ranks)"
            )
        )
    if engine == "single" and isinstance(size, int) and size > 1:
        problems.append(
            ConfigProblem(
                f"{key}.engine", "engine=single runs one process: use fsdp or deepspeed for world_size > 1"
            )
        )
    path = g_safe(cfg, f"{key}.model_path")
    if not isinstance(path, str):
        return problems
    from nexrl_hpc.models.checks import model_dir_problem

    why = model_dir_problem(path)
    student_path = g_safe(cfg, "model.path")
    if not why and (student_path is None or not model_dir_problem(str(student_path))):
        why = _teacher_vocabulary_problem(cfg, path)
    return problems + ([ConfigProblem(f"{key}.model_path", f"{path!r}: {why}")] if why else [])


def _value_head_problems(cfg: Mapping) -> list[ConfigProblem]:
    """A value head on the policy: no value model of its own, and the layouts its head reads."""
    key, actor = "service.train_service.critic", "service.train_service.actor"
    why = "with critic.head_on_policy=true the value head trains on the actor's model and ranks"
    rules = [
        (f"{key}.model_path", g_safe(cfg, f"{key}.model_path") is None, f"must be null: {why}"),
        (f"{key}.world_size", g_safe(cfg, f"{key}.world_size") == 1, f"must be 1: {why}"),
        (
            f"{key}.warmup_steps",
            g_safe(cfg, f"{key}.warmup_steps") == 0
            or g_safe(cfg, "service.train_service.engine") != "deepspeed",
            "a warm-up of the value head on the policy is not supported with engine=deepspeed (ZeRO-3 "
            "holds the gradients in its partitions: the trunk's cannot be left out): set it to 0, use "
            "engine=fsdp, or critic.head_on_policy=false",
        ),
        (
            f"{actor}.lora.rank",
            g_safe(cfg, f"{actor}.lora.rank") == 0,
            "a value head on the policy is not trained beside a LoRA adapter yet: use "
            "critic.head_on_policy=false (a value model of its own)",
        ),
        (
            f"{actor}.packing",
            g_safe(cfg, f"{actor}.packing") is False,
            "a value head on the policy reads the padded layout: set it to false",
        ),
        (
            f"{actor}.share_prompt",
            g_safe(cfg, f"{actor}.share_prompt") in (False, "auto"),
            "a value head on the policy reads the padded layout: set it to false or auto "
            "(auto keeps padded rows then)",
        ),
        (
            "service.train_service.sequence_parallel_size",
            g_safe(cfg, "service.train_service.sequence_parallel_size") == 1,
            "a value head on the policy reads whole rows: set it to 1",
        ),
    ]
    return [ConfigProblem(path, message) for path, ok, message in rules if not ok]


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")  # the baseline is the group's mean


def _group_baseline_trains(cfg: Mapping) -> bool:
    """The advantage comes from a group estimator (on-policy distillation without the task reward's
    advantage trains on the teacher's signal alone, whatever the groups)."""
    if g_safe(cfg, "algorithm.name") == "opd" and not g_safe(cfg, "algorithm.opd.reward_coef"):
        return False
    per_turn = g_safe(cfg, "algorithm.advantage_granularity") == "step"  # GRPO over per-turn returns
    return per_turn or g_safe(cfg, "algorithm.adv_estimator") in GROUP_ESTIMATORS


def _teacher_problems(cfg: Mapping) -> list[ConfigProblem]:
    """On-policy distillation: a teacher model directory that loads, and a place for the teacher to run."""
    path = g_safe(cfg, "algorithm.teacher_model_path")
    if path is None:
        if g_safe(cfg, "algorithm.name") == "opd":
            return [
                ConfigProblem(
                    "algorithm.teacher_model_path",
                    "algorithm=opd distills from a teacher: set it to the teacher's HF model directory "
                    "(e.g. <a finished run>/checkpoints/global_step_50/model)",
                )
            ]
        return []
    if not isinstance(path, str):
        return []  # the schema check reports the type
    from nexrl_hpc.models.checks import model_dir_problem

    why = model_dir_problem(path)
    student_path = g_safe(cfg, "model.path")
    if not why and (student_path is None or not model_dir_problem(str(student_path))):
        why = _teacher_vocabulary_problem(cfg, path)
    if why:
        return [ConfigProblem("algorithm.teacher_model_path", f"{path!r}: {why}")]
    teacher = g_safe(cfg, "service.train_service.teacher_service")
    if not isinstance(teacher, Mapping):
        return []
    problems: list[ConfigProblem] = []
    key = "service.train_service.teacher_service"
    if teacher.get("backend") == "direct-zmq":
        if not teacher.get("url"):
            problems.append(ConfigProblem(f"{key}.url", "backend=direct-zmq needs the API server's url"))
        from nexrl_hpc.rpc.preauth import token_problem

        token_env = g_safe(cfg, "service.train_service.token_env")
        bad_token = token_problem(
            os.environ.get(str(token_env), ""), f"the environment variable {token_env!r}"
        )
        if isinstance(token_env, str) and bad_token:
            problems.append(
                ConfigProblem(
                    "service.train_service.token_env", f"the teacher's backend=direct-zmq: {bad_token}"
                )
            )
    if (
        teacher.get("backend") == "local"
        and g_safe(cfg, "launch_mode") != "mpi"
        and teacher.get("world_size") != 1
    ):
        problems.append(
            ConfigProblem(
                f"{key}.world_size",
                "more than one teacher rank needs launch_mode=mpi (teacher ranks in the job) or "
                "backend=direct-zmq (a standalone service)",
            )
        )
    if teacher.get("engine") == "single" and teacher.get("world_size") != 1:
        problems.append(
            ConfigProblem(
                f"{key}.engine", "engine=single runs one process: use fsdp or deepspeed for world_size > 1"
            )
        )
    return problems


def _teacher_vocabulary_problem(cfg: Mapping, teacher_path: str) -> str:
    """The teacher scores the student's token ids: same tokenizer (named with both models)."""
    from transformers import AutoConfig

    from nexrl_hpc.models.checks import vocabulary_mismatch
    from nexrl_hpc.models.run_tokenizer import load_run_tokenizer, load_tokenizer

    try:
        student = load_run_tokenizer(cfg["model"])
    except Exception:  # the model checks report why it does not load
        return ""
    vocab_size = int(AutoConfig.from_pretrained(teacher_path).vocab_size)
    path = g_safe(cfg, "model.path")
    student_rows = int(AutoConfig.from_pretrained(path).vocab_size) if path else None  # tiny: the tokenizer's
    why = vocabulary_mismatch(student, load_tokenizer(teacher_path), vocab_size, student_rows)
    if not why:
        return ""
    named = f"model.path {path!r}" if path else "the tiny model of model.tiny"
    return f"{why} (student: {named})"
