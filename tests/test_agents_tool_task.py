"""The multi-turn tool task learns: ``python -m launch.train task=tool_lookup`` in local mode, real server + trainer.

The AgentRolloutWorker runs every episode (lookup call, tool result, answer) against the local
inference server; GRPO trains on the masked sequences. Seeded; the reward must rise from the
first steps' mean <= 0.3 to >= 0.7 at the end, and the episode metrics must show why: tool calls
made and answers correct.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.e2e

STEPS = 60


def test_tool_lookup_task_learns_to_call_the_tool_then_answer(tmp_path: Path) -> None:
    run_dir = tmp_path / "tool"
    proc = run_train(
        [
            "task=tool_lookup",
            f"run_dir={run_dir}",
            "seed=1",
            f"train_worker.total_train_steps={STEPS}",
            "validate.validate_before_train=false",
            "validate.eval.validate_freq=0",
            "logger.backend=[]",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f]
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    rewards = [r["train/reward_mean"] for r in train]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first <= 0.3 and last >= 0.7, [round(x, 3) for x in rewards]
    end = train[-1]
    assert end["train/num_tool_calls"] >= 0.9  # nearly every episode looks the key up ...
    assert end["train/is_correct"] >= 0.6  # ... and answers with the looked-up value
    assert end["train/termination/env_done"] >= 0.9
    assert train[0]["train/num_tool_calls"] <= 0.05 and train[0]["train/is_correct"] <= 0.05
    for r in train:
        assert r["train/logprob_mismatch_max"] <= 1e-4, r["step"]  # the trainer re-scores the server's tokens
    val = [r for r in rows if "val/reward" in r]
    assert val and val[-1]["val/is_correct"] >= 0.6, val  # greedy, held-out tables (validate_at_end)
