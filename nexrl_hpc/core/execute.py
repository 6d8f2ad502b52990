"""Call a module method the same way whether the module lives in this process or on another rank.

A method of a local object runs here. A method of a remote handle (anything with ``call_async`` and
``call_sync``, provided by the distributed runtimes) is sent over the wire. ``execute_async`` returns a
``concurrent.futures.Future`` in both cases, so calling code never branches on the launch mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def quick(fn: F) -> F:
    """Mark a method cheap enough to be answered on the receiving rank's RPC thread, without a
    hand-off to a worker thread. Only for methods that never block and never call another module."""
    fn.__nexrl_quick__ = True  # type: ignore[attr-defined]
    return fn


def long_poll(fn: F) -> F:
    """Mark a method that may wait for work or an event before it answers (a long poll). A remote
    rank serves it on threads of its own: callers waiting in it never hold the threads that every
    other call needs (with more waiting callers than threads, a put that would end their wait
    could otherwise queue behind them until they time out)."""
    fn.__nexrl_long_poll__ = True  # type: ignore[attr-defined]
    return fn


def execute(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run ``func(*args, **kwargs)`` and return its result.

    Typed over the method: mypy checks the arguments of every call against the target's signature
    (a remote handle's method is typed as the module's own method where the reference is typed as
    the module or its Protocol)."""
    call_sync = getattr(func, "call_sync", None)
    if call_sync is not None:
        result: R = call_sync(*args, **kwargs)
        return result
    return func(*args, **kwargs)


def execute_async(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
    """Start ``func(*args, **kwargs)``; a local call has completed when this returns."""
    call_async = getattr(func, "call_async", None)
    if call_async is not None:
        remote: Future[R] = call_async(*args, **kwargs)
        return remote
    future: Future[R] = Future()
    try:
        future.set_result(func(*args, **kwargs))
    except BaseException as exc:  # delivered through the future, like a remote error
        future.set_exception(exc)
    return future


async def aexecute(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``execute`` for code on an event loop: a remote call is awaited, so the loop keeps serving
    its other steps while the reply travels; a local call answers at once."""
    future = execute_async(func, *args, **kwargs)
    if future.done():
        return future.result()
    return await asyncio.wrap_future(future)
