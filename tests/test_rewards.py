"""The one reward API: every accepted signature, file-path specs, failures scored 0 and counted, shipped scorers."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.agents.rewards import load_reward_fn
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.rewards import RewardOutput, exact_match, load_reward, reasoning_gym_score
from nexrl_hpc.rewards.loader import as_reward, to_scores
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS, RewardRunner
from nexrl_hpc.tasks.prepare import prepare_datasets
from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_rows
from tests.conftest import compose_config, run_train

KEY = "rollout_worker.reward_fn"
TASK = {"prompt": "q", "answer": "7", "data_source": "toy", "extra_info": {"split": "train", "k": 2}}


# --- signatures ---------------------------------------------------------------------------------------
def verl_float(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return float(solution_str.strip() == ground_truth) + (0.5 if data_source == "toy" else 0.0)


def verl_dict(data_source, solution_str, ground_truth, extra_info=None):  # type: ignore[no-untyped-def]
    return {"score": 1.0, "acc": True, "pred": solution_str, "k": extra_info["k"], "nan_extra": math.nan}


def verl_without_extra_info(data_source, solution_str, ground_truth):  # type: ignore[no-untyped-def]
    return solution_str == ground_truth  # a bool is a reward


def agent_style(task_info: dict[str, Any], action: Any) -> RewardOutput:
    correct = action == task_info["answer"]
    return RewardOutput(float(correct), {"extracted": action, "steps": 3}, correct)


def agent_returns_float(task_info: dict[str, Any], action: Any) -> float:
    return float(len(action))


def legacy_float(task: dict[str, Any], response: str) -> float:
    return 0.25


def legacy_dict(task: dict[str, Any], response: str) -> dict[str, float]:
    return {"reward": 0.5, "accuracy": 1.0}


def three_required(a: Any, b: Any, c: Any) -> float:
    return 0.0


@pytest.mark.parametrize(
    ("fn", "convention", "response", "scores"),
    [
        (verl_float, "verl", "7", {"reward": 1.5}),
        (verl_dict, "verl", "x", {"reward": 1.0, "acc": 1.0, "k": 2.0}),  # str and NaN extras dropped
        (verl_without_extra_info, "verl", "7", {"reward": 1.0}),
        (agent_style, "agent", "7", {"reward": 1.0, "steps": 3.0, "is_correct": 1.0}),
        (agent_style, "agent", "8", {"reward": 0.0, "steps": 3.0, "is_correct": 0.0}),
        (legacy_float, "task", "7", {"reward": 0.25}),
        (legacy_dict, "task", "7", {"reward": 0.5, "accuracy": 1.0}),
    ],
)
def test_each_signature_scores_to_one_dict(fn: Any, convention: str, response: str, scores: dict) -> None:
    reward = load_reward(f"tests.test_rewards:{fn.__name__}", KEY)
    assert reward.convention == convention
    assert reward(TASK, response) == scores


def test_verl_gets_the_tasks_normalised_fields() -> None:
    seen: list[dict[str, Any]] = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # type: ignore[no-untyped-def]
        seen.append(
            dict(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            )
        )
        return 0

    assert as_reward(compute_score, KEY)(TASK, "resp") == {"reward": 0.0}
    assert seen == [
        {"data_source": "toy", "solution_str": "resp", "ground_truth": "7", "extra_info": TASK["extra_info"]}
    ]


def test_every_signature_serves_the_agent_stack_as_reward_output() -> None:
    out = load_reward_fn("tests.test_rewards:verl_float")(task_info=TASK, action="7")
    assert out == RewardOutput(1.5, {"reward": 1.5}, None)
    out = load_reward_fn("tests.test_rewards:legacy_dict")(task_info=TASK, action="7")
    assert (out.reward, out.is_correct) == (0.5, True)  # accuracy gives the correctness
    out = load_reward_fn("nexrl_hpc.rewards.math:math_reward_fn")(
        task_info={"answer": "2"}, action="\\boxed{2}"
    )
    assert out == RewardOutput(1.0, {"extracted": "2", "reference": "2"}, True)  # passes through whole
    floaty = load_reward_fn("tests.test_rewards:agent_returns_float")(task_info=TASK, action=["a", 1])
    assert floaty == RewardOutput(2.0, {"reward": 2.0}, None)  # the action as given, the float a reward


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.0", "returned str '1.0', which holds no numeric reward"),
        (None, "returned NoneType"),
        (math.nan, "non-finite reward (nan)"),
        (math.inf, "non-finite reward (inf)"),
        ({"acc": 1.0}, "returned a dict without 'reward' or 'score' (keys: ['acc'])"),
        ({"score": "high"}, "holds no numeric reward"),
        (RewardOutput(math.nan), "non-finite reward"),
    ],
)
def test_garbage_results_are_errors(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        to_scores(value)


def test_bad_signatures_are_config_errors_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_reward("tests.test_rewards:three_required", KEY)
    (problem,) = info.value.problems
    assert problem.path == KEY
    assert (
        "'tests.test_rewards:three_required' has the signature (a: 'Any', b: 'Any', c: 'Any')"
        in problem.message
    )
    assert "compute_score" in problem.message  # the accepted forms are listed
    with pytest.raises(ConfigError, match="cannot import reward function 'no_such_mod:f'"):
        load_reward("no_such_mod:f", KEY)
    with pytest.raises(ConfigError) as info:
        compose_config([f"{KEY}=tests.test_rewards:three_required"])
    assert [p.path for p in info.value.problems] == [KEY]


def test_bad_signature_exits_2_before_anything_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "bad"
    proc = run_train([f"run_dir={run_dir}", f"{KEY}=tests.test_rewards:three_required"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert KEY in proc.stderr and "three_required" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


# --- file-path specs ------------------------------------------------------------------------------------
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "from_file": 1}
"""


