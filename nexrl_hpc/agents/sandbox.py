"""Run untrusted Python (model-written code) in a child process with hard limits.

Why a subprocess and not exec(): a reward or tool call must survive code that loops forever,
allocates without bound, forks without bound, floods its output or phones home. The layers, each
exercised by tests/test_agents_sandbox.py:

* wall time: after ``wall_time_s`` the parent SIGKILLs the PID namespace's init (the kernel then
  kills every process in the namespace, also ones that left the session) and the session;
* CPU time, address space, file size, open files, core dumps, process count: ``setrlimit`` in the
  child just before it execs the interpreter (a small launcher does this, no ``preexec_fn``);
* no network and a private /proc: fresh network, PID and mount namespaces (``unshare``; root
  creates them directly, other users through a user namespace). Where that fails the result
  says ``network_isolated=False``; ``SandboxLimits.require_isolation`` makes it an error instead;
* a fresh session, an empty environment, ``python -I`` (no site/user paths, no PYTHON* vars), a
  temporary working directory removed afterwards, stdio through unlinked temp files.

RLIMIT_NPROC is not enforced by Linux for uid 0, so a root caller runs the code as
``unprivileged_uid`` (default 65534, "nobody"). When that uid cannot read the interpreter (e.g.
a Python under /root), it keeps CAP_DAC_READ_SEARCH, which also lets the code read any file on
the host; the result's notes say so, and ``python_executable`` pointing to a world-readable
Python avoids it. Not limited: the number of files the code creates in its temp dir (each is
capped by RLIMIT_FSIZE), total memory across its processes (RLIMIT_AS is per process), and
reading world-readable host files. The process count is per uid: concurrent root-started
sandboxes share ``max_processes`` of ``unprivileged_uid``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

Status = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed"]

# Runs first in the child: set limits, then become the untrusted program. Kept tiny and
# dependency-free because it runs inside the limits it sets. As PID 1 of a new PID namespace the
# kernel would not deliver SIGXCPU/SIGKILL from RLIMIT_CPU to it, so there it forks the program
# and reports the program's fate as its own exit status (128 + signal, like a shell).
_LAUNCHER = """\
import os, resource, sys
limits = {limits!r}
if os.getpid() == 1:
    pid = os.fork()
    while pid:  # as init, reap orphans too (zombies would count against RLIMIT_NPROC)
        done, status = os.wait()
        if done == pid:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
for name, (soft, hard) in limits.items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", "-B", "main.py"])
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run; a config section (``agents.sandbox``) will carry these later."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    max_open_files: int = 64
    isolate_network: bool = True
    require_isolation: bool = False
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
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """What happened: ``status`` says why it ended; output is cut at ``max_output_bytes``."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    wall_time_s: float
    network_isolated: bool
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


class SandboxUnavailableError(RuntimeError):
    """Isolation was required (``require_isolation``) but this machine cannot provide it."""


@functools.lru_cache(maxsize=4)
def _probe(cmd: tuple[str, ...]) -> bool:
    """Whether a namespace wrapper actually works here (kernels and containers differ)."""
    try:
        return subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _others_can_use(path: str) -> bool:
    """Whether a uid that is neither owner nor group can traverse to ``path`` and read/run it."""
    real = Path(os.path.realpath(path))
    for parent in real.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(real).st_mode & stat.S_IROTH)


@dataclass
class _Wrapper:
    """How the child is started: the command prefix, and what that buys."""

    prefix: list[str] = field(default_factory=list)
    network_isolated: bool = False
    run_as_uid: int | None = None
    notes: list[str] = field(default_factory=list)


def _wrapper(limits: SandboxLimits, python: str) -> _Wrapper:
    wrap = _Wrapper()
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    if limits.isolate_network and unshare:
        # root may create namespaces directly; others need a user namespace (-r) first
        user = [] if root else ["-r"]
        ns = [unshare, *user, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
        if _probe(tuple(ns)):
            wrap.prefix, wrap.network_isolated = ns, True
        else:
            wrap.notes.append("unshare cannot create namespaces here: network not isolated")
    elif limits.isolate_network:
        wrap.notes.append("no unshare binary: network not isolated")
    if root:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            wrap.notes.append(
                "running as root without setpriv: the code runs as root, process limit not enforced"
            )
        else:
            uid = str(limits.unprivileged_uid)
            wrap.run_as_uid = limits.unprivileged_uid
            wrap.prefix += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            lib = str(Path(os.path.realpath(python)).parents[1] / "lib")
            if not (_others_can_use(python) and _others_can_use(lib)):
                wrap.prefix += ["--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search"]
                wrap.notes.append(
                    f"{python} is not readable by uid {uid}: it keeps CAP_DAC_READ_SEARCH and can read any host file"
                )
    if limits.require_isolation and not wrap.network_isolated:
        raise SandboxUnavailableError("sandbox isolation required but unavailable: " + "; ".join(wrap.notes))
    return wrap


def _read_capped(f: IO[bytes], cap: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temp dir under ``limits``; never raises for what the code does."""
    limits = limits or SandboxLimits()
    python = limits.python_executable or sys.executable
    wrap = _wrapper(limits, python)
    memory = int(limits.memory_mb) << 20
    files = int(limits.max_output_bytes) + 1024
    # CPU: SIGXCPU at the soft limit (reported as cpu_limit), SIGKILL one second later
    rlimits = {
        "RLIMIT_CPU": (int(limits.cpu_time_s), int(limits.cpu_time_s) + 1),
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_FSIZE": (files, files),
        "RLIMIT_NOFILE": (int(limits.max_open_files), int(limits.max_open_files)),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NPROC": (int(limits.max_processes), int(limits.max_processes)),
    }
    with (
        tempfile.TemporaryDirectory(prefix="nexrl_sandbox_") as tmp,
        tempfile.TemporaryFile() as fin,
        tempfile.TemporaryFile() as fout,
        tempfile.TemporaryFile() as ferr,
    ):
        work = Path(tmp)
        (work / "main.py").write_text(code)
        (work / "launcher.py").write_text(_LAUNCHER.format(limits=rlimits))
        if wrap.run_as_uid is not None:
            os.chown(work, wrap.run_as_uid, wrap.run_as_uid)
        fin.write(stdin.encode())
        fin.seek(0)
        start = time.monotonic()
        proc = subprocess.Popen(
            [*wrap.prefix, python, "-I", "-B", "launcher.py"],
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=work,
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
    if wrap.prefix:  # the wrappers' own complaints when their child is killed are not the program's output
        stderr = "".join(
            line
            for line in stderr.splitlines(keepends=True)
            if not line.startswith(("unshare: ", "setpriv: "))
        )
    status = _classify(proc.returncode, timed_out, stderr, out_cut or err_cut)
    return SandboxResult(status, stdout, stderr, proc.returncode, elapsed, wrap.network_isolated, wrap.notes)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run and return only when its processes are gone.

    With a PID namespace, killing its init (unshare's child) makes the kernel kill and reap every
    process in the namespace before unshare's wait returns, even ones that left the session.
    The session kill covers the no-namespace case and the wrappers themselves.
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
