"""TRL's and verl's reward contracts as users bring them: batched TRL functions (columns as keyword
lists, chat-form completions, None skips), several functions with weights, verl's per-dataset
scorer, the pre-flight call, and the reward error rate that stops a run."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from trl.rewards import accuracy_reward, think_format_reward

from nexrl_hpc.algorithm.advantage_processor import (
    AdvantageProcessor,
    RewardErrorRateExceeded,
    check_reward_errors,
)
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.rewards.batched import COMPLETION_IDS
from nexrl_hpc.rewards.combined import RewardSet, load_rewards
from nexrl_hpc.rewards.loader import SKIPPED, as_reward, load_reward
from nexrl_hpc.rewards.probe import reward_call_problems
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS, RewardRunner
from nexrl_hpc.types import Batch, Trajectory
from nexrl_hpc.validate.validator import Validator
from tests.conftest import compose_config

KEY, WEIGHTS = "rollout_worker.reward_fn", "rollout_worker.reward_weights"
HELPERS = "tests.helpers.user_rewards"
CHAT = [{"role": "user", "content": "What is 1/3 as a fraction?"}]


def chat_task(solution: str, **more: Any) -> dict[str, Any]:
    return {"prompt": CHAT, "answer": solution, "solution": solution, "data_source": "x", **more}


# --- detection and the batched call -----------------------------------------------------------------
def test_trl_functions_are_batched_and_get_chat_completions_for_chat_prompts() -> None:
    accuracy, think = as_reward(accuracy_reward, KEY), as_reward(think_format_reward, KEY)
    assert (accuracy.convention, think.convention) == ("trl", "trl")
    assert accuracy.batched and accuracy.name == "accuracy_reward"
    tasks = [chat_task("\\frac{1}{3}"), chat_task("\\frac{1}{3}"), chat_task("")]  # "" has no gold: None
    responses = ["It is \\boxed{\\frac{1}{3}}", "It is \\boxed{\\frac{1}{2}}", "\\boxed{1}"]
    assert accuracy.score_batch(tasks, responses) == [
        {"reward": 1.0},
        {"reward": 0.0},
        {"reward": 0.0, SKIPPED: 1.0},  # TRL's None: skipped, not a zero
    ]
    assert [s["reward"] for s in think.score_batch(tasks[:2], ["<think>a</think>b", "b"])] == [1.0, 0.0]  # type: ignore[index]


def test_the_batched_call_passes_columns_as_lists_and_plain_text_for_string_prompts() -> None:
    seen: dict[str, Any] = {}

    def reward_func(prompts, completions, completion_ids, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [float(len(c)) for c in completions]

    tasks = [
        {"prompt": "2+2=", "answer": "4", "level": 1, COMPLETION_IDS: [5, 6]},
        {"prompt": "3+3=", "answer": "6", "level": 2, COMPLETION_IDS: [7]},
    ]
    assert [s["reward"] for s in as_reward(reward_func, KEY).score_batch(tasks, ["44", "6"])] == [2.0, 1.0]  # type: ignore[index]
    assert seen == {
        "prompts": ["2+2=", "3+3="],
        "completions": ["44", "6"],  # a string prompt: the completion is text, as TRL does
        "completion_ids": [[5, 6], [7]],
        "answer": ["4", "6"],
        "level": [1, 2],
    }


def test_a_function_without_kwargs_gets_only_what_it_names_and_a_missing_column_is_named() -> None:
    def needs_solution(completions, solution):  # type: ignore[no-untyped-def]
        return [float(c == s) for c, s in zip(completions, solution)]

    reward = as_reward(needs_solution, KEY)
    assert [s["reward"] for s in reward.score_batch([{"prompt": "q", "solution": "7"}], ["7"])] == [1.0]  # type: ignore[index]
    with pytest.raises(TypeError, match=r"needs the dataset column\(s\) 'solution'.*they have: .*answer"):
        reward.score_batch([{"prompt": "q", "answer": "7"}], ["7"])


def test_an_async_reward_function_is_awaited() -> None:
    async def judge(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [float(len(c)) for c in completions]

    assert as_reward(judge, KEY).score_batch([{"prompt": "p"}] * 2, ["ab", "c"]) == [
        {"reward": 2.0},
        {"reward": 1.0},
    ]


def test_a_result_that_is_not_one_value_per_completion_fails_the_batch() -> None:
    reward = as_reward(lambda completions, **kw: [1.0], KEY)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        reward.score_batch([{"prompt": "a"}, {"prompt": "b"}], ["x", "y"])


def test_verls_per_dataset_scorer_works_as_it_is() -> None:
    reward = load_reward(f"{HELPERS}:compute_score", KEY)
    assert (reward.convention, reward.passes_data_source, reward.passes_extra_info) == ("verl", False, False)
    task = {"prompt": "q", "answer": "72", "data_source": "openai/gsm8k", "extra_info": {"index": 0}}
    assert reward(task, "so 70 + 2 = 72\n#### 72") == {"reward": 1.0}
    assert reward(task, "#### 71") == {"reward": 0.0}
    assert reward(task, "72") == {"reward": 0.0}  # strict: no "####"


# --- the runner: one call per submission ------------------------------------------------------------
def test_the_runner_calls_a_batched_function_once_per_submission() -> None:
    calls: list[int] = []

    def reward_func(completions, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(completions))
        return [None if c == "skip" else float(len(c)) for c in completions]

    runner = RewardRunner(as_reward(reward_func, KEY), timeout_s=5, num_threads=3)
    try:
        futures = runner.submit_many([({"prompt": "p"}, r) for r in ("a", "bb", "skip", "ccc")])
        results = [f.result(timeout=10) for f in futures]
    finally:
        runner.close()
    assert calls == [4]
    assert [(r["reward"], r[SKIPPED], r[ERRORS], r[TIMEOUTS]) for r in results] == [
        (1.0, 0.0, 0.0, 0.0),
        (2.0, 0.0, 0.0, 0.0),
        (0.0, 1.0, 0.0, 0.0),
        (3.0, 0.0, 0.0, 0.0),
    ]


def test_a_batched_call_that_raises_or_hangs_fails_every_response_and_keeps_the_first_traceback() -> None:
    runner = RewardRunner(load_reward(f"{HELPERS}:always_raises", KEY), timeout_s=5, num_threads=2)
    try:
        results = [f.result(timeout=10) for f in runner.submit_many([({"prompt": "p"}, "x")] * 3)]
    finally:
        runner.close()
    assert [r[ERRORS] for r in results] == [1.0, 1.0, 1.0] and runner.num_errors == 3
    assert runner.first_error is not None
    assert runner.first_error.startswith(f"{HELPERS}:always_raises: Traceback")
    assert "ConnectionError: the judge at http://judge.invalid is down" in runner.first_error

    release = threading.Event()
    hung = RewardRunner(
        as_reward(lambda completions, **kw: release.wait(), KEY), timeout_s=0.2, num_threads=1
    )
    try:
        start = time.monotonic()
        results = [f.result(timeout=10) for f in hung.submit_many([({"prompt": "p"}, "x")] * 2)]
        assert time.monotonic() - start < 5
    finally:
        release.set()
        hung.close()
    assert [r[TIMEOUTS] for r in results] == [1.0, 1.0]


# --- several functions with weights -----------------------------------------------------------------
def test_several_functions_sum_with_weights_each_logged_by_name() -> None:
    def half(completions, **kwargs):  # type: ignore[no-untyped-def]
        return [None if c == "none" else 0.5 for c in completions]

    def verl_len(solution_str, ground_truth):  # type: ignore[no-untyped-def]
        return float(len(solution_str))

    reward = RewardSet((as_reward(half, KEY), as_reward(verl_len, KEY)), (2.0, -1.0), ("half", "verl_len"))
    assert reward.batched
    out = reward.score_batch([{"prompt": "p"}] * 2, ["abc", "none"])
    assert out == [
        {"reward": 2.0 * 0.5 - 3.0, "rewards/half": 0.5, "rewards/verl_len": 3.0},
        {"reward": -4.0, "rewards/verl_len": 4.0},  # None from one function: left out of the sum (TRL)
    ]
    per_item = RewardSet(
        (as_reward(verl_len, KEY), load_reward(f"{HELPERS}:compute_score", KEY)), (1.0, 2.0), ("a", "b")
    )
    assert not per_item.batched  # scored response by response, each with its own deadline
    assert per_item({"answer": "7"}, "#### 7") == {"reward": 6.0 + 2.0, "rewards/a": 6.0, "rewards/b": 1.0}
    only_none = RewardSet((as_reward(half, KEY),) * 2, (1.0, 1.0), ("half", "half_2"))
    assert only_none.score_batch([{"prompt": "p"}], ["none"]) == [{"reward": 0.0, SKIPPED: 1.0}]


def test_reward_fn_lists_and_weights_load_from_the_config() -> None:
    specs = [f"{HELPERS}:reward_len", "trl.rewards:think_format_reward", f"{HELPERS}:reward_len"]
    reward = load_rewards(specs, [1.0, 0.5, 2.0], KEY, WEIGHTS)
    assert isinstance(reward, RewardSet)
    assert reward.names == ("reward_len", "think_format_reward", "reward_len_2")
    assert reward.weights == (1.0, 0.5, 2.0)
    single = load_rewards(f"{HELPERS}:reward_len", None, KEY, WEIGHTS)
    assert not isinstance(single, RewardSet) and single.name == "reward_len"
    cfg = compose_config([f"{KEY}=[{specs[0]},{specs[1]}]", f"{WEIGHTS}=[1.0,0.5]"])
    assert cfg["rollout_worker"]["reward_fn"] == specs[:2]


@pytest.mark.parametrize(
    ("overrides", "path", "message"),
    [
        (
            [f"{KEY}=[{HELPERS}:reward_len,trl.rewards:think_format_reward]", f"{WEIGHTS}=[1.0]"],
            WEIGHTS,
            "1 weight(s) for 2",
        ),
        ([f"{KEY}=[{HELPERS}:reward_len,no_such_mod:f]"], f"{KEY}[1]", "cannot import reward function"),
        ([f"{KEY}={HELPERS}:reward_len", f"{WEIGHTS}=[1.0,2.0]"], WEIGHTS, "2 weight(s) for 1"),
        (
            [f"{KEY}=[{HELPERS}:reward_len]", "rollout_worker.type=agent"],
            KEY,
            "needs rollout_worker.type=single_turn",
        ),
        (["rollout_worker.max_reward_error_frac=1.5"], "rollout_worker.max_reward_error_frac", ""),
    ],
)
def test_bad_reward_lists_are_config_errors_naming_the_key(
    overrides: list[str], path: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert any(p.path == path and message in p.message for p in info.value.problems), info.value.problems


# --- the pre-flight call ------------------------------------------------------------------------------
def test_preflight_refuses_a_function_that_cannot_take_the_rows_naming_it() -> None:
    cfg = compose_config([f"{KEY}=trl.rewards:accuracy_reward"])  # the digit task's rows have no solution
    (problem,) = reward_call_problems(cfg)
    assert problem.path == KEY
    assert problem.message.startswith("accuracy_reward (module trl.rewards.accuracy_rewards) cannot take")
    assert "'solution'" in problem.message and "dummy response" in problem.message

    wrapped = compose_config([f"{KEY}=[{HELPERS}:reward_len,tests.test_rewards_trl:returns_text]"])
    (problem,) = reward_call_problems(wrapped)
    assert (
        problem.path == f"{KEY}[1]"
        and "returns_text (module tests.test_rewards_trl) returns no reward" in problem.message
    )


def returns_text(completions, **kwargs):  # type: ignore[no-untyped-def]
    return ["good" for _ in completions]


def test_preflight_leaves_a_functions_own_failures_to_the_run() -> None:
    for spec in (f"{HELPERS}:always_raises", f"{HELPERS}:reward_len", f"{HELPERS}:compute_score"):
        assert reward_call_problems(compose_config([f"{KEY}={spec}"])) == [], spec


# --- the advantage: skipped samples, the error rate -----------------------------------------------------
def trajectory(group: str, reward: float, scores: dict[str, float], error: str | None = None) -> Trajectory:
    row: dict[str, Any] = {
        "group_id": group,
        "uid": group,
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "behaviour_log_probs": [-0.1, -0.2],
        "loss_mask": [1, 1],
        "finish_reason": "stop",
        "weight_version": 0,
        "reward": reward,
        "scores": {"reward": reward, SKIPPED: 0.0, ERRORS: 0.0, TIMEOUTS: 0.0, **scores},
    }
    if error:
        row["reward_error"] = error
    return row  # type: ignore[return-value]


def test_skipped_samples_are_left_out_of_the_advantage_and_train_nothing() -> None:
    processor = AdvantageProcessor(compose_config([]), pad_token_id=0)
    rows = [
        trajectory("g", 1.0, {}),
        trajectory("g", 0.0, {}),
        trajectory("g", 0.0, {SKIPPED: 1.0}),
        trajectory("g", 0.5, {}),
    ]
    out = processor.compute(Batch.from_trajectories(rows))
    without = processor.compute(Batch.from_trajectories([rows[0], rows[1], rows[3]]))
    adv = out.values["advantages"]
    assert torch.equal(adv[2], torch.zeros(2)) and torch.equal(out.values["response_mask"][2], torch.zeros(2))
    assert torch.allclose(adv[[0, 1, 3]], without.values["advantages"])  # as if it were not there
    metrics = out.metadata["metrics"]
    assert metrics["reward/skipped"] == 1 and metrics["train/reward_mean"] == pytest.approx(0.5)


def test_a_batch_whose_rewards_mostly_fail_raises_with_the_first_traceback() -> None:
    tb = "reward.py:f: Traceback (most recent call last):\nZeroDivisionError: judge"
    failing = [trajectory("g", 0.0, {ERRORS: 1.0}, tb if i == 1 else None) for i in range(3)]
    batch = Batch.from_trajectories([*failing, trajectory("g", 1.0, {})])
    with pytest.raises(RewardErrorRateExceeded) as info:
        check_reward_errors(batch, 0.5)
    assert "failed for 3 of the 4 samples" in str(info.value)
    assert "rollout_worker.max_reward_error_frac=0.5" in str(info.value) and tb in str(info.value)
    check_reward_errors(batch, 0.75)  # 3/4 is not more than 0.75
    check_reward_errors(Batch.from_trajectories([trajectory("g", 1.0, {})] * 4), 0.0)


def test_validation_averages_the_reward_over_the_samples_that_were_scored() -> None:
    validator = Validator(compose_config([]))
    validator.put_trajectories(
        [trajectory("a", 1.0, {}), trajectory("b", 0.0, {SKIPPED: 1.0}), trajectory("c", 0.5, {})]
    )
    metrics = validator.compute_metrics()
    assert metrics["val/reward"] == pytest.approx(0.75) and metrics["val/reward/skipped"] == pytest.approx(
        1 / 3
    )
    assert metrics["val/num_samples"] == 3
