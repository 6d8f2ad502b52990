"""Running one request on the receiving rank: find the method, decode the arguments, call, encode.

Used by both servers of an endpoint (the IO-thread server of the ZMQ path and the lane server of
the direct lane). An exception raised by the method travels back as a ``RemoteError`` naming the
rank it came from; a result the codec refuses becomes the caller's ``TypeError``.

Threads: no state of its own besides what it is given; ``run`` is called on the IO thread (quick
methods) and on the endpoint's thread pools at once.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from nexrl_hpc.rpc.codec import RemoteError, decode, encode, encode_exception


class Invoker:
    """Looks up ``module.method`` with ``lookup`` and runs it on decoded arguments."""

    def __init__(
        self,
        rank: int,
        lookup: Callable[[str, str], Callable[..., Any]],
        resolve_handle: Callable[[str], Any] | None = None,
    ):
        self.rank = rank
        self._lookup = lookup
        self._resolve_handle = resolve_handle

    def find(self, module: str, method: str) -> Callable[..., Any]:
        """The method to run; a lookup failure becomes a function raising it (quick: answered at once)."""
        try:
            return self._lookup(module, method)
        except Exception as exc:
            return raiser(exc)

    def run(self, fn: Callable[..., Any], payload: Any, buffers: list[Any]) -> tuple[bool, bytes, list[Any]]:
        """Decode the arguments, call, encode the result or the exception: (ok, body, buffers)."""
        ok = True
        try:
            args, kwargs = decode(bytes(payload), buffers, self._resolve_handle)
            result = fn(*args, **kwargs)
        except BaseException as exc:  # delivered to the caller
            ok = False
            result = exc
        try:
            body, out_buffers = encode(result if ok else encode_exception(_with_origin(result, self.rank)))
        except TypeError as exc:
            ok = False
            body, out_buffers = encode(encode_exception(exc))
        return ok, body, out_buffers


def raiser(exc: Exception) -> Callable[..., Any]:
    """A quick function that raises ``exc`` (answers a request that cannot run)."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    fail.__nexrl_quick__ = True  # type: ignore[attr-defined]
    return fail


def _with_origin(exc: BaseException, rank: int) -> BaseException:
    if isinstance(exc, RemoteError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteError(type(exc).__name__, str(exc), tb, f"rank {rank}")
