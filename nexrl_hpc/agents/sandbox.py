"""Run untrusted Python (model-written code) in a child process with hard limits.

Why a subprocess and not exec(): a reward or tool call must survive code that loops forever,
allocates without bound, forks without bound, floods its output or phones home. Why a private
filesystem view on top: code running as the job's user could otherwise read the run's keys from a
same-uid ``/proc/<pid>/environ``, rewrite the run's pickles and weights, talk to its servers over
loopback or Unix sockets, and leave files behind in /tmp or /dev/shm. The layers, each exercised by
tests/test_agents_sandbox.py and tests/test_hostile_sandbox.py:

* wall time: after ``wall_time_s`` the parent SIGKILLs the PID namespace's init (the kernel then
  kills every process in the namespace, also ones that left the session) and the session;
* CPU time, address space, file size, open files, core dumps, process count: ``setrlimit`` in the
  child just before it execs the interpreter (a small launcher does this, no ``preexec_fn``);
* namespaces (``unshare``; root creates them directly, other users through a user namespace):
  network (no loopback of the host, no abstract Unix sockets), PID (a private /proc), IPC (no
  System V shared memory that outlives the run), UTS and mount;
* a private root (``pivot_root`` onto a fresh tmpfs): read-only binds of the system directories
  (/usr, /lib*, /bin, /sbin, the dynamic linker's files in /etc) and of the interpreter's prefix;
  a fresh /proc, a minimal /dev, and size-capped tmpfs at /tmp (the working directory) and
  /dev/shm that vanish with the namespace. Nothing else of the host exists in it: no run dir, no
  home, no other users' files, no path-based Unix sockets;
* no privileges: a root caller's code runs as ``unprivileged_uid`` (RLIMIT_NPROC is not enforced
  for uid 0); a non-root caller's code stays uid 0 *inside* its user namespace with every
  capability dropped (bounding set emptied, ``SECBIT_NOROOT`` locked) and ``no_new_privs``;
* a fresh session, an empty environment, ``python -I``, stdio through unlinked temp files.

Isolation is required by default (``require_isolation``): where the machine cannot provide it
(unprivileged user namespaces are often off on HPC nodes) the call raises
``SandboxUnavailableError`` naming the setting, instead of running the code unisolated. With it
off, such a machine runs the code without namespaces (the result says ``isolated=False``).

Not limited: total memory across the code's processes (RLIMIT_AS is per process); the process
count is per uid, so concurrent root-started sandboxes share ``max_processes`` of
``unprivileged_uid``, and a non-root caller's sandbox counts against the job user's processes.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from nexrl_hpc.agents.sandbox_view import (
    DEVICES,
    LAUNCHER,
    SETUP_EXIT,
    SETUP_TAG,
    LaunchPlan,
    SandboxUnavailableError,
    plan_launch,
)

Status = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed"]

REQUIRE_KEY = "rollout_worker.sandbox.require_isolation"


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (the run's are ``rollout_worker.sandbox``, set by ``set_default_limits``)."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    max_open_files: int = 64
    tmp_mb: int = 64  # each of /tmp and /dev/shm (memory-backed)
    require_isolation: bool = True
    unprivileged_uid: int = 65534
    python_executable: str | None = None  # default: this process's interpreter

    def __post_init__(self) -> None:
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "max_output_bytes",
            "max_open_files",
            "tmp_mb",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> SandboxLimits:
        """From the ``rollout_worker.sandbox`` section (every key present: YAML holds the defaults)."""
        return cls(
            wall_time_s=float(cfg["wall_time_s"]),
            cpu_time_s=int(cfg["cpu_time_s"]),
            memory_mb=int(cfg["memory_mb"]),
            max_processes=int(cfg["max_processes"]),
            max_output_bytes=int(cfg["max_output_bytes"]),
            max_open_files=int(cfg["max_open_files"]),
            tmp_mb=int(cfg["tmp_mb"]),
            require_isolation=bool(cfg["require_isolation"]),
            unprivileged_uid=int(cfg["unprivileged_uid"]),
            python_executable=cfg["python_executable"],
        )


_default_limits = SandboxLimits()
_default_lock = threading.Lock()


def set_default_limits(limits: SandboxLimits) -> None:
    """The limits of calls that pass none (the code reward, the python tool): the run's config."""
    global _default_limits
    with _default_lock:
        _default_limits = limits


