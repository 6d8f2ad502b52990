"""The one reward API in whole runs (python -m launch.train): the agent stack's math_reward_fn in the
single-turn worker, and a verl-signature reward from a file that raises and hangs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.e2e

SMALL = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
    "data.batch_size=8",
    "data.rollout_repeat_n=4",
    "train_worker.total_train_steps=2",
]


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "train/reward_mean" in r]


def test_math_reward_fn_runs_in_the_single_turn_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "math"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "rollout_worker.reward_fn=nexrl_hpc.agents.rewards.math:math_reward_fn",
            *SMALL,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["reward/errors"], r["reward/timeouts"]) == (0, 0)
        assert 0.0 <= r["train/is_correct"] <= 1.0
        assert r["train/is_correct"] == pytest.approx(r["train/reward_mean"])  # 1 exactly when correct


FLAKY_REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith(("1", "3", "5")):
        raise ZeroDivisionError("flaky judge")
    if solution_str.startswith(("2", "4", "6")):
        time.sleep(2)
    return float(solution_str.startswith(str(ground_truth)))
"""


def test_raising_and_hanging_rewards_score_zero_and_are_counted(tmp_path: Path) -> None:
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(FLAKY_REWARD)
    run_dir = tmp_path / "flaky"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"rollout_worker.reward_fn={reward_file}:compute_score",
            "rollout_worker.reward_timeout_s=0.5",
            "rollout_worker.max_reward_error_frac=1.0",  # counted, never stopping the run
            "rollout_worker.temperature=1.5",  # a spread of first digits: some raise, some hang
            *SMALL,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["reward/errors"] for r in rows) > 0, rows
    assert sum(r["reward/timeouts"] for r in rows) > 0, rows
    log = (run_dir / "train.log").read_text()
    assert "flaky_reward.py:compute_score raised or returned no reward" in log
    assert "ZeroDivisionError: flaky judge" in log
    assert "timed out" in log and "reward_timeout_s=0.5" in log
