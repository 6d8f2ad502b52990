"""Rewards that exit, kill their thread or leave processes behind: the run's reward threads carry on.

A reward's ``sys.exit()`` used to end its pool thread, the call was reported as a timeout, and after
``4 * reward_threads`` such calls the reward was never called again (every later sample scored 0);
its ``os._exit(0)`` ended the run with exit status 0, and the processes it started outlived the run.
Real threads, real processes, nothing mocked but the one escape path no reward can reach any more.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.rewards.loader import as_reward
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS, RewardRunner
from tests.conftest import run_train

KEY = "rollout_worker.reward_fn"
TASK = {"prompt": "p", "answer": "1"}


def _argparse_exit() -> None:
    argparse.ArgumentParser(prog="scorer").parse_args(["--no-such-flag"])


def _keyboard_interrupt() -> None:
    raise KeyboardInterrupt


EXITS = {
    "sys.exit": lambda: sys.exit(),
    "exit": lambda: exit(3),
    "argparse": _argparse_exit,
    "KeyboardInterrupt": _keyboard_interrupt,
    "os._exit": lambda: os._exit(0),
}


@pytest.mark.parametrize("how", sorted(EXITS))
def test_a_reward_exiting_every_other_call_is_an_error_and_no_thread_is_lost(how: str) -> None:
    """Five times as many exits as ``4 * num_threads``: each one an error (not a timeout), every other
    call scored, the pool as big as it started."""
    calls: list[int] = []

    def half_exit(task: dict[str, Any], response: str) -> float:
        calls.append(int(response))
        if int(response) % 2:
            EXITS[how]()
        return 1.0

    runner = RewardRunner(as_reward(half_exit, KEY), timeout_s=5.0, num_threads=2)
    try:
        n = 2 * 5 * 4 * runner.num_threads
        results = [f.result(timeout=30) for f in runner.submit_many([(TASK, str(i)) for i in range(n)])]
        assert [r["reward"] for r in results] == [float(i % 2 == 0) for i in range(n)]
        assert [r[ERRORS] for r in results] == [float(i % 2) for i in range(n)]
        assert sum(r[TIMEOUTS] for r in results) == 0
        assert (runner.num_errors, runner.num_timeouts) == (n // 2, 0)
        assert sorted(calls) == list(range(n))  # the reward was called every time
        assert runner.score(TASK, "0")["reward"] == 1.0  # and still is
        assert len(runner._live) == 2 and not runner._abandoned
        assert all(w.thread is not None and w.thread.is_alive() for w in runner._live)
        assert runner.first_error is not None and (
            "Exit" in runner.first_error or "Interrupt" in runner.first_error
        )
    finally:
        runner.close()


def test_os_exit_in_a_reward_names_itself_and_a_forked_child_still_exits() -> None:
    def forks_then_exits(task: dict[str, Any], response: str) -> float:
        pid = os.fork()
        if pid == 0:  # the child: its os._exit is the real one (another pid)
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        if response == "exit":
            os._exit(0)
        return float(os.waitstatus_to_exitcode(status))

    runner = RewardRunner(as_reward(forks_then_exits, KEY), timeout_s=5.0, num_threads=1)
    try:
        assert runner.score(TASK, "child")["reward"] == 7.0
        failed = runner.score(TASK, "exit")
        assert (failed["reward"], failed[ERRORS], failed[TIMEOUTS]) == (0.0, 1.0, 0.0)
        assert runner.first_error is not None and "called os._exit(0)" in runner.first_error
    finally:
        runner.close()
    # off a reward call, os._exit is untouched: a thread of this process that is no reward's exits
    script = "from nexrl_hpc.rewards import containment\ncontainment.install_exit_guard()\nimport os\nos._exit(5)\n"
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 5


def test_a_thread_that_dies_anyway_is_replaced_and_its_call_is_an_error() -> None:
    """The last line of defence: an exception out of the pool thread's own code (here: the call
    itself replaced by one that raises past every handler)."""
    runner = RewardRunner(as_reward(lambda task, response: 1.0, KEY), timeout_s=0.3, num_threads=1)
    real_call = runner._call
    deaths = iter([SystemExit("gone")] * 6)

    def dying_call(job: Any) -> Any:
        exc = next(deaths, None)
        if exc is not None:
            raise exc
        return real_call(job)

    runner._call = dying_call  # type: ignore[method-assign]
    try:
        results = [f.result(timeout=10) for f in runner.submit_many([(TASK, "x")] * 8)]
        assert [r[ERRORS] for r in results] == [1.0] * 6 + [0.0] * 2
        assert [r["reward"] for r in results] == [0.0] * 6 + [1.0] * 2
        assert sum(r[TIMEOUTS] for r in results) == 0
        time.sleep(0.5)  # past the deadline: a dead thread's call is not answered again as a timeout
        assert (runner.num_errors, runner.num_timeouts) == (6, 0)
        assert (
            len(runner._live) == 1
            and runner._live[0].thread is not None
            and runner._live[0].thread.is_alive()
        )
    finally:
        runner.close()


def _gone(pid: int) -> bool:
    """Exited (a zombie whose parent has not reaped it yet counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="children are listed per thread on Linux")