def default_limits() -> SandboxLimits:
    with _default_lock:
        return _default_limits


@dataclass
class SandboxResult:
    """What happened: ``status`` says why it ended; output is cut at ``max_output_bytes``."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    wall_time_s: float
    isolated: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def error_message(self) -> str:
        """One line for a tool error observation or reward metadata."""
        if self.status == "ok":
            return ""
        tail = self.stderr.strip().splitlines()[-1:] or [""]
        reasons = {
            "timeout": "killed after the wall-time limit",
            "cpu_limit": "killed after the CPU-time limit",
            "memory_limit": "ran out of memory (memory limit)",
            "output_limit": "wrote more output than allowed",
            "killed": f"killed by signal {_signal_of(self.returncode)}",
            "error": f"exited with code {self.returncode}",
        }
        reason, last = reasons[self.status], tail[0].strip()
        return f"{reason}: {last}" if last else reason


@functools.lru_cache(maxsize=8)
def _isolation_problem(python: str, uid: int, euid: int) -> str | None:
    """Why the isolated sandbox cannot run here (None: it can): one trivial run, once per process.

    Kernels, containers and sysctls differ (``kernel.unprivileged_userns_clone``,
    ``user.max_user_namespaces``, a /proc that may not be bound), so the whole setup is tried."""
    limits = SandboxLimits(wall_time_s=30.0, cpu_time_s=10, unprivileged_uid=uid, python_executable=python)
    try:
        plan = plan_launch(limits.unprivileged_uid, python, isolate=True)
    except SandboxUnavailableError as exc:
        return str(exc)
    if not plan.isolated:
        return "; ".join(plan.notes)
    result = _run(plan, "print('ok')\n", "", {}, limits, python)
    if result.returncode == 0 and result.stdout == "ok\n":
        return None
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    return f"the isolated sandbox did not start (exit {result.returncode}): {' / '.join(lines[-3:]) or 'no output'}"


def isolation_problem(limits: SandboxLimits | None = None) -> str | None:
    """Why isolation is unavailable on this machine for these limits, or None; cached."""
    limits = limits or default_limits()
    return _isolation_problem(
        limits.python_executable or sys.executable, limits.unprivileged_uid, os.geteuid()
    )


def check_isolation(limits: SandboxLimits | None = None) -> None:
    """Raise ``SandboxUnavailableError`` when isolation is required and unavailable (a start-up check)."""
    limits = limits or default_limits()
    problem = isolation_problem(limits) if limits.require_isolation else None
    if problem is not None:
        raise SandboxUnavailableError(_unavailable_message(problem))


def _unavailable_message(problem: str) -> str:
    return (
        f"sandbox isolation is required ({REQUIRE_KEY}=true) but this machine cannot provide it: {problem}. "
        "Unprivileged user namespaces must be on (sysctl kernel.unprivileged_userns_clone=1, "
        f"user.max_user_namespaces > 0), or the run must start as root; {REQUIRE_KEY}=false runs "
        "model-written code without isolation (it can then read and change what the job's user can)"
    )


def _read_capped(f: IO[bytes], cap: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def run_python(
    code: str, stdin: str = "", limits: SandboxLimits | None = None, files: dict[str, str] | None = None
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox under ``limits`` (default: the run's); never
    raises for what the code does. ``files``: more files (name -> text) beside it in its /tmp.

    Raises ``SandboxUnavailableError`` when isolation is required and this machine cannot provide it."""
    limits = limits or default_limits()
    python = limits.python_executable or sys.executable
    problem = isolation_problem(limits)
    if problem is not None and limits.require_isolation:
        raise SandboxUnavailableError(_unavailable_message(problem))
    plan = plan_launch(limits.unprivileged_uid, python, isolate=problem is None)
    if problem is not None:
        plan = LaunchPlan(plan.prefix, False, plan.run_as_uid, (), (), 0, (f"not isolated: {problem}",))
    return _run(plan, code, stdin, files or {}, limits, python)


