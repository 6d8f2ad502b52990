"""The multi-turn tool task learns: ``python -m launch.train task=tool_lookup`` in local mode, real server + trainer.

The AgentRolloutWorker runs every episode (lookup call, tool result, answer) against the local
inference server; GRPO (step-wise advantages) trains on the masked sequences. Seeded; the greedy
validation reward on held-out tables must rise from <= 0.3 well past what calling alone earns,
and the episode metrics must show why: the tool is called and the answers are right. The task's
bar (<= 0.3 -> >= 0.7 within 10 minutes, local and mpi) is timed by bench/tool_task.py; this test
runs the task's same 80 steps (60 steps left too wide a spread: is_correct 0.23-0.76 over five runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch import status as status_cli
from tests.conftest import run_train

pytestmark = pytest.mark.e2e

STEPS = 80  # the task's length; val reward at step 80 over 7 runs: 0.75-0.95 (is_correct 0.49-0.91)


@pytest.mark.timeout(900)  # ~4-6 min on 2 busy cores
def test_tool_lookup_task_learns_to_call_the_tool_then_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "tool"
    proc = run_train(
        [
            "task=tool_lookup",
            f"run_dir={run_dir}",
            "seed=1",
            f"train_worker.total_train_steps={STEPS}",
            f"validate.eval.validate_freq={STEPS}",
            "logger.backend=[]",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f]
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    val = [(r["step"], r["val/reward"], r["val/is_correct"]) for r in rows if "val/reward" in r]
    assert [v[0] for v in val] == [0, STEPS], val
    assert val[0][1] <= 0.3 and val[0][2] <= 0.3, val  # the warmed-up model: syntax, chance contents
    assert val[-1][1] >= 0.6, val  # past the 0.5 that right calls alone earn: the answers are learnt too
    assert val[-1][2] >= 0.35, val  # right answers (chance: ~0.15): the call and the answer both learnt
    # one step's batch is 256 sampled episodes at temperature 1: its mean wobbles (0.85-1.0 seen at
    # step 80), so the claim is made on the last ten steps
    last = train[-10:]
    calls = sum(r["train/num_tool_calls"] for r in last) / len(last)
    done = sum(r["train/termination/env_done"] for r in last) / len(last)
    assert calls >= 0.85, [r["train/num_tool_calls"] for r in last]  # nearly every episode looks the key up
    assert done >= 0.85, [r["train/termination/env_done"] for r in last]
    assert train[0]["train/num_turns"] >= 1.9  # the warmed-up model already writes the call
    # launch.status shows the task's own validation metrics (val/is_correct: there is no val/accuracy)
    capsys.readouterr()
    assert status_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"step {STEPS}: val/reward={val[-1][1]:.4f}, val/is_correct={val[-1][2]:.4f}" in out
    assert "finished (exit 0)" in out