def test_processes_a_reward_starts_are_reaped_when_its_call_ends() -> None:
    started: list[int] = []
    other = subprocess.Popen(["sleep", "60"])  # another thread's child: not the reward's to kill

    def spawns(task: dict[str, Any], response: str) -> float:
        started.append(subprocess.Popen(["sleep", "600"]).pid)
        started.append(subprocess.Popen(["sleep", "600"], start_new_session=True).pid)
        shell = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        assert shell.stdout is not None
        started.extend([shell.pid, int(shell.stdout.readline())])  # and its grandchild
        return 1.0

    runner = RewardRunner(as_reward(spawns, KEY), timeout_s=5.0, num_threads=2)
    try:
        results = [f.result(timeout=30) for f in runner.submit_many([(TASK, "x")] * 8)]
        assert all(r["reward"] == 1.0 for r in results)
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in started):
            assert time.monotonic() < deadline, [pid for pid in started if not _gone(pid)]
            time.sleep(0.05)
        assert len(started) == 32 and other.poll() is None
    finally:
        runner.close()
        other.kill()
        other.wait()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="children are listed per thread on Linux")
def test_close_reaps_what_a_hung_call_started() -> None:
    started: list[int] = []
    release = threading.Event()

    def hangs(task: dict[str, Any], response: str) -> float:
        started.append(subprocess.Popen(["sleep", "600"]).pid)
        release.wait(30)
        return 1.0

    runner = RewardRunner(as_reward(hangs, KEY), timeout_s=0.2, num_threads=1)
    try:
        assert runner.score(TASK, "x")[TIMEOUTS] == 1.0
        assert len(started) == 1 and not _gone(started[0])
    finally:
        runner.close()
        release.set()
    deadline = time.monotonic() + 5
    while not _gone(started[0]):
        assert time.monotonic() < deadline
        time.sleep(0.05)


EXITING_REWARD = """
import os, subprocess

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["SLEEPS_FILE"], "a") as f:
        f.write(f"{subprocess.Popen(['sleep', '600']).pid}\\n")
    os._exit(0)
"""


@pytest.mark.e2e
def test_a_run_whose_reward_calls_os_exit_fails_and_leaves_no_process(tmp_path: Path) -> None:
    """Was: rc 0 at the first reward call, and every ``sleep`` still running after the run."""
    reward = tmp_path / "exiting.py"
    reward.write_text(EXITING_REWARD)
    sleeps = tmp_path / "sleeps.txt"
    proc = run_train(
        [
            f"run_dir={tmp_path / 'run'}",
            f"rollout_worker.reward_fn={reward}:compute_score",
            "validate.validate_before_train=false",
            "validate.validate_at_end=false",
            "logger.backend=[]",
            "data.batch_size=4",
            "data.rollout_repeat_n=2",
            "train_worker.total_train_steps=1",
        ],
        env={"SLEEPS_FILE": str(sleeps)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "max_reward_error_frac" in proc.stderr and "called os._exit(0)" in proc.stderr
    pids = [int(line) for line in sleeps.read_text().split()]
    assert len(pids) >= 8 and all(_gone(pid) for pid in pids)
