"""Inside a Slurm job: notice that the allocation is ending, and requeue the job after saving.

Two triggers, one path. Slurm sends the job's ``--signal`` (``preemption.signal``, USR2 by
default) at preemption (``preempt_send_user_signal``), on ``scancel --signal`` and
``launcher.slurm.signal_grace_s`` before the time limit; and the run also watches the job's end
time itself (``preemption.save_before_end_s``) in case the signal is late or missing. Either way
the controller lets the step in flight finish, the train worker saves a checkpoint at that step
boundary (the data loader's state then holds no issued-but-untrained task in sync mode), every
rank stops, and rank 0 requeues the job; the next allocation resumes (``resume.mode=auto``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from datetime import datetime
from typing import Any

from nexrl_hpc.config.schema import PreemptionConfig

logger = logging.getLogger(__name__)
PREEMPTED_EXIT = 3  # the process exit code of a run that stopped at a checkpoint to be resumed


_EARLY = threading.Event()  # the signal came before the controller took it over


def catch_signal_early(cfg: PreemptionConfig) -> None:
    """From a task's first line: a signal during start-up is remembered, not fatal."""
    signal.signal(getattr(signal, f"SIG{cfg['signal']}"), lambda *_: _EARLY.set())


class PreemptionWatch:
    def __init__(self, cfg: PreemptionConfig) -> None:
        self._cfg = cfg
        self._event = threading.Event()
        self.reason = ""
        self.job_id = os.environ.get("SLURM_JOB_ID")
        self._deadline: float | None = None
        self.requeued: bool | None = None

    def install(self) -> None:
        """Take over the signal (rank 0 only; the main thread) and read the job's end time."""
        sig = getattr(signal, f"SIG{self._cfg['signal']}")
        signal.signal(sig, self._on_signal)
        if _EARLY.is_set():
            self.request(f"signal {sig.name} during start-up")
        margin = self._cfg["save_before_end_s"]
        if self.job_id and margin > 0:
            end = slurm_job_end_time(self.job_id)
            if end is not None:
                self._deadline = end - margin
                logger.info(
                    "job %s ends at %s: saving and requeueing %ds before",
                    self.job_id,
                    datetime.fromtimestamp(end).isoformat(timespec="seconds"),
                    margin,
                )

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(f"signal {signal.Signals(signum).name}")

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def requested(self) -> bool:
        if not self._event.is_set() and self._deadline is not None and time.time() >= self._deadline:
            self.request("the job's end time is near (preemption.save_before_end_s)")
        return self._event.is_set()

    def requeue(self) -> bool:
        """Requeue this Slurm job (the run resumes in the next allocation); False outside Slurm.
        Once is enough: later calls answer what the first did."""
        if self.requeued is not None:
            return self.requeued
        self.requeued = False
        if not self.job_id or not self._cfg["requeue"]:
            return False
        proc = subprocess.run(
            ["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=60
        )
        if proc.returncode != 0:  # e.g. Slurm is already requeueing it (real preemption)
            logger.warning("scontrol requeue %s: %s", self.job_id, proc.stderr.strip())
            return False
        logger.info("job %s requeued", self.job_id)
        self.requeued = True
        return True


def ignore_preemption_signal(cfg: PreemptionConfig) -> None:
    """Ranks other than 0 get the job's signal too: rank 0 decides, they must not die of it."""
    signal.signal(getattr(signal, f"SIG{cfg['signal']}"), signal.SIG_IGN)


def slurm_job_end_time(job_id: str) -> float | None:
    """The job's EndTime (epoch seconds) from scontrol; None when unknown or unlimited."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field in out.split():
        if field.startswith("EndTime="):
            value = field.removeprefix("EndTime=")
            try:
                return datetime.fromisoformat(value).timestamp()
            except ValueError:  # "Unknown" or "NONE"
                return None
    return None
