"""Run a command and end its whole process group when the parent process is gone.

Why: an inference server started by a run (vLLM spawns engine processes of its own) must not
outlive the run when that is killed without a chance to clean up (SIGKILL, OOM, a crashed test).
Stdlib only. Usage: ``python -m nexrl_hpc.inference.supervise PARENT_PID -- CMD ARGS...``; the
caller starts it in a new session so the command and its children share its process group.
The command starts with the soft descriptor limit at the hard one: a server with many connections
(an inference server flooded by a neighbour) runs out of the hard limit, not of a low soft one.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(grace_s: float) -> None:
    """SIGTERM the group (this process ignores it), then SIGKILL whatever is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(0, signal.SIGKILL)


def raise_soft_nofile() -> None:
    """The soft descriptor limit up to the hard one (inherited by the command)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # an unlimited hard limit some kernels refuse as a soft one: keep the soft


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m nexrl_hpc.inference.supervise PARENT_PID -- CMD ARGS...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    raise_soft_nofile()
    child = subprocess.Popen(argv[2:])
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent or not _alive(parent):
            _end_group(grace_s=10.0)
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
