"""Each algorithm preset learns the default task: ``python -m launch.train algorithm=X``.

The default run (50 steps, seed 7) with the preset's advantage estimator, loss and sampling; the
greedy validation accuracy on the held-out prompts must end at >= 0.8, and so must an independent
greedy evaluation of the run's last checkpoint (GRPO itself reaches ~1.0).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_train

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "preset", ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo"]
)
def test_the_preset_learns_the_default_task(preset: str, tmp_path: Path) -> None:
    run_dir = tmp_path / preset
    proc = run_train([f"algorithm={preset}", f"run_dir={run_dir}", "seed=7", "logger.backend=[]"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.8, val
    assert all(r["actor/nan_skipped"] == 0 for r in rows if "actor/nan_skipped" in r)
    steps = [r for r in rows if "train/reward_mean" in r]
    if preset == "dapo":  # dynamic sampling dropped dull groups and still filled every batch
        assert sum(r["train/filtered_groups"] for r in steps) > 0
        assert all(
            r["train/zero_std_group_frac"] == 0.0 or r["train/filtered_groups_kept"] > 0 for r in steps
        )
    independent = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "independent_eval.py"), str(run_dir)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert independent.returncode == 0, independent.stderr
    result = json.loads(independent.stdout.strip().splitlines()[-1])
    assert result["checkpoint"].endswith("global_step_50") and result["accuracy"] >= 0.8, result
