"""FutureBridge hands other threads' results to an event loop, a burst in one wake-up."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest

from nexrl_hpc.core.bridge import FutureBridge


def test_results_errors_and_cancellations_reach_the_waiters_a_burst_in_one_wake_up() -> None:
    async def main() -> tuple[list[Any], int]:
        loop = asyncio.get_running_loop()
        bridge = FutureBridge(loop)
        wake_ups = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            nonlocal wake_ups
            wake_ups += 1
            return schedule(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        futures: list[Future] = [Future() for _ in range(200)]
        waiters = [loop.create_future() for _ in futures]
        for future, waiter in zip(futures, waiters):
            bridge.deliver(future, waiter)
        abandoned = waiters[3]
        abandoned.cancel()  # a step cancelled while its score was on the way

        def finish_all() -> None:
            for i, future in enumerate(futures):
                if i == 1:
                    future.set_exception(ValueError("scorer broke"))
                elif i == 2:
                    future.cancel()
                else:
                    future.set_result(i)

        thread = threading.Thread(target=finish_all)
        thread.start()
        thread.join()  # the whole burst finished before the loop looks
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        return outcomes, wake_ups

    outcomes, wake_ups = asyncio.run(main())
    assert wake_ups == 1
    assert outcomes[0] == 0 and outcomes[4:] == list(range(4, 200))
    assert isinstance(outcomes[1], ValueError) and "scorer broke" in str(outcomes[1])
    assert isinstance(outcomes[2], (asyncio.CancelledError, CancelledError))
    assert isinstance(outcomes[3], asyncio.CancelledError)


def test_a_future_done_before_delivery_resolves_its_waiter() -> None:
    async def main() -> int:
        bridge = FutureBridge(asyncio.get_running_loop())
        future: Future = Future()
        future.set_result(7)
        waiter = asyncio.get_running_loop().create_future()
        bridge.deliver(future, waiter)
        return await asyncio.wait_for(waiter, 5)

    assert asyncio.run(main()) == 7


def test_a_closed_loop_is_not_an_error_in_the_finishing_thread(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    bridge = FutureBridge(loop)
    future: Future = Future()
    bridge.deliver(future, loop.create_future())
    loop.close()
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        future.set_result(1)  # a callback that raised would be logged here ("exception calling callback")
    assert not caplog.records
