"""kill -9 of every process of a run while a checkpoint is being written: the same command started
again resumes from the previous complete checkpoint, logs every step once and finishes.

The window is hit without any hook in the code: the test polls the checkpoint folder for the temp
dir of the targeted save (``.tmp-global_step_<N>-<pid>``, created before anything is written and
renamed away only after every file is fsynced) and SIGKILLs every process of the run (the launcher,
mpirun's proxy, every rank) the moment it appears. If the kill lands after the save committed anyway (the save of the tiny model takes ~30 ms),
the interrupted run is resumed and the next save is the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nexrl_hpc.checkpoint.manager import read_state_h5
from tests.conftest import REPO
from tests.test_mpi import failure_run_args, metrics, mpirun

pytestmark = pytest.mark.e2e

STEPS, SAVE_FREQ = 6, 2


def run_args(run_dir: Path) -> list[str]:
    return [
        *failure_run_args(run_dir, "stop_on_error", STEPS),
        "service.inference_service.fake_latency_ms=0",
        "logger.dump_rollouts=false",
        f"train_worker.save_freq={SAVE_FREQ}",
        "train_worker.max_ckpt_to_keep=1",
    ]


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped, e.g. under a PID 1 that does not reap, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants. Under mpich, hydra's proxy and every rank run in sessions
    of their own, so killing mpirun's process group would not reach them: each one is killed."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_during_save(
    proc: subprocess.Popen, ckpt: Path, step: int, timeout: float = 300
) -> tuple[str | None, list[int]]:
    """SIGKILL every process of the run the moment the temp dir of step ``step``'s save appears.
    Returns what the kill left of that save (the temp dir's name, or the step dir without COMPLETE;
    None if the save had committed by the time the processes were gone) and the killed pids."""
    prefix = f".tmp-global_step_{step}-"
    deadline = time.monotonic() + timeout

    def wait(cond: Callable[[], bool], what: str, poll_s: float) -> None:
        while not cond():
            assert proc.poll() is None, f"the run ended before {what}"
            assert time.monotonic() < deadline, f"{what} did not happen"
            time.sleep(poll_s)

    # every process is up once the first checkpoint is saved: take the tree, then watch closely
    wait(lambda: (ckpt / f"global_step_{SAVE_FREQ}" / "COMPLETE").exists(), "the first checkpoint", 0.05)
    members = process_tree(proc.pid)

    def started() -> bool:
        try:
            return any(name.startswith(prefix) for name in os.listdir(ckpt))
        except FileNotFoundError:
            return False

    wait(started, f"step {step}'s save", 0.0005)
    for pid in reversed(members):  # ranks first, mpirun last
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in members):
        assert time.monotonic() < deadline, [pid for pid in members if alive(pid)]
        time.sleep(0.05)
    final = ckpt / f"global_step_{step}"
    if (final / "COMPLETE").exists():
        return None, members
    left = [n for n in os.listdir(ckpt) if n.startswith(prefix)]
    return (left[0] if left else final.name), members


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("mode", ["local", "mpi"])
def test_kill_9_of_every_rank_during_a_checkpoint_write_resumes_from_the_previous_one(
    tmp_path: Path, mode: str
) -> None:
    run_dir = tmp_path / mode
    ckpt = run_dir / "checkpoints"
    args = run_args(run_dir)
    cmd = mpirun(4, args) if mode == "mpi" else [sys.executable, "-m", "launch.train", *args]
    log = tmp_path / "output.log"

    # a save after the first checkpoint is the target; a missed window moves on to the next save
    partial, target, starts = None, 2 * SAVE_FREQ, 0
    while partial is None:
        assert target <= STEPS, "no kill landed inside a checkpoint write"
        proc = start(cmd, log)
        starts += 1
        partial, killed = kill_during_save(proc, ckpt, target)
        if mode == "mpi":  # every rank was among the SIGKILLed processes
            ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
            assert len(ranks) == 4 and {r["pid"] for r in ranks} <= set(killed), (ranks, killed)
        target += SAVE_FREQ
    target -= SAVE_FREQ
    previous = target - SAVE_FREQ
    assert (ckpt / f"global_step_{previous}" / "COMPLETE").exists()
    assert not (ckpt / f"global_step_{target}" / "COMPLETE").exists()
    # the killed run had logged the step whose save it died in (the line comes before the save)
    assert target in [r["step"] for r in metrics(run_dir) if "train/reward_mean" in r]

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    train_log = (run_dir / "train.log").read_text()
    assert train_log.count(f"resumed at step {previous} from") == 1, train_log[-3000:]
    assert f"resumed at step {target} " not in train_log

    # every step exactly once: the lines after the resumed checkpoint were dropped and redone
    assert [r["step"] for r in metrics(run_dir) if "train/reward_mean" in r] == list(range(1, STEPS + 1))
    # the partial save is gone, only the newest complete checkpoint is kept (max_ckpt_to_keep=1)
    assert sorted(os.listdir(ckpt)) == [f"global_step_{STEPS}", "latest"], (partial, os.listdir(ckpt))
    assert (ckpt / "latest").read_text().strip() == f"global_step_{STEPS}"
    assert read_state_h5(str(ckpt / f"global_step_{STEPS}" / "state.h5"))["global_step"] == STEPS
    print(f"{mode}: killed inside step {target}'s save (left {partial}) after {starts} start(s)")
