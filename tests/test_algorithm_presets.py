"""Each algorithm preset runs the whole stack: ``python -m launch.train algorithm=X``.

A few steps of the default run (seed 7) with the preset's advantage estimator, loss and sampling:
the run saves the preset's settings, every step's loss and gradient are finite, and DAPO's dynamic
sampling drops dull groups and still fills every batch. That each preset learns — steps and training
time to held-out accuracy 0.9 per seed, and an independent greedy evaluation of every run's last
checkpoint — is measured by ``bench/algorithms.py`` (bench/README.md); the estimators and losses
themselves are unit-tested against hand-computed numbers in tests/test_algorithms.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import compose_config, run_train

pytestmark = pytest.mark.e2e

STEPS = 6


@pytest.mark.parametrize(
    "preset", ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "ppo"]
)
def test_the_preset_runs_the_default_task(preset: str, tmp_path: Path) -> None:
    run_dir = tmp_path / preset
    proc = run_train(
        [
            f"algorithm={preset}",
            f"run_dir={run_dir}",
            "seed=7",
            "logger.backend=[]",
            f"train_worker.total_train_steps={STEPS}",
            f"validate.eval.validate_freq={STEPS}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    expected = compose_config([f"algorithm={preset}"])
    assert saved["algorithm"] == expected["algorithm"]
    assert saved["service"]["train_service"]["actor"] == expected["service"]["train_service"]["actor"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "val/accuracy" in r] == [0, STEPS]
    # PPO's preset trains the critic alone for its first `critic.warmup_steps` steps
    warmup = expected["service"]["train_service"]["critic"]["warmup_steps"] if preset == "ppo" else 0
    assert warmup < STEPS
    assert [r["step"] for r in steps if r.get("critic/warmup") == 1.0] == list(range(1, warmup + 1))
    for r in steps[:warmup]:
        assert r["actor/optimizer_steps"] == 0 and math.isfinite(r["critic/vf_loss"]), r
    for r in steps[warmup:]:
        assert r["actor/nan_skipped"] == 0 and r["actor/optimizer_steps"] >= 1, r
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]), r
    if preset == "ppo":
        assert all(math.isfinite(r["critic/vf_loss"]) for r in steps), steps
    if preset == "dapo":  # dynamic sampling dropped dull groups and still filled every batch
        assert sum(r["train/filtered_groups"] for r in steps) > 0
        assert all(
            r["train/zero_std_group_frac"] == 0.0 or r["train/filtered_groups_kept"] > 0 for r in steps
        )