def _run(
    plan: LaunchPlan, code: str, stdin: str, files: dict[str, str], limits: SandboxLimits, python: str
) -> SandboxResult:
    notes = list(plan.notes)
    with (
        tempfile.TemporaryDirectory(prefix="nexrl_sandbox_") as tmp,
        tempfile.TemporaryFile() as fin,
        tempfile.TemporaryFile() as fout,
        tempfile.TemporaryFile() as ferr,
    ):
        work = Path(tmp)
        cwd = _prepare_work_dir(work, plan, code, files, limits, python)
        fin.write(stdin.encode())
        fin.seek(0)
        start = time.monotonic()
        proc = subprocess.Popen(
            [*plan.prefix, python, "-I", "-B", str(work / "launcher.py")],
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=cwd,
            env={},
            start_new_session=True,
            close_fds=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_time_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # on success too: background children die with the run
        elapsed = time.monotonic() - start
        stdout, out_cut = _read_capped(fout, limits.max_output_bytes)
        stderr, err_cut = _read_capped(ferr, limits.max_output_bytes)
    if plan.prefix:  # the wrapper's own complaints when its child is killed are not the program's output
        stderr = "".join(
            line for line in stderr.splitlines(keepends=True) if not line.startswith("unshare: ")
        )
    status = _classify(proc.returncode, timed_out, stderr, out_cut or err_cut)
    return SandboxResult(status, stdout, stderr, proc.returncode, elapsed, plan.isolated, notes)


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """The resource limits the launcher sets on the program (soft, hard)."""
    memory = int(limits.memory_mb) << 20
    fsize = int(limits.max_output_bytes) + 1024
    # CPU: SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL one second later
    return {
        "RLIMIT_CPU": (int(limits.cpu_time_s), int(limits.cpu_time_s) + 1),
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_FSIZE": (fsize, fsize),
        "RLIMIT_NOFILE": (int(limits.max_open_files), int(limits.max_open_files)),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NPROC": (int(limits.max_processes), int(limits.max_processes)),
    }


def _prepare_work_dir(
    work: Path, plan: LaunchPlan, code: str, files: dict[str, str], limits: SandboxLimits, python: str
) -> str:
    """The program and its files under ``work/in``, the private root, the launcher script; returns
    the directory the launcher starts in."""
    inputs = work / "in"
    inputs.mkdir()
    for name, text in {**files, "main.py": code}.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"sandbox file name {name!r}: a plain file name is needed")
        (inputs / name).write_text(text)
    (work / "root").mkdir()
    cfg = {
        "isolate": plan.isolated,
        "root": str(work / "root"),
        "binds": list(plan.binds),
        "links": list(plan.links),
        "devices": list(DEVICES),
        "tmp_bytes": int(limits.tmp_mb) << 20,
        "tmp_inodes": 4096,
        "inputs": str(inputs),
        "uid": plan.run_as_uid,
        "drop": plan.isolated or plan.run_as_uid is not None,
        "pivot_root": plan.pivot_root,
        "rlimits": _rlimits(limits),
        "python": os.path.abspath(python),
        "main": "main.py",
    }
    (work / "launcher.py").write_text(LAUNCHER.format(cfg=cfg, tag=SETUP_TAG, setup_exit=SETUP_EXIT))
    if not plan.isolated and plan.run_as_uid is not None:  # the code runs in the host's dir: let it in
        for path in (work, inputs, *inputs.iterdir()):
            os.chown(path, plan.run_as_uid, plan.run_as_uid)
        return str(inputs)
    if not plan.isolated:
        return str(inputs)
    return str(work)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run and return only when its processes are gone.

    With a PID namespace, killing its init (unshare's child) makes the kernel kill and reap every
    process in the namespace before unshare's wait returns, even ones that left the session; the
    namespace's mounts (its /tmp and /dev/shm) go with its last process. The session kill covers
    the no-namespace case and the wrapper itself.
    """
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _signal_of(returncode: int | None) -> int | None:
    """The signal that ended the program, from Popen's -N or a wrapper's 128+N exit status."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if returncode > 128:
        return returncode - 128
    return None


def _classify(returncode: int | None, timed_out: bool, stderr: str, output_cut: bool) -> Status:
    if timed_out:
        return "timeout"
    sig = _signal_of(returncode)
    if returncode == 0:
        return "output_limit" if output_cut else "ok"
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ or output_cut:
        return "output_limit"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit"
    if sig is not None:
        return "killed"
    return "error"
