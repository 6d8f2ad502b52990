"""The multi-turn tool task runs end to end: ``python -m launch.train task=tool_lookup`` in local mode.

The AgentRolloutWorker runs every episode (lookup call, tool result, answer) against the local
inference server; GRPO (step-wise advantages) trains on the masked sequences. A few steps prove
the path: every step is logged with its episode metrics, the warmed-up model already writes the
call, validation reports the task's own metrics and ``launch.status`` shows them. That the task
learns (validation reward <= 0.3 -> >= 0.7 within 10 minutes, local and mpi) is measured by
``bench/tool_task.py`` (results in bench/README.md), not re-proved here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch import status as status_cli
from tests.conftest import run_train

pytestmark = pytest.mark.e2e

STEPS = 4


def test_tool_lookup_task_runs_episodes_that_call_the_tool_and_reports_them(
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
            "task.params.val_size=32",
            "logger.backend=[]",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f]
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    val = [(r["step"], r["val/reward"], r["val/is_correct"]) for r in rows if "val/reward" in r]
    assert [v[0] for v in val] == [0, STEPS], val
    assert val[0][1] <= 0.3 and val[0][2] <= 0.3, val  # the warmed-up model: syntax, chance contents
    for r in train:  # most episodes call the tool, then answer: two turns, ended by the environment
        assert r["train/num_turns"] >= 1.9 and r["train/num_tool_calls"] >= 0.9, r
        assert 0.0 < r["train/termination/env_done"] <= 1.0, r
        assert 0.0 <= r["train/reward_mean"] <= 1.0
    # launch.status shows the task's own validation metrics (val/is_correct: there is no val/accuracy)
    capsys.readouterr()
    assert status_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"step {STEPS}: val/reward={val[-1][1]:.4f}, val/is_correct={val[-1][2]:.4f}" in out
    assert "finished (exit 0)" in out
