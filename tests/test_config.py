"""Config validation: every kind of problem, all reported at once, exit code 2, nothing started."""

from __future__ import annotations

import os

import pytest

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError, check_against_schema
from nexrl_hpc.launcher.preflight import preflight
from tests.conftest import CONFIG_DIR, compose_config, compose_raw, run_train


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        preflight(CONFIG_DIR, "rl_train", overrides)
    return {p.path: p.message for p in err.value.problems}


def test_default_config_is_valid_and_derives_sizes() -> None:
    cfg = compose_config()
    assert (
        cfg["trajectory_pool"]["batch_size"]
        == cfg["data"]["batch_size"] * cfg["data"]["rollout_repeat_n"]
        == 256
    )
    assert cfg["service"]["train_service"]["actor"]["ppo_mini_batch_size"] == 256
    assert cfg["model"]["tiny"]["tokenizer"]["alphabet"] == cfg["task"]["alphabet"]
    assert cfg["service"]["inference_service"]["local"]["host"] == "127.0.0.1"  # never 0.0.0.0 by default
    assert check_against_schema(cfg, RLTrainConfig) == []


def test_unknown_key_names_closest_valid_key() -> None:
    probs = problems_of(["train_worker.total_train_stepz=3"])
    assert probs == {
        "train_worker.total_train_stepz": "unknown key (did you mean 'train_worker.total_train_steps'?)"
    }


def test_removed_duplicate_key_points_to_the_key_that_names_the_same_path() -> None:
    for override in ("train_worker.sync_weight_path=/x", "+train_worker.sync_weight_path=/x"):
        probs = problems_of([override])
        assert probs == {
            "train_worker.sync_weight_path": "unknown key (did you mean 'weight.sync_weight_path'?)"
        }


def test_unknown_key_added_with_plus_is_caught_by_schema() -> None:
    probs = problems_of(["+algorithm.kl_coef=0.1"])
    assert probs["algorithm.kl_coef"].startswith("unknown key (did you mean 'algorithm.kl_loss_coef'")


def test_wrong_type() -> None:
    probs = problems_of(["data.batch_size=abc"])
    assert probs == {"data.batch_size": "expected int, got str 'abc'"}  # follow-on errors suppressed


def test_value_outside_enum() -> None:
    probs = problems_of(["algorithm.kl_loss_type=low_var"])
    assert (
        probs["algorithm.kl_loss_type"]
        == "'low_var' is not one of ['k1', 'k2', 'k3', 'low_var_kl'] (did you mean 'low_var_kl'?)"
    )
    probs = problems_of(["algorithm.kl_loss_type=k9"])
    assert probs["algorithm.kl_loss_type"] == "'k9' is not one of ['k1', 'k2', 'k3', 'low_var_kl']"


def test_value_outside_range() -> None:
    probs = problems_of(["service.train_service.actor.optim.lr=-1", "train_worker.total_train_steps=0"])
    assert probs["service.train_service.actor.optim.lr"] == "must be > 0.0, got -1"
    assert probs["train_worker.total_train_steps"] == "must be >= 1, got 0"


def test_mapping_values_are_checked_against_their_type() -> None:
    probs = problems_of(["+runtime.mpi_env.FI_PROVIDER=[tcp]", "placement.resources.rollout.cpus_per_rank=0"])
    assert probs["runtime.mpi_env.FI_PROVIDER"] == "expected string or int or float or bool, got list"
    assert probs["placement.resources.rollout.cpus_per_rank"] == "must be >= 1, got 0"
    assert compose_config(["+runtime.mpi_env.MPIR_CVAR_NOLOCAL=1"])["runtime"]["mpi_env"] == {
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "MPIR_CVAR_NOLOCAL": 1,
    }


def test_missing_required_key() -> None:
    probs = problems_of(["~train_worker.save_freq"])
    assert probs == {"train_worker.save_freq": "missing required key (expected int)"}


def test_unknown_group_option() -> None:
    probs = problems_of(["task=nope"])
    assert probs == {
        "task": "no option 'nope' in config group 'task' (available: coding, custom, frozenlake, max_digit, rg_aiw, tool_lookup)"
    }


def test_many_problems_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        preflight(
            CONFIG_DIR,
            "rl_train",
            [
                "train_worker.total_train_stepz=3",
                "data.batch_size=abc",
                "weight.sync_mode=asyncc",
                "logger.backend=[console,neptune]",
            ],
        )
    paths = [p.path for p in err.value.problems]
    assert paths == [
        "train_worker.total_train_stepz",
        "data.batch_size",
        "weight.sync_mode",
        "logger.backend[1]",
    ]
    text = str(err.value)
    assert text.startswith("invalid config (4 problems):")
    assert all(p in text for p in paths)


