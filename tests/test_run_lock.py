"""One writer per run dir: a second run on a run dir a live run holds exits 2 naming the holder;
locks of runs that are gone are taken over; a requeued Slurm job waits for its old self.

Real processes hold the locks (a second ``python -m launch.train``, ``python -c``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from nexrl_hpc.runtime import run_lock
from nexrl_hpc.runtime.run_lock import LOCK_NAME, RunDirBusy, RunDirLock, this_process
from tests.conftest import REPO

HOLD = (
    "import sys, time\n"
    "from nexrl_hpc.runtime.run_lock import RunDirLock\n"
    "lock = RunDirLock(sys.argv[1]); lock.acquire(); print('held', flush=True)\n"
    "sys.stdin.read(); lock.release()\n"
)


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(base, PYTHONPATH=str(REPO), **extra)


def holder_process(run_dir: Path, **extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        cwd=REPO,
        env=env(**extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def write_lock(run_dir: Path, age_s: float = 0.0, **fields: object) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = replace(this_process(), **fields)  # type: ignore[arg-type]
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps(asdict(holder)))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_goes_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = holder_process(run_dir, SLURM_JOB_ID="4242")
    try:
        lock = RunDirLock(str(run_dir))
        with pytest.raises(RunDirBusy) as err:
            lock.acquire()
        text = str(err.value)
        assert (
            f"run dir {run_dir} is in use by another run: host {socket.gethostname()}, pid {first.pid}, "
            in text
        )
        assert "Slurm job 4242 (since " in text
    finally:
        first.communicate("", timeout=30)
    assert not (run_dir / LOCK_NAME).exists()  # released at the end
    lock.acquire()
    lock.release()


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_lock(tmp_path / "a", pid=dead.pid, started="1")
    write_lock(tmp_path / "b", pid=os.getppid(), started="1")  # a live pid, but not the one that locked
    for name in ("a", "b"):
        lock = RunDirLock(str(tmp_path / name))
        lock.acquire(wait_s=0)
        assert json.loads((tmp_path / name / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()


def test_another_hosts_lock_holds_while_refreshed_and_goes_once_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.5)
    write_lock(tmp_path / "fresh", host="node-other", pid=1, job_id="77")
    with pytest.raises(RunDirBusy, match="host node-other, pid 1, Slurm job 77"):
        RunDirLock(str(tmp_path / "fresh")).acquire(wait_s=30)  # another job: refused at once
    write_lock(tmp_path / "stale", age_s=run_lock.STALE_AFTER_S + 5, host="node-other", pid=1, job_id="77")
    with pytest.raises(RunDirBusy):  # old by the clocks, but not yet watched for two heartbeats
        RunDirLock(str(tmp_path / "stale")).acquire(wait_s=0)
    t0 = time.monotonic()
    lock = RunDirLock(str(tmp_path / "stale"))
    lock.acquire(wait_s=30)
    assert 2 * run_lock.HEARTBEAT_S <= time.monotonic() - t0 < 10
    lock.release()


def test_a_requeued_job_waits_for_its_old_self_and_takes_over_once_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    old = holder_process(run_dir, SLURM_JOB_ID="555", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy, match="Slurm job 555"):  # still there after the wait: refused
        RunDirLock(str(run_dir)).acquire(wait_s=1.5)
    t0 = time.monotonic()
    killer = threading.Timer(2.0, old.kill)  # SIGKILL: its lock is left behind
    killer.start()
    lock = RunDirLock(str(run_dir))
    lock.acquire(wait_s=30)  # the old one is killed meanwhile: taken over then (not reaped: a zombie)
    assert time.monotonic() - t0 >= 1.5
    assert json.loads((run_dir / LOCK_NAME).read_text())["restart"] == "1"
    lock.release()
    killer.join()
    old.wait()
    # another job on the same run dir is not waited for
    other = holder_process(run_dir, SLURM_JOB_ID="556")
    try:
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy, match="Slurm job 556"):
            RunDirLock(str(run_dir)).acquire(wait_s=30)
        assert time.monotonic() - t0 < 5
    finally:
        other.communicate("", timeout=30)


FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


@pytest.mark.e2e
def test_two_runs_on_one_run_dir_the_second_exits_2_naming_the_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "train_worker.total_train_steps=5000", *FAST]
    # stopped by SIGINT below: long enough to be still training when the second run has been refused on a busy machine
    first = subprocess.Popen(
        [sys.executable, "-m", "launch.train", *args],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run took no lock"
            time.sleep(0.2)
        second = subprocess.run(
            [sys.executable, "-m", "launch.train", *args],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            f"error: run dir {run_dir} is in use by another run: host {socket.gethostname()}, pid {first.pid}, "
            "not a Slurm job" in second.stderr
        )
        assert first.poll() is None  # the first goes on
    finally:
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out[-3000:]
    assert not (run_dir / LOCK_NAME).exists()  # released on the way out


@pytest.mark.e2e
def test_an_mpi_job_on_a_held_run_dir_exits_2_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 claims the run dir before the bootstrap and tells every rank: the job's code is 2."""
    run_dir = tmp_path / "run"
    holder = holder_process(run_dir, SLURM_JOB_ID="9001")
    try:
        job = subprocess.run(
            [
                "mpirun",
                "-n",
                "3",
                sys.executable,
                "-m",
                "launch.train",
                "launch_mode=mpi",
                f"run_dir={run_dir}",
                *FAST,
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.communicate("", timeout=30)
    assert job.returncode == 2, job.stderr[-3000:]
    assert (
        f"is in use by another run: host {socket.gethostname()}, pid {holder.pid}, Slurm job 9001"
        in job.stderr
    )
    assert not (run_dir / "logs").exists()  # refused before any rank wrote a log there
