"""Inside a Slurm job: notice that the allocation is ending, and requeue the job after saving.

Two triggers, one path. Slurm sends the job's ``--signal`` (``preemption.signal``, USR2 by
default) at preemption (``preempt_send_user_signal``), on ``scancel --signal`` and
``launcher.slurm.signal_grace_s`` before the time limit; and the run also watches the job's end
time itself (``preemption.save_before_end_s``) in case the signal is late or missing. Either way
the controller lets the step in flight finish, the train worker saves a checkpoint at that step
boundary (the data loader's state then holds no issued-but-untrained task in sync mode), every
rank stops, and rank 0 requeues the job; the next allocation resumes (``resume.mode=auto``).

SIGTERM is what Slurm sends at the time limit (``KillWait`` before SIGKILL) and on ``scancel``:
inside a Slurm job it is a preemption request like the job's signal (save, exit 3), without the
requeue (a cancelled job must stay cancelled); elsewhere it stops the run in order like SIGINT
(``Terminated``, exit ``TERMINATED_EXIT``). Every process catches these signals from the first line
of its ``main()`` (``catch_signal_early``): one that comes during start-up is remembered, never
fatal, and acted on once the run takes the signals over (rank 0 / local: ``PreemptionWatch.install``;
other ranks ignore them: rank 0 decides for the job).
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
TERMINATED_EXIT = 128 + signal.SIGTERM  # SIGTERM outside Slurm: stopped in order, as a shell reports it
# what a process catches from its first line: every preemption.signal a config may name but INT
# (SIGINT is Python's KeyboardInterrupt until the run takes it over), and SIGTERM
_EARLY_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
_early: set[int] = set()  # signals that came before the run took them over
_early_lock = threading.Lock()


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a Slurm job: the run stops in order, as on SIGINT (raised in the main thread)."""


def under_slurm() -> bool:
    """Inside a Slurm job: SIGTERM is the scheduler ending the allocation, not a user's stop."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def _remember(signum: int, frame: Any) -> None:
    with _early_lock:
        _early.add(signum)


def catch_signal_early(cfg: PreemptionConfig | None = None) -> None:
    """From a process's first line: the preemption signals and SIGTERM during start-up are remembered,
    not fatal (``cfg`` names one more: ``preemption.signal=INT``)."""
    extra = (getattr(signal, f"SIG{cfg['signal']}"),) if cfg is not None else ()
    for sig in {*_EARLY_SIGNALS, *extra}:
        signal.signal(sig, _remember)


def _took_early(sig: int) -> bool:
    """Whether ``sig`` came during start-up (forgotten once asked)."""
    with _early_lock:
        came = sig in _early
        _early.discard(sig)
    return came


def _release_other_early_signals(keep: set[int]) -> None:
    """Signals caught early that the run does not use go back to their default action."""
    for sig in _EARLY_SIGNALS:
        if sig not in keep and signal.getsignal(sig) is _remember:
            signal.signal(sig, signal.SIG_DFL)
            if _took_early(sig):
                logger.warning("signal %s during start-up ignored (not preemption.signal)", sig.name)


def _raise_terminated(signum: int, frame: Any) -> None:
    """SIGTERM outside Slurm: the first one stops the run in order; later ones (during that stop,
    which ``runtime_monitor.stop_timeout_s`` bounds) are only logged."""
    signal.signal(signal.SIGTERM, lambda *_: logger.warning("SIGTERM again: the run is already stopping"))
    raise Terminated("terminated (SIGTERM)")


class PreemptionWatch:
    def __init__(self, cfg: PreemptionConfig) -> None:
        self._cfg = cfg
        self._event = threading.Event()
        self.reason = ""
        self.job_id = os.environ.get("SLURM_JOB_ID")
        self._deadline: float | None = None
        self.requeued: bool | None = None
        self._previous: dict[int, Any] = {}  # the handlers install() replaced
        self._may_requeue = True  # False: stopped on SIGTERM (never requeued)

    def install(self) -> None:
        """Take over the signals (rank 0 or local mode; the main thread) and read the job's end
        time. SIGTERM: a preemption request in a Slurm job, else ``Terminated`` (raised here when
        it came during start-up)."""
        sig = getattr(signal, f"SIG{self._cfg['signal']}")
        self._previous = {s: signal.getsignal(s) for s in (sig, signal.SIGTERM)}
        signal.signal(sig, self._on_signal)
        if sig != signal.SIGTERM:
            signal.signal(signal.SIGTERM, self._on_sigterm if under_slurm() else _raise_terminated)
        _release_other_early_signals({sig, signal.SIGTERM})
        for early in sorted({sig, signal.SIGTERM}):
            if _took_early(early):
                if early == sig:
                    self.request(f"signal {signal.Signals(early).name} during start-up")
                elif under_slurm():
                    self.request("signal SIGTERM during start-up", requeue=False)
                else:
                    _raise_terminated(early, None)
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

    def uninstall(self) -> None:
        """The run is over: the handlers it replaced are back (a run started from Python)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def stopping(self) -> None:
        """The run is stopping (bounded by ``stop_timeout_s``): a SIGTERM now is only logged, so that
        the stop, and ``status.json``'s end, are not cut short."""
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, lambda *_: logger.warning("SIGTERM: the run is already stopping"))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(f"signal {signal.Signals(signum).name}")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM in a Slurm job (the time limit, ``scancel``): save and stop, but never requeue:
        a cancelled job must stay cancelled (the job's own signal is the one that requeues)."""
        self.request("signal SIGTERM", requeue=False)

    def request(self, reason: str, requeue: bool = True) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._may_requeue = requeue
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
        if not self.job_id or not self._cfg["requeue"] or not self._may_requeue:
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
    """Ranks other than 0 get the job's signal and SIGTERM too (Slurm signals every task; mpirun
    forwards what it gets): rank 0 decides for the job and tells them, they must not die of it."""
    sig = getattr(signal, f"SIG{cfg['signal']}")
    for ignored in (sig, signal.SIGTERM):
        # a handler, not SIG_IGN: an ignored signal stays ignored in the processes a rank starts
        # (its inference server must still stop on SIGTERM); a caught one is reset by exec
        signal.signal(ignored, _ignore)
        _took_early(ignored)
    _release_other_early_signals({sig, signal.SIGTERM})


def _ignore(signum: int, frame: Any) -> None:
    logger.info("signal %s ignored: rank 0 decides for the job", signal.Signals(signum).name)


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