def test_reward_fn_that_does_not_import_or_has_wrong_signature() -> None:
    probs = problems_of(["rollout_worker.reward_fn=nexrl_hpc.tasks.rewards:nothere"])
    assert probs["rollout_worker.reward_fn"].startswith(
        "cannot import reward function 'nexrl_hpc.tasks.rewards:nothere': AttributeError"
    )
    # two arguments pass the signature check; the pre-flight call on the first row shows it cannot take them
    with pytest.raises(ConfigError, match=r"join \(module posixpath\) cannot take the arguments it gets"):
        preflight(CONFIG_DIR, "rl_train", ["rollout_worker.reward_fn=os.path:join"])
    probs = problems_of(["rollout_worker.reward_fn=os:getcwd"])
    assert "'os:getcwd' has the signature (); a reward function takes" in probs["rollout_worker.reward_fn"]


def test_cross_field_rules() -> None:
    probs = problems_of(["trajectory_pool.group_size=3"])
    assert (
        probs["trajectory_pool.group_size"]
        == "must equal data.rollout_repeat_n (the samples of one prompt form one group)"
    )
    assert (
        probs["trajectory_pool.batch_size"]
        == "must be a multiple of trajectory_pool.group_size so a batch never splits a group"
    )
    probs = problems_of(["data.type=jsonl"])
    assert probs["data.data_files"] == "data.type=jsonl needs at least one file"
    probs = problems_of(["resume.mode=from_path"])
    assert probs == {"resume.resume_path": "resume.mode=from_path needs resume.resume_path"}
    probs = problems_of(["rollout_worker.max_response_length=60"])
    assert "must fit model.tiny.max_position_embeddings" in probs["rollout_worker.max_response_length"]
    probs = problems_of(["service.train_service.actor.ppo_mini_batch_size=100"])
    assert (
        probs["service.train_service.actor.ppo_mini_batch_size"] == "must divide trajectory_pool.batch_size"
    )


def test_deepspeed_section_problems_name_their_key() -> None:
    probs = problems_of(
        ["service.train_service.engine=deepspeed", "service.train_service.deepspeed.zero_stage=5"]
    )
    assert probs == {"service.train_service.deepspeed.zero_stage": "must be <= 3, got 5"}
    probs = problems_of(
        [
            "service.train_service.engine=deepspeed",
            "+service.train_service.deepspeed.config.gradient_clipping=2.0",
            "+service.train_service.deepspeed.config.zero_optimization.stage=1",
        ]
    )
    assert probs == {
        "service.train_service.deepspeed.config.gradient_clipping": "is set by service.train_service.actor.grad_clip",
        "service.train_service.deepspeed.config.zero_optimization.stage": (
            "is set by service.train_service.deepspeed.zero_stage"
        ),
    }
    probs = problems_of(["service.train_service.deepspeed.config=3"])
    assert probs == {"service.train_service.deepspeed.config": "expected a mapping, got int 3"}


def test_deepspeed_config_is_generated_from_the_section_with_raw_keys_merged() -> None:
    from nexrl_hpc.trainer.deepspeed_strategy import deepspeed_config

    cfg = compose_config(
        [
            "service.train_service.engine=deepspeed",
            "service.train_service.dtype=bfloat16",
            "+service.train_service.deepspeed.config.zero_optimization.offload_optimizer.device=cpu",
        ]
    )
    ts = cfg["service"]["train_service"]
    ds = deepspeed_config({"deepspeed": ts["deepspeed"], "dtype": ts["dtype"], "actor": ts["actor"]})
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == ts["actor"]["grad_clip"]
    assert ds["managed_gradient_accumulation"] is False and ds["gradient_accumulation_steps"] == 1


def test_sweep_points_are_each_checked() -> None:
    with pytest.raises(ConfigError) as err:
        preflight(CONFIG_DIR, "rl_train", ["-m", "seed=1,2", "data.rollout_repeat_n=8,0"])
    assert {p.path for p in err.value.problems} == {"data.rollout_repeat_n"}
    preflight(CONFIG_DIR, "rl_train", ["-m", "seed=1,2"])  # no error


def test_validate_config_on_a_plain_dict() -> None:
    cfg = compose_config()
    cfg["seed"] = "x"
    del cfg["resume"]["mode"]
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert {p.path for p in err.value.problems} == {"seed", "resume.mode"}


def test_interpolation_to_missing_key_is_reported() -> None:
    raw = compose_raw(["experiment_name=${nothere.x}"])
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert err.value.problems[0].path == "experiment_name"
    assert "cannot resolve" in err.value.problems[0].message


def test_cli_bad_config_exits_2_lists_every_key_and_starts_nothing(tmp_path) -> None:
    run_dir = tmp_path / "never"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "train_worker.total_train_stepz=3",
            "data.batch_size=abc",
            "weight.sync_mode=x",
            "service.train_service.deepspeed.zero_stage=5",
        ],
        timeout=120,
    )
    assert proc.returncode == 2
    keys = ("train_worker.total_train_stepz", "data.batch_size", "weight.sync_mode")
    for key in (*keys, "service.train_service.deepspeed.zero_stage"):
        assert key in proc.stderr
    assert not os.path.exists(run_dir)
