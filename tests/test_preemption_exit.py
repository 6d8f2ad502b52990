"""A preempted run leaves at once once its checkpoint is complete (modules aborted, not stopped in
order), outside Slurm too: nothing is left running, nothing written is lost, the same command resumes.
(Under Slurm, with the requeue: tests/test_slurm_launcher.py; the time it saves: bench/checkpoint.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launch.status import run_status
from nexrl_hpc.checkpoint.manager import find_latest_checkpoint
from nexrl_hpc.inference.local_server import kill_process_group
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT
from tests.conftest import REPO, run_train
from tests.test_checkpoint_crash import alive

FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]
SERVER_UP = re.compile(r"local inference server up at \S+ \(pid (\d+)\)")


def train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/reward_mean" in r]


def preempt_after(proc: subprocess.Popen, run_dir: Path, step: int, pid_of_rank0: Any) -> None:
    """SIGUSR2 to the controller's process once ``step`` steps are in metrics.jsonl."""
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and len(train_steps(run_dir)) >= step):
        assert proc.poll() is None, "the run ended before it could be preempted"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.1)
    os.kill(pid_of_rank0(), signal.SIGUSR2)


def assert_stopped_for_resume(run_dir: Path, out: str, server_logs: list[Path]) -> int:
    """Exit 3 after a complete checkpoint whose step is the last in metrics.jsonl; every server the
    run started is gone. Returns the checkpoint's step."""
    latest = find_latest_checkpoint(str(run_dir / "checkpoints"))
    assert latest is not None, out[-3000:]
    step = int(latest.rsplit("_", 1)[1])
    assert f"stopped at step {step}" in out, out[-3000:]
    assert train_steps(run_dir) == list(range(1, step + 1))  # flushed, every step once
    pids = [int(m) for log in server_logs for m in SERVER_UP.findall(log.read_text())]
    assert pids, "no inference server pid logged"
    assert not [p for p in pids if alive(p)], f"inference servers left running: {pids}"
    return step


def test_preempted_local_run_aborts_its_server_and_resumes_exactly(tmp_path: Path) -> None:
    run_dir = tmp_path / "local"
    args = [f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=8", *FAST]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    preempt_after(proc, run_dir, 2, lambda: proc.pid)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
    step = assert_stopped_for_resume(run_dir, out, [run_dir / "train.log"])
    assert step < 8
    status = run_status(str(run_dir))  # what launch.status shows
    assert (status["state"], status["exit_code"]) == ("preempted", PREEMPTED_EXIT)
    assert status["reason"] == f"signal SIGUSR2: checkpoint saved at step {step}"
    assert status["last_checkpoint"].endswith(f"global_step_{step}") and status["step"] == step

    again = run_train(args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at step {step}" in (run_dir / "train.log").read_text()
    assert train_steps(run_dir) == list(range(1, 9))
    assert run_status(str(run_dir))["state"] == "finished"


@pytest.mark.e2e
def test_preempted_mpi_run_aborts_every_rank_and_resumes_exactly(tmp_path: Path) -> None:
    """mpirun: every rank aborts and leaves through MPI_Finalize (so mpirun reports the run's 3,
    not a rank it killed); the rollout ranks' servers are gone; the same command resumes."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: install the dev extra (bash scripts/install.sh --dev: mpi4py + mpich)")
    run_dir = tmp_path / "mpi"
    cmd = [
        "mpirun",
        "-n",
        "4",
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
        f"run_dir={run_dir}",
        "seed=3",
        "train_worker.total_train_steps=8",
        *FAST,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def rank0_pid() -> int:
        return json.loads((run_dir / "logs" / "ranks.json").read_text())[0]["pid"]

    try:
        preempt_after(proc, run_dir, 2, rank0_pid)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert not [r["pid"] for r in ranks if alive(r["pid"])]
    rank_logs = [run_dir / "logs" / f"rank_{r['rank']}.log" for r in ranks[1:]]
    for log in rank_logs:
        assert "aborting its modules and leaving (preempted: checkpoint saved)" in log.read_text(), log
    step = assert_stopped_for_resume(run_dir, out, rank_logs)
    assert step < 8

    again = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"resumed at step {step}" in (run_dir / "train.log").read_text()
    assert train_steps(run_dir) == list(range(1, 9))


def test_kill_process_group_ends_a_server_that_ignores_sigterm_and_its_children(tmp_path: Path) -> None:
    """What ``abort`` does to a server: no graceful stop to wait for, children included."""
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    parent, child = (int(p) for p in pids.read_text().split())
    assert alive(parent) and alive(child)
    kill_process_group(server)
    assert server.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while alive(child):  # reparented; its new parent reaps it
        assert time.monotonic() < deadline, "the server's child survived"
        time.sleep(0.05)
    kill_process_group(server)  # already gone: nothing to do, no error
