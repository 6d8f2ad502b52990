"""A local inference server process started with the run, before there is a model to serve.

The server's start-up is mostly imports (torch, transformers, the HTTP stack),
and the run's process imports the same things before it builds the model the server loads. Started
as soon as the config is valid, the server process does its imports beside the run's and then
waits on its stdin for what to serve; ``LocalInferenceServer.launch`` hands it the command line,
the API key, the umask and the log file (``take_prewarmed``). A run that never gets that far kills
it (``discard_prewarmed``); should the run die first, its pipe closes and the process leaves.

Nothing heavy here (the standard library and the stdlib-only ``server_process``): this module is
imported before the heavy imports it overlaps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

from nexrl_hpc.inference.server_process import threshold_args

API_KEY_ENV = "NEXRL_INFERENCE_API_KEY"  # the server's bearer key (never on its command line)
SPEC_FROM_STDIN = "--spec-from-stdin"

_lock = threading.Lock()
_prewarmed: tuple[subprocess.Popen, int, list[int]] | None = None  # (process, OMP threads, GC thresholds)


def server_env(num_threads: int) -> dict[str, str]:
    """The environment a local server starts with (torch reads OMP_NUM_THREADS at import)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(num_threads))
    return env


def prewarm(num_threads: int, gc_thresholds: list[int]) -> None:
    """Start the waiting server process (once per process; a second call keeps the first)."""
    global _prewarmed
    with _lock:
        if _prewarmed is not None:
            return
        # its output (import warnings) goes to an unnamed file until it knows its log; it copies it there
        with tempfile.TemporaryFile() as early_output:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nexrl_hpc.inference.server_process",
                    *threshold_args(gc_thresholds),
                    SPEC_FROM_STDIN,
                ],
                stdin=subprocess.PIPE,
                stdout=early_output,
                stderr=subprocess.STDOUT,
                env=server_env(num_threads),
                start_new_session=True,  # as a launched server: one process group to kill
            )
        _prewarmed = (process, num_threads, list(gc_thresholds))


def take_prewarmed(num_threads: int, gc_thresholds: list[int]) -> subprocess.Popen | None:
    """The waiting process, if there is one started with ``num_threads`` and ``gc_thresholds`` and
    still alive (it is then the caller's: hand it a spec with ``send_spec``)."""
    global _prewarmed
    with _lock:
        found, _prewarmed = _prewarmed, None
    if found is None:
        return None
    process, threads, thresholds = found
    if threads != num_threads or thresholds != list(gc_thresholds) or process.poll() is not None:
        _close(process)
        return None
    return process


def send_spec(process: subprocess.Popen, argv: list[str], api_key: str, log_path: str) -> bool:
    """Tell the waiting process what to serve; False if it is gone (start a fresh one instead)."""
    umask = os.umask(0o077)
    os.umask(umask)
    spec = {"argv": argv, "api_key": api_key, "log_path": log_path, "umask": umask}
    try:
        assert process.stdin is not None
        process.stdin.write((json.dumps(spec) + "\n").encode())
        process.stdin.close()
        return True
    except (BrokenPipeError, OSError, ValueError):
        _close(process)
        return False


def discard_prewarmed() -> None:
    """The run ends without having used the waiting process: it is stopped."""
    global _prewarmed
    with _lock:
        found, _prewarmed = _prewarmed, None
    if found is not None:
        _close(found[0])


def _close(process: subprocess.Popen) -> None:
    """Stop a process that was never told what to serve: it holds nothing yet, so it is killed
    (with anything it started: its own session) rather than waited for through its imports."""
    try:
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
    except OSError:
        pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def read_spec(stdin: IO[bytes]) -> dict[str, Any] | None:
    """The server side: wait for the spec (None: the run closed the pipe without one), then take
    on the run's umask and move the output so far into the log file."""
    line = stdin.readline()
    if not line.strip():
        return None
    spec: dict[str, Any] = json.loads(line)
    os.umask(int(spec["umask"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.makedirs(os.path.dirname(spec["log_path"]) or ".", exist_ok=True)
    log_fd = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.lseek(1, 0, os.SEEK_SET)  # the unnamed file the output went to so far
        while chunk := os.read(1, 1 << 16):
            os.write(log_fd, chunk)
    except OSError:
        pass  # not a seekable file (started by hand): nothing to carry over
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ[API_KEY_ENV] = str(spec["api_key"])
    return spec
