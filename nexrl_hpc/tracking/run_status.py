"""``<run_dir>/status.json``: how the run stands, written by the run itself (rank 0's controller).

Why a file: a run that fails must say why where its outputs are, and ``launch.status`` must tell a
failed run from a fresh one without the process or its logs. The run writes ``running`` (pid,
host, Slurm job id, start time) when it starts and its end (``finished`` / ``failed`` /
``preempted``, exit code, reason, end time) when it ends, each time atomically. A process killed
outright (SIGKILL, out of memory, a node lost) writes no end: ``describe`` then asks whether the
pid is still alive (same host) and what Slurm says (``sacct``), so such a run still shows as
failed, cancelled or timed out.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT
from nexrl_hpc.types import StrEnum

STATUS_FILE = "status.json"


class RunState(StrEnum):
    """A run's state as ``status.json`` and ``launch.status`` say it (the file holds the string)."""

    RUNNING = "running"
    PENDING = "pending"  # Slurm has not started it (again) yet
    FINISHED = "finished"
    FAILED = "failed"
    PREEMPTED = "preempted"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"  # no status file


# sacct states after which the job's processes are gone, and what the run then is
SLURM_END_STATES = {
    "COMPLETED": RunState.FINISHED,
    "FAILED": RunState.FAILED,
    "OUT_OF_MEMORY": RunState.FAILED,
    "NODE_FAIL": RunState.FAILED,
    "BOOT_FAIL": RunState.FAILED,
    "DEADLINE": RunState.TIMEOUT,
    "TIMEOUT": RunState.TIMEOUT,
    "CANCELLED": RunState.CANCELLED,
    "PREEMPTED": RunState.PREEMPTED,
}
SLURM_WAITING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
ENDED = (RunState.FINISHED, RunState.FAILED, RunState.PREEMPTED)


def state_of(exit_code: int) -> RunState:
    """The run's end state for its process exit code (launch/train.py's codes)."""
    if exit_code == 0:
        return RunState.FINISHED
    return RunState.PREEMPTED if exit_code == PREEMPTED_EXIT else RunState.FAILED


class RunStatus:
    """Writes the run's ``status.json`` (rank 0 only)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, STATUS_FILE)
        self._record: dict[str, Any] = {}

    def started(self) -> None:
        self._record = {
            "state": RunState.RUNNING,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started_at": round(time.time(), 3),
        }
        self._write()

    def ended(self, exit_code: int, reason: str) -> None:
        self._record.update(
            state=state_of(exit_code), exit_code=exit_code, reason=reason, ended_at=round(time.time(), 3)
        )
        self._write()

    def _write(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self._record, f, indent=1)
        os.replace(tmp, self.path)


def read_status(run_dir: str) -> dict[str, Any] | None:
    """The run's status file, or None (none written, or unreadable)."""
    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process of that pid: alive
        return True
    return True


def describe(record: dict[str, Any] | None, slurm_state: str | None) -> dict[str, Any]:
    """The run's state from its status file and (launcher=slurm) the job's sacct state:
    ``{"state", "exit_code", "reason"}``. The run's own record wins when it recorded an end (it
    knows why); Slurm's end state wins when the run was killed before it could write one."""
    own = dict(record or {})
    state = own.get("state")
    out: dict[str, Any] = {
        "state": state or RunState.UNKNOWN,
        "exit_code": own.get("exit_code"),
        "reason": own.get("reason"),
    }
    slurm = (slurm_state or "").split()[0] if slurm_state else None
    if slurm in SLURM_WAITING_STATES:
        if state == RunState.PREEMPTED:
            out["reason"] = f"{own.get('reason')}; requeued, waiting to restart (Slurm {slurm})"
        else:
            out.update(state=RunState.PENDING, reason=f"Slurm {slurm}")
        return out
    if slurm in SLURM_END_STATES:
        if state in ENDED:
            return out
        out.update(
            state=SLURM_END_STATES[slurm], reason=f"Slurm {slurm}: the run ended without recording why"
        )
        return out
    if slurm is not None and slurm not in ("UNKNOWN", "unknown"):  # RUNNING, COMPLETING, ...
        if state in (RunState.FINISHED, RunState.FAILED):  # the run ended; Slurm is tidying up
            return out
        if state != RunState.RUNNING:  # starting, or resuming after a preemption
            again = "; resuming after a preemption" if state == RunState.PREEMPTED else ""
            out.update(state=RunState.RUNNING, exit_code=None, reason=f"Slurm {slurm}{again}")
        return out
    if state is None:
        out["reason"] = "no status.json: the run never started, or predates status files"
    elif (
        state == RunState.RUNNING
        and own.get("host") == socket.gethostname()
        and not _pid_alive(int(own["pid"]))
    ):
        out.update(
            state=RunState.FAILED,
            reason=f"the run's process (pid {own['pid']}) is gone without recording an end: "
            "killed (SIGKILL, out of memory?)",
        )
    return out
