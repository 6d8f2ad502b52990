"""``task=custom``: your own model and data get LLM-sized defaults and must name their reward.

Chosen on the command line (and by ``nexrl_hpc.train``) when ``model.path`` or a non-task
``data.type`` is given and no task is named; a toy task's reward with such data is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from nexrl_hpc.config.task_choice import custom_task_reason, overrides_of, with_task_choice
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.launcher.preflight import preflight, task_reward_problems
from tests.conftest import CONFIG_DIR, compose_config, run_train

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("custom_data")
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{i} + 1 = ?"}],
            "reward_model": {"ground_truth": str(i + 1)},
        }
        for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(rows), d / "train.parquet")
    (d / "my_reward.py").write_text(REWARD)
    return {"train": str(d / "train.parquet"), "reward": f"{d / 'my_reward.py'}:compute_score"}


def _data(verl_data: dict[str, str]) -> list[str]:
    """verl-schema parquet rows for both splits."""
    return [
        "data.type=parquet",
        f"data.data_files=[{verl_data['train']}]",
        f"validate.data.data_files=[{verl_data['train']}]",
        "data.answer_key=reward_model.ground_truth",
    ]


def test_the_choice_follows_the_overrides_and_an_explicit_task_wins() -> None:
    assert custom_task_reason(["model.path=/m"]) == "model.path=/m"
    assert custom_task_reason(["seed=3", "data.type=parquet"]) == "data.type=parquet"
    assert custom_task_reason(["+model.path=/m"]) == "model.path=/m"
    assert custom_task_reason(["-m", "data.type=jsonl,parquet"]) == "data.type=jsonl"
    assert custom_task_reason(["--cfg", "job", "--resolve", "model.path=/m"]) == "model.path=/m"
    for nothing_of_yours in (
        [],
        ["seed=3"],
        ["model.path=null"],
        ["data.type=task"],
        ["data.type=task,jsonl"],  # a sweep over the task's data too: the task's defaults
        ["task=max_digit", "model.path=/m"],
        ["model.path=/m", "task=rg_aiw"],
        ["data.type=[broken"],  # the config check reports it
    ):
        assert custom_task_reason(nothing_of_yours) is None, nothing_of_yours
    assert custom_task_reason([], own_data="train_dataset given") == "train_dataset given"
    assert custom_task_reason(["task=max_digit"], own_data="train_dataset given") is None
    assert with_task_choice(["model.path=/m"]) == ["model.path=/m", "task=custom"]
    assert with_task_choice(["seed=1"]) == ["seed=1"]
    assert overrides_of(["-m", "--cfg", "job", "a=1", "--info", "defaults", "b=2", "--resolve"]) == [
        "a=1",
        "b=2",
    ]


def test_the_preset_holds_llm_sized_defaults(chatml_model_dir: str, verl_data: dict[str, str]) -> None:
    reward = f"rollout_worker.reward_fn={verl_data['reward']}"
    cfg = compose_config(["task=custom", *_args(chatml_model_dir, verl_data), reward])
    rw, actor = cfg["rollout_worker"], cfg["service"]["train_service"]["actor"]
    assert (rw["max_prompt_length"], rw["max_response_length"]) == (512, 512)
    assert rw["reward_fn"] == verl_data["reward"] and cfg["task"]["reward_fn"] is None
    assert actor["optim"]["lr"] == 1e-6
    assert actor["ppo_max_token_len_per_gpu"] == 16384
    assert cfg["experiment_name"] == "custom_grpo" and "/custom_grpo/" in cfg["run_dir"]
    assert (
        cfg["model"]["tiny"]["max_position_embeddings"] >= 1024
    )  # the tiny model still fits, without model.path


def test_without_a_reward_the_check_names_rollout_worker_reward_fn(
    chatml_model_dir: str, verl_data: dict[str, str]
) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(["task=custom", *_args(chatml_model_dir, verl_data)])
    assert [p.path for p in err.value.problems] == ["rollout_worker.reward_fn"]
    assert err.value.problems[0].message.startswith(
        "not set (null), expected string or list of string: set it to your reward function"
    )


def test_a_toy_tasks_reward_with_your_own_data_is_refused(
    chatml_model_dir: str, verl_data: dict[str, str]
) -> None:
    data = _args(chatml_model_dir, verl_data)
    with pytest.raises(ConfigError) as err:
        preflight(CONFIG_DIR, "rl_train", ["task=max_digit", *data])  # the task's reward, inherited
    (problem,) = err.value.problems
    assert problem.path == "rollout_worker.reward_fn"
    assert problem.message.startswith(
        "'nexrl_hpc.tasks.rewards:prefix_match' is a toy task's reward (task=max_digit) and data.type=parquet"
    )
    preflight(
        CONFIG_DIR,
        "rl_train",
        ["task=max_digit", *data, "rollout_worker.reward_fn=nexrl_hpc.rewards:prefix_match"],
    )
    preflight(CONFIG_DIR, "rl_train", [])  # the task's reward on the task's rows


def test_custom_by_hand_without_data_names_data_type(chatml_model_dir: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(
            [
                "task=custom",
                f"model.path={chatml_model_dir}",
                "rollout_worker.reward_fn=nexrl_hpc.rewards:exact_match",
            ]
        )
    assert [str(p) for p in err.value.problems] == [
        "data.type: task=custom generates no rows (task.generator is null): set data.type to jsonl, parquet, hf "
        "or reasoning_gym and name the files (data.data_files), or give the task a generator ('module:function')"
    ]


def test_task_reward_rule_on_plain_configs() -> None:
    def config(data_type: str, reward: Any) -> dict[str, Any]:
        return {"data": {"type": data_type}, "rollout_worker": {"reward_fn": reward}, "task": {"name": "t"}}

    assert task_reward_problems(config("task", "nexrl_hpc.tasks.rewards:prefix_match")) == []
    assert task_reward_problems(config("jsonl", "nexrl_hpc.tasks.frozenlake:plan_reward"))[0].path == (
        "rollout_worker.reward_fn"
    )
    assert task_reward_problems(config("hf", "nexrl_hpc.tasks:anything")) != []
    assert task_reward_problems(config("jsonl", "nexrl_hpc.tasks_extra:f")) == []  # not the package
    assert (
        task_reward_problems(config("reasoning_gym", "nexrl_hpc.rewards.reasoning_gym:reasoning_gym_score"))
        == []
    )
    assert task_reward_problems(config("jsonl", None)) == []  # unset: the schema check names it
    several = ["nexrl_hpc.rewards:exact_match", "nexrl_hpc.tasks.rewards:prefix_match"]
    assert [p.path for p in task_reward_problems(config("parquet", several))] == [
        "rollout_worker.reward_fn[1]"
    ]


def _args(chatml_model_dir: str, verl_data: dict[str, str]) -> list[str]:
    return [f"model.path={chatml_model_dir}", *_data(verl_data)]


def test_cfg_job_shows_the_custom_defaults(chatml_model_dir: str, verl_data: dict[str, str]) -> None:
    args = _args(chatml_model_dir, verl_data)
    proc = run_train(["--cfg", "job", "--resolve", *args, f"rollout_worker.reward_fn={verl_data['reward']}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: task=custom (model.path=" in proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["task"]["name"] == "custom" and shown["experiment_name"] == "custom_grpo"
    assert shown["rollout_worker"]["reward_fn"] == verl_data["reward"]
    assert (shown["rollout_worker"]["max_prompt_length"], shown["rollout_worker"]["max_response_length"]) == (
        512,
        512,
    )
    assert shown["service"]["train_service"]["actor"]["optim"]["lr"] == 1e-6
    assert shown["service"]["train_service"]["actor"]["ppo_max_token_len_per_gpu"] == 16384


def test_without_reward_fn_the_command_exits_2_naming_it(
    chatml_model_dir: str, verl_data: dict[str, str], tmp_path: Path
) -> None:
    args = [*_args(chatml_model_dir, verl_data), f"run_dir={tmp_path / 'never'}"]
    for command in (args, ["--cfg", "job", "--resolve", *args]):
        proc = run_train(command)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "  rollout_worker.reward_fn: not set (null)" in proc.stderr
    assert not (tmp_path / "never").exists()


def test_an_explicit_task_keeps_its_defaults_and_its_reward_is_refused(
    chatml_model_dir: str, verl_data: dict[str, str]
) -> None:
    args = ["task=max_digit", *_args(chatml_model_dir, verl_data)]
    proc = run_train(["--cfg", "job", "--resolve", *args])
    shown = yaml.safe_load(proc.stdout)
    assert shown["task"]["name"] == "max_digit" and shown["rollout_worker"]["max_response_length"] == 2
    assert "note: task=custom" not in proc.stderr
    assert (
        proc.returncode == 2
        and "rollout_worker.reward_fn: 'nexrl_hpc.tasks.rewards:prefix_match'" in proc.stderr
    )
