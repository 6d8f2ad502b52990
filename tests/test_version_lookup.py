"""Rollout code on an event loop asks other modules without blocking the loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

import pytest

from nexrl_hpc.core.execute import aexecute
from nexrl_hpc.inference.version import RolloutVersionLookup


class SlowRemoteMethod:
    """Looks like a remote handle's method: ``call_async`` answers from another thread later."""

    def __init__(self, value: int, delay_s: float):
        self.value, self.delay_s, self.calls = value, delay_s, 0

    def call_async(self, *args: Any, **kwargs: Any) -> Future:
        self.calls += 1
        future: Future = Future()
        threading.Timer(self.delay_s, future.set_result, (self.value,)).start()
        return future

    def call_sync(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_async(*args, **kwargs).result()


class RemoteController:
    def __init__(self, version: int, delay_s: float):
        self.get_rollout_model_version = SlowRemoteMethod(version, delay_s)


class LocalController:
    def __init__(self) -> None:
        self.calls = 0

    def get_rollout_model_version(self, model_tag: str) -> int:
        self.calls += 1
        return 7


def test_requests_starting_together_share_one_version_lookup_and_the_loop_keeps_running() -> None:
    lookup = RolloutVersionLookup("default")
    remote = RemoteController(version=3, delay_s=0.2)
    lookup.set_scheduler(remote)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(10):
            await asyncio.sleep(0.01)
            ticks += 1

    async def main() -> list[int | None]:
        reads = [lookup.read() for _ in range(256)]
        out = await asyncio.gather(ticker(), *reads)
        return out[1:]

    versions = asyncio.run(main())
    assert versions == [3] * 256
    assert remote.get_rollout_model_version.calls == 1  # one round trip for the burst
    assert ticks == 10  # the loop ran other work while the lookup travelled


def test_a_lookup_after_the_answer_asks_again_and_a_local_controller_answers_inline() -> None:
    lookup = RolloutVersionLookup("default")
    remote = RemoteController(version=5, delay_s=0.01)
    lookup.set_scheduler(remote)

    async def two_rounds() -> tuple[int | None, int | None]:
        first = await lookup.read()
        remote.get_rollout_model_version.value = 6  # a weight sync landed
        return first, await lookup.read()

    assert asyncio.run(two_rounds()) == (5, 6) and remote.get_rollout_model_version.calls == 2
    local = LocalController()
    lookup.set_scheduler(local)
    assert asyncio.run(lookup.read()) == 7 and local.calls == 1
    assert asyncio.run(RolloutVersionLookup("default").read()) is None  # no controller: no version


def test_aexecute_awaits_remote_calls_and_raises_their_errors() -> None:
    class Failing:
        def call_async(self, *args: Any, **kwargs: Any) -> Future:
            future: Future = Future()
            threading.Timer(0.05, future.set_exception, (ConnectionError("rank 3 is dead"),)).start()
            return future

    assert asyncio.run(aexecute(SlowRemoteMethod(11, 0.05))) == 11
    assert asyncio.run(aexecute(lambda x: x + 1, 1)) == 2
    with pytest.raises(ConnectionError, match="rank 3 is dead"):
        asyncio.run(aexecute(Failing()))
