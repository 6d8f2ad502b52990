"""An elastic rank with the default engine and transport: a joiner's local server receives the
weights by broadcast (no export exists to load), starts taking tasks only once a publication
reached it, every sync verifies it computes with the trainer's weights, and the run learns."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_elastic import join, members, serving, wait_until
from tests.test_mpi import metrics, mpirun


@pytest.mark.e2e
def test_elastic_rank_with_the_local_engine_joins_by_broadcast_and_the_run_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        "seed=5",
        "validate.validate_before_train=false",
        "validate.eval.validate_freq=0",  # validated at the end
        "logger.backend=[]",
    ]
    run = subprocess.Popen(
        mpirun(3, args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out = tmp_path / "join.out"
    try:
        wait_until(
            "step 2",
            lambda: (
                len([r for r in metrics(run_dir) if "train/reward_mean" in r]) >= 2
                if (run_dir / "metrics.jsonl").exists()
                else False
            ),
            run,
            timeout=300,
        )
        joiner = join(run_dir, out)
        joined = wait_until("the joiner serving", lambda: serving(run_dir, joiner.pid), run)
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stdout[-2000:] + stderr[-3000:]
        assert joiner.wait(60) == 0, out.read_text()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert members(run_dir)[joined["rank"]]["state"] == "ended"
    rows = metrics(run_dir)
    assert max(r.get("rollout/live_ranks", 0) for r in rows) == 2
    syncs = [r for r in rows if "weight_sync/seconds" in r]
    assert syncs and all(r["weight_sync/bytes"] > 0 for r in syncs)  # broadcasts, not reloads
    assert all(r["weight_sync/verify_max_abs_diff"] <= 1e-4 for r in syncs)
    log = (run_dir / "train.log").read_text()
    assert re.search(r"weight version \d+ verified on 2 engine\(s\)", log)  # the joiner's engine too
    assert not (run_dir / "weights").exists()
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert val and val[-1] >= 0.8, val
