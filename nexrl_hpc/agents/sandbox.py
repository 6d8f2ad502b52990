"""Run untrusted Python (model-written code) in a child process with hard limits.

Why a subprocess and not exec(): a reward or tool call must survive code that loops forever,
allocates without bound, forks without bound, fills the disk or phones home. The layers, each
verified by tests/test_agents_sandbox.py on Linux:

* wall time: the parent kills the whole process group (and, with a PID namespace, every process
  in it) after ``wall_time_s``;
* CPU time, address space, file size, open files, core dumps, process count: ``setrlimit`` in the
  child just before it execs the interpreter (a small launcher does this, no ``preexec_fn``);
* no network: a fresh network namespace (``unshare``); where namespaces are not available the
  result says ``network_isolated=False`` and ``SandboxLimits.require_isolation`` makes it an error;
* a fresh session, an empty environment, ``python -I`` (no site/user paths, no PYTHON* vars),
  and a temporary working directory removed afterwards.

RLIMIT_NPROC is not enforced by Linux for uid 0, so when the parent runs as root the child drops
to ``unprivileged_uid`` (default 65534, "nobody") keeping only CAP_DAC_READ_SEARCH, so the
interpreter stays readable wherever it is installed. The process count is per uid: concurrent
sandboxes running as the same uid share ``max_processes``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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
    if pid:
        status = os.waitpid(pid, 0)[1]
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
        return f"{reasons[self.status]}: {tail[0]}".rstrip(": ")


class SandboxUnavailableError(RuntimeError):
    """Isolation was required (``require_isolation``) but this machine cannot provide it."""


@functools.lru_cache(maxsize=4)
def _probe(cmd: tuple[str, ...]) -> bool:
    """Whether a namespace wrapper actually works here (kernels and containers differ)."""
    try:
        return subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _wrapper(limits: SandboxLimits) -> tuple[list[str], bool, list[str]]:
    """The command prefix that isolates the child, whether it isolates the network, and notes."""
    notes: list[str] = []
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    prefix: list[str] = []
    isolated = False
    if limits.isolate_network and unshare:
        # root may create namespaces directly; others need a user namespace (-r) first
        ns = (
            [unshare, "--net", "--pid", "--fork", "--kill-child"]
            if root
            else [unshare, "-r", "--net", "--pid", "--fork", "--kill-child"]
        )
        if _probe(tuple(ns)):
            prefix, isolated = ns, True
        else:
            notes.append("unshare cannot create namespaces here: network not isolated")
    elif limits.isolate_network:
        notes.append("no unshare binary: network not isolated")
    if root:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            notes.append("running as root without setpriv: the process limit is not enforced")
        else:
            uid = str(limits.unprivileged_uid)
            prefix += [
                setpriv,
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                "--inh-caps=-all,+dac_read_search",
                "--ambient-caps=+dac_read_search",
            ]
    if limits.require_isolation and not isolated:
        raise SandboxUnavailableError("sandbox isolation required but unavailable: " + "; ".join(notes))
    return prefix, isolated, notes


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temp dir under ``limits``; never raises for what the code does."""
    limits = limits or SandboxLimits()
    prefix, isolated, notes = _wrapper(limits)
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
    with tempfile.TemporaryDirectory(prefix="nexrl_sandbox_") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code)
        (work / "launcher.py").write_text(_LAUNCHER.format(limits=rlimits))
        (work / "stdin.txt").write_text(stdin)
        if os.geteuid() == 0 and prefix and "--reuid" in " ".join(prefix):
            os.chown(work, limits.unprivileged_uid, limits.unprivileged_uid)
        out_path, err_path = work / ".stdout", work / ".stderr"
        start = time.monotonic()
        with (
            open(work / "stdin.txt", "rb") as fin,
            open(out_path, "wb") as fout,
            open(err_path, "wb") as ferr,
        ):
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-B", "launcher.py"],
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
                returncode: int | None = proc.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                returncode = proc.returncode
            else:
                _kill_group(proc)  # leftovers (background children) die with the run
        elapsed = time.monotonic() - start
        stdout, out_cut = _read_capped(out_path, limits.max_output_bytes)
        stderr, err_cut = _read_capped(err_path, limits.max_output_bytes)
    if prefix:  # the wrappers' own complaints when their child is killed are not the program's output
        stderr = "".join(
            line
            for line in stderr.splitlines(keepends=True)
            if not line.startswith(("unshare: ", "setpriv: "))
        )
    status = _classify(returncode, timed_out, stderr, out_cut or err_cut)
    return SandboxResult(status, stdout, stderr, returncode, elapsed, isolated, notes)


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