def test_file_path_specs_relative_and_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rewards_dir").mkdir()
    path = tmp_path / "rewards_dir" / "my_reward.py"
    path.write_text(REWARD_FILE)
    absolute = load_reward(f"{path}:compute_score", KEY)
    assert absolute.convention == "verl"
    assert absolute(TASK, "7") == {"reward": 1.0, "from_file": 1.0}
    monkeypatch.chdir(tmp_path)
    relative = load_reward("rewards_dir/my_reward.py:compute_score", KEY)
    assert relative.fn is absolute.fn  # one module per file
    with pytest.raises(ConfigError, match="no such file 'rewards_dir/nope.py'"):
        load_reward("rewards_dir/nope.py:compute_score", KEY)
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        load_reward("rewards_dir/my_reward.py:missing", KEY)


# --- failures: scored 0, counted, never raised ----------------------------------------------------------
def flaky(task: dict[str, Any], response: str) -> Any:
    if response == "raise":
        raise RuntimeError("judge is down")
    if response == "hang":
        time.sleep(3)
    if response == "garbage":
        return "not a number"
    return 1.0


def test_runner_scores_failures_zero_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(load_reward("tests.test_rewards:flaky", KEY), timeout_s=0.3, num_threads=2)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="nexrl_hpc.rewards.runner"):
            futures = [runner.submit(TASK, r) for r in ("ok", "raise", "hang", "garbage", "ok", "hang", "ok")]
            results = [f.result(timeout=10) for f in futures]
        elapsed = time.monotonic() - start
    finally:
        runner.close()
    assert [r["reward"] for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert [r[ERRORS] for r in results] == [0, 1, 0, 1, 0, 0, 0]
    assert [r[TIMEOUTS] for r in results] == [0, 0, 1, 0, 0, 1, 0]
    assert (runner.num_errors, runner.num_timeouts) == (2, 2)
    assert elapsed < 2.0  # nobody waited for the hung calls to end (3 s each)
    warnings = [r.getMessage() for r in caplog.records]
    assert any("tests.test_rewards:flaky" in w and "RuntimeError: judge is down" in w for w in warnings)
    assert any("timed out" in w and "reward_timeout_s=0.3" in w for w in warnings)
    # rate-limited: one warning per kind (the second error is counted in the next warning)
    assert len(warnings) == 2


def test_every_thread_hung_scores_timeouts_at_once_and_recovers() -> None:
    release = threading.Event()

    def stuck(task: dict[str, Any], response: str) -> float:
        if response == "hang":
            release.wait(30)
        return 1.0

    runner = RewardRunner(as_reward(stuck, KEY), timeout_s=0.2, num_threads=1)
    try:
        hung = [runner.submit(TASK, "hang") for _ in range(6)]  # 1 thread tolerates 4 abandoned calls
        assert all(f.result(timeout=10)[TIMEOUTS] == 1.0 for f in hung)
        start = time.monotonic()
        assert runner.score(TASK, "ok")[TIMEOUTS] == 1.0  # saturated: not queued behind hung calls
        assert time.monotonic() - start < 0.1
        release.set()  # the hung calls return: their threads rejoin the pool
        deadline = time.monotonic() + 5
        while runner.score(TASK, "ok")["reward"] != 1.0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        runner.close()


def test_a_batch_is_scored_in_order_and_a_hung_item_does_not_hold_the_rest_of_its_chunk() -> None:
    """Two threads: chunks [ok, hang, 2, 3] and [4, hang, 6, 7]; both threads hang on their second
    item, the watchdog requeues the rest of each chunk and the replacement threads score it."""

    def by_response(task: dict[str, Any], response: str) -> float:
        return flaky(task, response) if response in ("ok", "hang") else float(response)

    runner = RewardRunner(as_reward(by_response, KEY), timeout_s=0.3, num_threads=2)
    try:
        start = time.monotonic()
        responses = ["ok", "hang", "2", "3", "4", "hang", "6", "7"]
        results = [f.result(timeout=10) for f in runner.submit_many([(TASK, r) for r in responses])]
        elapsed = time.monotonic() - start
    finally:
        runner.close()
    assert [r["reward"] for r in results] == [1.0, 0.0, 2.0, 3.0, 4.0, 0.0, 6.0, 7.0]
    assert [r[TIMEOUTS] for r in results] == [0, 1, 0, 0, 0, 1, 0, 0]
    assert elapsed < 2.0  # the hung calls take 3 s each: nothing waited for them


# --- shipped scorers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "response", "correct"),
    [
        ("72", "Natalia sold 48/2 = 24 clips in May, 48+24 = 72 in total.\n#### 72", True),
        ("Natalia sold 24 + 48 = 72\n#### 72", "so the answer is #### 72", True),  # raw GSM8K reference
        ("1234", "#### 1,234", True),
        ("72", "#### 71", False),
        ("72", "after 72 steps we get #### 70", False),  # the mark decides, not the last number seen
        ("72", "\\boxed{72}", True),
        ("\\frac{1}{2}", "the answer is \\boxed{0.5}", True),
        ("3", "\\boxed{4}", False),
    ],
)
def test_math_verify_on_gsm8k_and_boxed_answers(answer: str, response: str, correct: bool) -> None:
    scores = load_reward("nexrl_hpc.rewards:math_reward_fn", KEY)({"answer": answer}, response)
    assert scores == {"reward": float(correct), "is_correct": float(correct)}


