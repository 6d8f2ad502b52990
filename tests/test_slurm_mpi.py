"""MPI mode under a real Slurm (the dev cluster): srun --mpi=pmi2, and a SIGKILLed rollout rank survived."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from nexrl_hpc.data.loader import JsonlDataLoader
from tests.conftest import REPO, compose_config
from tests.test_mpi import FAST, declared_dead_at, metrics

pytestmark = pytest.mark.e2e


def test_srun_pmi2_killed_rollout_rank_with_continue_loses_and_doubles_nothing(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    steps = 16
    run_dir = tmp_path / "srun"
    args = [
        f"run_dir={run_dir}", f"train_worker.total_train_steps={steps}", "logger.dump_rollouts=true",
        "service.inference_service.backend=fake", "service.inference_service.fake_latency_ms=150",
        "runtime_monitor.exception_handling.policy=continue", "runtime_monitor.health_check.check_interval=1.0",
        "runtime_monitor.health_check.timeout=1.5", "data.batch_size=8", *FAST,
    ]  # fmt: skip
    cmd = [
        "srun",
        "--mpi=pmi2",
        "-N1",
        "-n4",
        "--kill-on-bad-exit=0",
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    ranks_file = run_dir / "logs" / "ranks.json"
    while (
        not ranks_file.exists()
        or not (run_dir / "metrics.jsonl").exists()
        or len([r for r in metrics(run_dir) if "train/reward_mean" in r]) < 3
    ):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks = json.loads(ranks_file.read_text())
    victim = [r for r in ranks if r["group"] == "rollout"][1]
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    when, line = declared_dead_at(run_dir, victim["rank"])
    assert when - killed_at <= 2 * 1.0 + 0.1, line  # within 2x the heartbeat interval
    assert "rollout_worker_1" in line
    assert "last validation" in out or "run dir:" in out  # rank 0 finished the run
    rows = [r for r in metrics(run_dir) if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    cfg = compose_config(["data.batch_size=8"])
    reference = JsonlDataLoader(cfg["data"], data_files=[str(run_dir / "data" / "train.jsonl")])
    per_step = cfg["trajectory_pool"]["batch_size"]
    for step in range(1, steps + 1):
        expected = collections.Counter(
            (t["uid"], t["epoch"]) for t in (reference.get_next_item() for _ in range(per_step))
        )
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            got = collections.Counter(zip([u.decode() for u in f["uid"][()]], f["epoch"][()].tolist()))
        assert got == expected, step
