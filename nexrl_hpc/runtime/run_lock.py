"""One writer per run dir: ``<run_dir>/run.lock``, held for the run's life by the process that runs
the controller (local mode, rank 0 in mpi mode, ``nexrl_hpc.train``).

Why a lock file created with ``O_CREAT | O_EXCL`` and not ``flock``/``fcntl``: the run dir lives
on the cluster's parallel filesystem, and whether a byte-range or ``flock`` lock is seen by other
nodes there depends on how it is mounted (Lustre: ``flock`` is cluster-wide, ``localflock`` only on
the node that took it, ``noflock`` refuses; NFS: through lockd, lost with a client's crash;
BeeGFS/GPFS: their own settings) — a lock that silently holds only on one node is worse than none.
An exclusive create is atomic on each of them (NFSv3 and later, Lustre, GPFS, BeeGFS) and leaves a
file that says who holds it: host, pid (with its start time, so a reused pid is not taken for the
holder), Slurm job id and restart count.

What an existing lock means (``verdict``):

- its holder is on this host: alive (that pid, that start time) or gone — a lock left by a killed
  process is taken over at once;
- on another host no process can be looked at: the holder refreshes the file's time every
  ``HEARTBEAT_S``; one not refreshed for ``STALE_AFTER_S`` is gone — by the clocks once it was
  also watched not to change for two heartbeats (a node whose clock runs ahead does not take a live
  lock), or as watched from here alone;
- a holder of the same Slurm job (a requeued job racing its old self, or a second start) is waited
  for, up to ``REQUEUE_WAIT_S``, and taken over only once it is gone; any other live holder is
  refused at once (``RunDirBusy``: the launch exits 2 naming it).

A lock is taken over by renaming it aside first (one contender's rename wins) and checking that what
was moved is the lock judged stale. Threads: ``RunDirLock``'s heartbeat thread touches the file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 10.0  # the holder refreshes the lock file's time this often
STALE_AFTER_S = 60.0  # a lock of another host not refreshed for this long: its holder is gone
REQUEUE_WAIT_S = STALE_AFTER_S + 2 * HEARTBEAT_S  # a holder of the same Slurm job is waited for this long
POLL_S = 1.0


@dataclass(frozen=True)
class Holder:
    """Who holds a run dir (the lock file's content)."""

    host: str
    pid: int
    started: str  # the pid's start time in clock ticks since boot ("" where /proc has none)
    job_id: str | None  # SLURM_JOB_ID
    restart: str | None  # SLURM_RESTART_COUNT
    since: float  # time.time() when taken

    def describe(self) -> str:
        job = f"Slurm job {self.job_id}" if self.job_id else "not a Slurm job"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"host {self.host}, pid {self.pid}, {job} (since {when})"


class RunDirBusy(RuntimeError):
    """Another live run holds the run dir."""

    def __init__(self, run_dir: str, holder: Holder | None):
        who = holder.describe() if holder else "a holder whose lock file cannot be read"
        super().__init__(
            f"run dir {run_dir} is in use by another run: {who}; wait for it to end, or choose another "
            f"run_dir (the lock: {os.path.join(run_dir, LOCK_NAME)})"
        )
        self.holder = holder


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields from the third (state) on; empty if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_start(pid: int) -> str:
    """``pid``'s start time (clock ticks since boot, /proc/<pid>/stat field 22), "" if unknown."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""


def this_process() -> Holder:
    return Holder(
        socket.gethostname(),
        os.getpid(),
        process_start(os.getpid()),
        os.environ.get("SLURM_JOB_ID"),
        os.environ.get("SLURM_RESTART_COUNT"),
        time.time(),
    )


def pid_alive(pid: int, started: str) -> bool:
    """Whether ``pid`` on this host is the process that took the lock (not one that reused the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped: holds nothing
        return False
    now = fields[19] if len(fields) > 19 else ""
    return not (started and now and now != started)


class RunDirLock:
    """``acquire`` (or ``RunDirBusy``) before the run writes anything; ``release`` when it ends."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.me = this_process()
        self._raw = json.dumps(asdict(self.me)).encode()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._watched: dict[bytes, tuple[float, float]] = {}  # lock content -> (mtime seen, since when)

    def acquire(self, wait_s: float = REQUEUE_WAIT_S) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while not self._create():
            raw, mtime = self._read()
            if raw is None:  # released meanwhile
                continue
            holder = _parse(raw)
            verdict = self.verdict(holder, raw, mtime)
            if verdict == "gone":
                logger.warning(
                    "run dir %s: taking over the lock of a run that is gone (%s)", self.run_dir, _who(holder)
                )
                self._take_over(raw)
                continue
            if verdict == "wait" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                continue
            raise RunDirBusy(self.run_dir, holder)
        self._heartbeat = threading.Thread(target=self._beat, name="run-dir-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Stop the heartbeat; remove the lock if it is still this process's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5)
            self._heartbeat = None
        raw, _ = self._read()
        if raw == self._raw:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def verdict(self, holder: Holder | None, raw: bytes, mtime: float) -> str:
        """Take the lock over ("gone"), wait for its holder ("wait": the same Slurm job's old self,
        or a lock still being watched) or refuse ("alive")."""
        if holder is not None and holder.host == self.me.host:
            stale: bool | None = not pid_alive(holder.pid, holder.started)
        else:  # another host's, or half-written or foreign content: only its age tells
            stale = self._stale(raw, mtime)
        if stale:
            return "gone"
        if stale is None or holder is None:  # still watching it
            return "wait"
        same_job = holder.job_id is not None and holder.job_id == self.me.job_id
        return "wait" if same_job and (holder.host, holder.pid) != (self.me.host, self.me.pid) else "alive"

    def _stale(self, raw: bytes, mtime: float) -> bool | None:
        """Not refreshed for ``STALE_AFTER_S``: True; refreshed: False; None: old by the clocks,
        but not yet watched unchanged for two heartbeats."""
        seen, since = self._watched.get(raw, (mtime, time.monotonic()))
        if seen != mtime:
            since = time.monotonic()
        self._watched[raw] = (mtime, since)
        watched = time.monotonic() - since
        if watched > STALE_AFTER_S:
            return True
        if time.time() - mtime > STALE_AFTER_S:
            return True if watched > 2 * HEARTBEAT_S else None
        return False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _read(self) -> tuple[bytes | None, float]:
        try:
            with open(self.path, "rb") as f:
                return f.read(4096), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None, 0.0

    def _take_over(self, judged: bytes) -> None:
        """Move the stale lock aside (one contender's rename wins); put back one that is not it."""
        aside = f"{self.path}.stale.{self.me.host}.{self.me.pid}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as f:
            moved = f.read(4096)
        if moved != judged:  # another contender's fresh lock: back where it was
            os.rename(aside, self.path)
            return
        os.unlink(aside)

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            raw, _ = self._read()
            if raw != self._raw:
                if not warned:
                    logger.error("run dir %s: the lock is no longer this run's (%s)", self.run_dir, raw)
                    warned = True
                continue
            try:
                os.utime(self.path)
            except OSError as exc:
                logger.warning("run dir %s: could not refresh the lock: %s", self.run_dir, exc)


_claimed: dict[str, RunDirLock] = {}  # run dir -> this process's lock on it


def claim_run_dir(run_dir: str) -> str | None:
    """Take ``run_dir``'s lock for this process (kept until ``release_run_dir``; claiming it again
    is a no-op); None, or why not (naming the holder)."""
    path = os.path.abspath(run_dir)
    if path in _claimed:
        return None
    lock = RunDirLock(path)
    try:
        lock.acquire()
    except RunDirBusy as exc:
        logger.error("%s", exc)
        return str(exc)
    _claimed[path] = lock
    return None


def release_run_dir(run_dir: str) -> None:
    lock = _claimed.pop(os.path.abspath(run_dir), None)
    if lock is not None:
        lock.release()


def run_alone(run_dir: str, run: Callable[[], int]) -> int:
    """``run()`` holding ``run_dir``'s lock (taken here, or earlier by this process: mpi rank 0),
    released at its end; 2 (the holder named on stderr) when another run holds it."""
    refusal = claim_run_dir(run_dir)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        return 2
    try:
        return run()
    finally:
        release_run_dir(run_dir)


def _parse(raw: bytes) -> Holder | None:
    try:
        fields = json.loads(raw)
        return Holder(
            str(fields["host"]),
            int(fields["pid"]),
            str(fields["started"]),
            fields["job_id"],
            fields["restart"],
            float(fields["since"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _who(holder: Holder | None) -> str:
    return holder.describe() if holder else "unreadable lock"
