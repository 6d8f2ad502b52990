"""Unknown keys: suggestions from the whole key tree, verl's names mapped to ours, the docs' table."""

from __future__ import annotations

import re

import pytest

from nexrl_hpc.config.key_names import VERL_KEYS, did_you_mean, key_paths, verl_key_table
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.launcher.preflight import preflight
from tests.conftest import CONFIG_DIR, REPO, compose_config

TABLE_START, TABLE_END = "<!-- verl-keys:start -->", "<!-- verl-keys:end -->"


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        preflight(CONFIG_DIR, "rl_train", overrides)
    return {p.path: p.message for p in err.value.problems}


def test_verl_names_on_the_command_line_get_ours() -> None:
    probs = problems_of(
        [
            "actor_rollout_ref.rollout.n=4",
            "trainer.total_training_steps=5",
            "data.max_response_length=256",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ]
    )
    assert probs == {
        "actor_rollout_ref.rollout.n": "unknown key (verl's name; here it is 'data.rollout_repeat_n')",
        "trainer.total_training_steps": "unknown key (verl's name; here it is 'train_worker.total_train_steps')",
        "data.max_response_length": "unknown key (verl's name; here it is 'rollout_worker.max_response_length')",
        "actor_rollout_ref.actor.use_kl_loss": "unknown key (verl's name; here: the KL loss is on when "
        "algorithm.kl_loss_coef > 0 (0: off, no reference model))",
    }


def test_ppo_mini_batch_size_says_it_counts_sequences_here_and_prompts_in_verl() -> None:
    message = problems_of(["actor_rollout_ref.actor.ppo_mini_batch_size=16"])[
        "actor_rollout_ref.actor.ppo_mini_batch_size"
    ]
    assert message.startswith(
        "unknown key (verl's name; here it is 'service.train_service.actor.ppo_mini_batch_size'; "
        "counts SEQUENCES here (prompts x data.rollout_repeat_n), PROMPTS in verl"
    )
    # and it does count sequences: the default is the whole batch, prompts x samples
    cfg = compose_config()
    assert cfg["service"]["train_service"]["actor"]["ppo_mini_batch_size"] == (
        cfg["data"]["batch_size"] * cfg["data"]["rollout_repeat_n"]
    )


def test_a_key_under_the_wrong_parent_is_found_elsewhere_in_the_tree() -> None:
    assert problems_of(["data.lr=1e-5"]) == {
        "data.lr": "unknown key (did you mean 'service.train_service.actor.optim.lr' or "
        "'service.train_service.actor.lora.lr' or 'service.train_service.critic.optim.lr'?)"
    }
    # several keys of that name: up to three, the close sibling first
    assert problems_of(["rollout_worker.batch_size=4"]) == {
        "rollout_worker.batch_size": "unknown key (did you mean 'rollout_worker.fetch_size' or "
        "'data.batch_size' or 'trajectory_pool.batch_size'?)"
    }
    # a misspelt leaf under a parent that does not exist either
    assert problems_of(["actor.ppo_epoch=2"]) == {
        "actor.ppo_epoch": "unknown key (did you mean 'service.train_service.actor.ppo_epochs' or "
        "'service.train_service.critic.ppo_epochs'?)"
    }


def test_an_added_key_is_matched_by_the_schema_check_against_the_whole_tree() -> None:
    # '+' adds the key, so the schema check (not the override check) reports it
    assert problems_of(["+algorithm.kl_coef=0.1"]) == {
        "algorithm.kl_coef": "unknown key (did you mean 'algorithm.kl_loss_coef' or 'algorithm.opd.kl_coef'?)"
    }
    # a section of verl keys: each named by its own path
    assert problems_of(["+trainer.save_freq=5", "+trainer.test_freq=2"]) == {
        "trainer.save_freq": "unknown key (verl's name; here it is 'train_worker.save_freq')",
        "trainer.test_freq": "unknown key (verl's name; here it is 'validate.eval.validate_freq')",
    }
    # with a key that is not verl's in it, the section is named too
    assert problems_of(["+trainer.save_freq=5", "+trainer.colour=red"]) == {
        "trainer": "unknown key (did you mean 'train_worker'?)",
        "trainer.save_freq": "unknown key (verl's name; here it is 'train_worker.save_freq')",
    }


def test_did_you_mean_on_a_small_tree() -> None:
    tree = {"a": {"lr": None, "steps": None}, "b": {"c": {"betas": None}}}
    assert did_you_mean("x.betas", tree) == " (did you mean 'b.c.betas'?)"
    assert did_you_mean("a.step", tree) == " (did you mean 'a.steps'?)"
    assert did_you_mean("b.c.beta", tree) == " (did you mean 'b.c.betas'?)"
    assert did_you_mean("a.zzz", tree) == " (valid keys under a: lr, steps)"
    assert did_you_mean("q.zzz", tree) == ""
    assert key_paths(tree) == ["a", "a.lr", "a.steps", "b", "b.c", "b.c.betas"]


def test_every_verl_key_maps_to_a_key_of_ours() -> None:
    ours = set(key_paths(compose_config()))
    assert [k.ours for k in VERL_KEYS if k.ours is not None and k.ours not in ours] == []
    assert [k.verl for k in VERL_KEYS if k.ours is None and not k.note] == []  # no counterpart: say why
    names = [k.verl for k in VERL_KEYS]
    assert len(names) == len(set(names))
    # verl's names are not ours (where one is, it is the same setting: the table says so)
    assert [k.verl for k in VERL_KEYS if k.verl in ours] == ["algorithm.adv_estimator"]


def test_the_docs_table_is_the_code_table() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    found = re.search(re.escape(TABLE_START) + r"\n(.*?)\n" + re.escape(TABLE_END), page, re.S)
    assert found, f"docs/configuration.md has no table between {TABLE_START} and {TABLE_END}"
    assert found.group(1) == verl_key_table(), (
        "docs/configuration.md's verl table differs from nexrl_hpc.config.key_names.VERL_KEYS: paste "
        'the output of python -c "from nexrl_hpc.config.key_names import verl_key_table; print(verl_key_table())"'
    )
    assert "| `actor_rollout_ref.rollout.n` | `data.rollout_repeat_n` |" in found.group(1)
