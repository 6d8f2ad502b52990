"""The weight version a rollout request is sampled with, read without blocking the event loop.

Hundreds of requests start in the same instant on a rollout rank; asking the rollout scheduler
(on rank 0 in mpi mode) once per request put hundreds of round trips in a row on the
loop. Requests that start while a lookup is in flight share its answer: the version a request
records is then the one served when the lookup began, which is also what a request that started
that moment would have seen.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from nexrl_hpc.core.execute import execute_async

if TYPE_CHECKING:
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef


class RolloutVersionLookup:
    """``await lookup.read()`` → the scheduler's rollout version for ``model_tag`` (None without one)."""

    def __init__(self, model_tag: str):
        self._model_tag = model_tag
        self._scheduler: RolloutSchedulerRef | None = None  # the module, or a handle to it
        self._in_flight: asyncio.Future | None = None

    def set_scheduler(self, scheduler: RolloutSchedulerRef | None) -> None:
        self._scheduler = scheduler

    async def read(self) -> int | None:
        if self._scheduler is None:
            return None
        shared = self._in_flight
        if shared is None:
            future = execute_async(self._scheduler.get_rollout_model_version, self._model_tag)
            if future.done():  # a local scheduler answers at once: nothing to share
                return int(future.result())
            shared = self._in_flight = asyncio.wrap_future(future)
            shared.add_done_callback(self._clear)
        return int(await asyncio.shield(shared))

    def _clear(self, done: asyncio.Future) -> None:
        if self._in_flight is done:
            self._in_flight = None
