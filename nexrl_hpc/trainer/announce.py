"""Announcing an exported version to the rollout scheduler, which publishes it to the engines and
then releases the next batch.

Sync mode announces in the trainer's thread: the next batch needs these weights. The async modes
hand each announcement to one announcement thread once the previous one has ended, so versions are
published in order while the next step trains, and a failed publication is raised in the trainer's
thread at its next ``announce`` or ``wait``. One thread for the run: starting a thread per step
waits for it to run, a GIL hand-off the trainer paid on every step. A daemon: one stuck behind a
validation that never ends must not hold the process's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from nexrl_hpc.weight_sync.verify import CanaryReference

Notify = Callable[[int, CanaryReference | None], None]  # (version, the trainer's canary log-probs)


class VersionAnnouncer:
    """``announce`` each version in order; ``wait`` for the one in flight (its error raised there)."""

    def __init__(self, notify: Notify, in_background: bool, thread_name: Callable[[], str]):
        self._notify = notify
        self._in_background = in_background
        self._thread_name = thread_name  # asked at the first announcement (the module's name is set late)
        self._queue: queue.SimpleQueue[tuple[int, CanaryReference | None, Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._in_flight: Future | None = None

    def announce(self, version: int, canary: CanaryReference | None = None) -> None:
        if not self._in_background:
            self._notify(version, canary)
            return
        self.wait()
        announced: Future = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._thread_name(), daemon=True)
            self._thread.start()
        self._queue.put((version, canary, announced))
        self._in_flight = announced

    def wait(self) -> None:
        """The announcement in flight has ended (its error, e.g. a failed publication, is raised here)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _loop(self) -> None:
        while True:
            version, canary, announced = self._queue.get()
            try:
                self._notify(version, canary)
                announced.set_result(None)
            except BaseException as exc:  # handed to the trainer's thread, raised at its next wait
                announced.set_exception(exc)
