"""The worker side of ``nexrl_hpc.hub.venv_process``: standard library only (it runs in a hub's venv).

The protocol is JSON lines. The run writes the init message and then requests on stdin; answers go to
the process's original stdout, which nothing else can write to: fd 1 and ``sys.stdout`` are pointed
at stderr (the run's log file) before the environment's code is imported, so a ``print`` in a user's
environment cannot corrupt the stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TextIO


def protocol_stream() -> TextIO:
    """The original stdout, for the protocol alone; fd 1 and ``sys.stdout`` now write to stderr."""
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(protocol_fd, "w", buffering=1)


class Answers:
    """One writer for the protocol stream (answers finish on the loop and on threads)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, separators=(",", ":"), allow_nan=False)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def add_python_path(paths: list[str]) -> None:
    """The user's packages first on ``sys.path``, and on ``PYTHONPATH`` for the environment's own
    child processes (tool servers started as ``python -m <module>``)."""
    for path in reversed(paths):
        sys.path.insert(0, path)
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )


async def read_requests(answer: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Each stdin line to ``answer`` as its own task; at EOF (the run let go) finish what was asked."""
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = asyncio.ensure_future(answer(json.loads(line)))
        running.add(job)
        job.add_done_callback(running.discard)
    for job in list(running):
        await job


def run_worker(serve: Callable[[dict[str, Any], Answers], Coroutine[Any, Any, None]]) -> int:
    """Read the init message and ``serve`` it; an environment that cannot load answers ``fatal``."""
    answers = Answers(protocol_stream())
    try:
        init = json.loads(sys.stdin.readline())
        asyncio.run(serve(init, answers))
    except Exception:
        trace = traceback.format_exc()
        print(trace, file=sys.stderr)
        answers.send({"fatal": trace})
        return 1
    return 0
