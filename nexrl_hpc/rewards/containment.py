"""What a reward call may not do to the run: end the process, or leave processes behind.

Rewards run on threads of the run's own process (a process per call would cost many times what the
shipped rewards cost), so their exits and children are contained here, per call:

* ``os._exit`` (and ``posix._exit``, the same function) raises ``RewardExit`` instead of ending the
  process when it is called from a reward call on this process's threads: without this a reward's
  ``os._exit(0)`` ended the run with exit status 0 and nothing said why. ``sys.exit()``, ``exit()``
  and argparse's exit are ``SystemExit``, a ``BaseException`` the runner counts as an error. A
  process the reward forks keeps the real ``os._exit`` (the check is by pid). Still out of reach: a
  reward that ends the process below Python (``ctypes``' ``_exit``, a signal it sends itself):
  rewards are the user's code, trusted to that extent; model-written code belongs in the sandbox.
* the processes a reward call started are killed and reaped when the call ends (``reap_children``):
  on Linux each thread's children are listed in ``/proc/self/task/<tid>/children``, so a call's
  children are told apart from those other threads (the inference server, the sandbox's) started.
  Each child's descendants, and the whole process group of a child that leads its own (e.g.
  ``start_new_session=True``), go with it. Not caught: a process that detached itself (double
  fork) into a session of its own before the call ended. Elsewhere than Linux nothing is reaped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

_calls = threading.local()  # .pid: this process's pid while a reward call runs on this thread
_install_lock = threading.Lock()
_real_exit = os._exit
_MAX_TREE = 4096  # processes looked at per call: a fork bomb's tree is not walked to its end
WARN_EVERY_S = 60.0
_last_warning = [-WARN_EVERY_S]


class RewardExit(BaseException):
    """A reward called ``os._exit``: its call fails instead of the process ending (not an
    ``Exception``, so a reward's ``except Exception`` does not swallow it)."""


def _guarded_exit(status: int) -> NoReturn:
    if getattr(_calls, "pid", None) == os.getpid():
        raise RewardExit(f"called os._exit({status}); a reward may not end the run's process")
    _real_exit(status)


def install_exit_guard() -> None:
    """Route ``os._exit`` through the check above (idempotent; calls off reward threads unchanged)."""
    with _install_lock:
        if os._exit is _guarded_exit:
            return
        os._exit = _guarded_exit
        with contextlib.suppress(ImportError):
            import posix

            posix._exit = _guarded_exit


@contextlib.contextmanager
def reward_call() -> Iterator[None]:
    """One call of a reward on this thread: ``os._exit`` raises inside it, and the processes this
    thread started are reaped when it ends."""
    install_exit_guard()
    _calls.pid = os.getpid()
    try:
        yield
    finally:
        _calls.pid = None
        reap_children(threading.get_native_id())


def _children(pid: int, tid: int | None = None) -> list[int]:
    """The children of thread ``tid`` of process ``pid`` (every thread's when ``tid`` is None)."""
    tasks = [f"/proc/{pid}/task/{tid}/children"] if tid is not None else _tasks(pid)
    found: list[int] = []
    for path in tasks:
        try:  # os-level: this runs after every reward call
            fd = os.open(path, os.O_RDONLY)
            try:
                text = b""
                while part := os.read(fd, 1 << 16):
                    text += part
            finally:
                os.close(fd)
            found.extend(int(child) for child in text.split())
        except (OSError, ValueError):
            continue
    return found


def _tasks(pid: int) -> list[str]:
    try:
        return [str(task / "children") for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def _open(pid: int) -> Any:
    """A handle on ``pid`` that stays that process's (a pidfd), or the pid where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _signal(handle: Any, pid: int) -> None:
    with contextlib.suppress(OSError):
        if handle is not None:
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def _tree(children: list[int]) -> dict[int, Any]:
    """``children`` and their descendants, each with a handle taken before any of them is killed."""
    handles = {pid: _open(pid) for pid in children}
    tree = list(children)
    for pid in tree:  # breadth first
        if len(tree) >= _MAX_TREE:
            break
        for child in _children(pid):
            if child not in handles:
                handles[child] = _open(child)
                tree.append(child)
    return handles


def _kill_group_led_by(pid: int) -> None:
    """The process group ``pid`` leads (e.g. ``start_new_session=True``), never the run's own."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)


def reap_children(tid: int) -> int:
    """Kill every process thread ``tid`` of this process started and is still its child, with their
    descendants and own process groups, and reap the children; the number of children."""
    children = _children(os.getpid(), tid)
    if not children:
        return 0
    handles = _tree(children)
    mine = set(_children(os.getpid(), tid)) & set(children)  # still this thread's: no pid reused
    for pid, handle in handles.items():
        if pid in mine:
            _kill_group_led_by(pid)
        if pid in mine or pid not in children:
            _signal(handle, pid)
    for pid in mine:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    for handle in handles.values():
        if handle is not None:
            os.close(handle)
    if mine and time.monotonic() - _last_warning[0] >= WARN_EVERY_S:
        _last_warning[0] = time.monotonic()
        logger.warning("a reward call left %d child process(es) behind; killed and reaped", len(mine))
    return len(mine)
