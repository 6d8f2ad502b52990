"""FutureBridge: results of other threads' futures onto an event loop, one wake-up per burst.

``asyncio.wrap_future`` wakes the loop once per future (a self-pipe write, a GIL hand-off). A pool
that finishes hundreds of calls at once (a batch of rewards) would wake it hundreds of times; the
bridge collects what finished since the loop last looked and hands it over in one callback.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any


class FutureBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._finished: list[tuple[Future, asyncio.Future[Any]]] = []

    def deliver(self, future: Future, waiter: asyncio.Future[Any]) -> None:
        """Resolve ``waiter`` (of this bridge's loop) like ``future`` once that is done."""
        future.add_done_callback(lambda done: self._finish(done, waiter))

    def _finish(self, future: Future, waiter: asyncio.Future[Any]) -> None:
        with self._lock:
            self._finished.append((future, waiter))
            first = len(self._finished) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._hand_over)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _hand_over(self) -> None:
        with self._lock:
            finished, self._finished = self._finished, []
        for future, waiter in finished:
            if waiter.done():  # the waiting step was cancelled
                continue
            if future.cancelled():
                waiter.cancel()
            elif (exc := future.exception()) is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(future.result())