def test_exact_match() -> None:
    assert exact_match({"answer": " 7"}, "7\n") == {"reward": 1.0, "accuracy": 1.0}
    assert exact_match({"answer": 7}, "77") == {"reward": 0.0, "accuracy": 0.0}


def test_reasoning_gym_rows_and_scorer(tmp_path: Path) -> None:
    cfg = compose_config(
        [
            "data.type=reasoning_gym",
            "data.reasoning_gym.dataset=basic_arithmetic",
            "data.reasoning_gym.size=20",
            "validate.data.reasoning_gym.size=8",
            "+data.reasoning_gym.config.max_terms=3",
            f"{KEY}=nexrl_hpc.rewards.reasoning_gym:reasoning_gym_score",
        ]
    )
    train_files, val_files = prepare_datasets(cfg, str(tmp_path))  # type: ignore[arg-type]
    train = [json.loads(line) for line in open(train_files[0])]
    val = [json.loads(line) for line in open(val_files[0])]
    assert len(train) == 20 and 0 < len(val) <= 8
    assert val_files == [str(tmp_path / "data" / "validation.jsonl")]
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}
    row = train[0]
    assert row["prompt"].startswith("Calculate ") and row["data_source"] == "reasoning_gym/basic_arithmetic"
    assert row["extra_info"]["dataset"] == "basic_arithmetic"
    assert row["extra_info"]["config"] == {"max_terms": 3}
    assert all(r["extra_info"]["metadata"]["num_terms"] <= 3 for r in train)
    assert train == reasoning_gym_rows(cfg["data"]["reasoning_gym"])  # the seed makes it reproducible
    reward = load_reward(cfg["rollout_worker"]["reward_fn"], KEY)
    for r in train:
        assert reward(r, r["answer"]) == {"reward": 1.0, "accuracy": 1.0}
        assert reward(r, f"Let me think. <answer>{r['answer']}</answer>")["reward"] == 1.0
        assert reward(r, "no idea")["reward"] == 0.0
        assert reward(r, f"<answer>{int(r['answer']) + 1}</answer>")["reward"] == 0.0


def test_reasoning_gym_leg_counting_scores_with_its_metadata() -> None:
    rows = reasoning_gym_rows({"dataset": "leg_counting", "size": 5, "seed": 3, "config": {}})
    assert all(reasoning_gym_score(r, r["answer"])["reward"] == 1.0 for r in rows)
    assert all(reasoning_gym_score(r, "0")["reward"] == 0.0 for r in rows)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.reasoning_gym.dataset=no_such_dataset"], "data.reasoning_gym.dataset"),
        (
            ["data.reasoning_gym.dataset=basic_arithmetic", "+data.reasoning_gym.config.bogus=1"],
            "data.reasoning_gym.config",
        ),
    ],
)
def test_bad_reasoning_gym_settings_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["data.type=reasoning_gym", *overrides])
    assert key in [p.path for p in info.value.problems], str(info.value)
