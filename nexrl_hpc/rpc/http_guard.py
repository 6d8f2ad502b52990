"""An HTTP port of a run (the train service's API server, the local inference server) under the
run's pre-authentication limits.

FastAPI reads a request's whole body before any dependency (the token check among them) runs, and
uvicorn keeps a connection that never completes its request for as long as the peer likes. Here:

- ``BearerFirst`` (ASGI middleware): the bearer token is checked (constant time) before a byte of
  the body is read — a request without it gets 401 and its connection is closed — and an
  authenticated body is bounded by ``preauth_max_bytes`` (413 naming the setting); a wrong token is
  answered after a delay that doubles with the failures of the last ``FAILED_TOKEN_WINDOW_S``, up to
  ``FAILED_TOKEN_MAX_DELAY_S`` (``FailedTokenThrottle``: guessing is slowed, the port's own clients,
  which hold the token, are not);
- ``GuardedH11Protocol`` (uvicorn's h11 protocol): a connection must deliver a complete request head
  within ``preauth_timeout_s`` (of its start, or of its previous response), and at most
  ``preauth_max_connections`` connections wait for one at a time (beyond, the oldest is closed:
  ``preauth.over_cap``); an idle keep-alive connection is one waiting for its next head, under the
  same deadline and cap.

Threads: everything runs on uvicorn's event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import deque
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from nexrl_hpc.rpc.preauth import CAP_GRACE_S, WireLimits, has_unread_bytes, over_cap

logger = logging.getLogger(__name__)

FAILED_TOKEN_FIRST_DELAY_S = 0.05  # the answer to the first wrong token of a quiet window waits this long...
FAILED_TOKEN_MAX_DELAY_S = 2.0  # ...doubling with each further one, up to this
FAILED_TOKEN_WINDOW_S = 60.0  # failures older than this no longer count
FAILED_TOKEN_HELD = 64  # at most this many wrong-token answers wait at once (a flood keeps no descriptors)


class FailedTokenThrottle:
    """The delay before a wrong token's 401: doubles with the failures of the last window, bounded.
    One per port; every peer's failures count (peers of one node share an address)."""

    def __init__(self) -> None:
        self._failures: deque[float] = deque(maxlen=64)
        self._held = 0

    def delay_s(self) -> float:
        """Count a failure now and return how long its answer waits."""
        now = time.monotonic()
        while self._failures and now - self._failures[0] > FAILED_TOKEN_WINDOW_S:
            self._failures.popleft()
        self._failures.append(now)
        if self._held >= FAILED_TOKEN_HELD:
            return 0.0
        return min(FAILED_TOKEN_FIRST_DELAY_S * 2 ** (len(self._failures) - 1), FAILED_TOKEN_MAX_DELAY_S)

    async def wait(self) -> None:
        delay = self.delay_s()
        self._held += 1
        try:
            await asyncio.sleep(delay)
        finally:
            self._held -= 1


class BearerFirst:
    """ASGI middleware: the token before the body (wrong tokens throttled), and a bounded body."""

    def __init__(self, app: Any, token: str, max_body_bytes: int, owner: str = "train service"):
        self.app = app
        self._token = token.encode()
        self._max_body = max_body_bytes
        self._owner = owner
        self._throttle = FailedTokenThrottle()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self._token):
            peer = scope.get("client") or ("?", 0)
            logger.warning("%s: refused a request from %s:%s without the token", self._owner, *peer)
            await self._throttle.wait()
            await _answer(send, 401, "missing or wrong bearer token")
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self._max_body):
            await _answer(send, 413, f"body over runtime.rpc.preauth_max_bytes ({self._max_body} bytes)")
            return
        seen = 0

        async def bounded_receive() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self._max_body:
                raise ValueError(f"body over runtime.rpc.preauth_max_bytes ({self._max_body} bytes)")
            return message

        await self.app(scope, bounded_receive, send)


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def guarded_protocol(limits: WireLimits, owner: str = "train service") -> type[H11Protocol]:
    """uvicorn's h11 protocol with the request-head deadline and the cap of ``limits`` (``owner``
    names the port in the log)."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"wire_limits": limits, "owner": owner})


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a cap on connections waiting for one."""

    wire_limits: WireLimits  # set on the subclass ``guarded_protocol`` makes
    owner: str

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._waiting_since = time.monotonic()
        self._waiting_after: Any = None  # the request cycle before the awaited head
        self._head_deadline: Any = self.loop.call_later(self.wire_limits.preauth_timeout_s, self._head_late)
        self._cap()
        self.loop.call_later(CAP_GRACE_S, self._cap)  # once the new one had its grace

    def _cap(self) -> None:
        """Close the oldest connections waiting for a request head while over the cap."""
        now = time.monotonic()
        waiting: list[Any] = sorted(
            (c for c in self.connections if getattr(c, "_head_deadline", None) is not None),
            key=lambda c: c._waiting_since,
        )
        cap = self.wire_limits.preauth_max_connections
        count = len(waiting)
        for conn in waiting:  # oldest first
            if not over_cap(count, now - conn._waiting_since, cap):
                return
            sock = conn.transport.get_extra_info("socket")
            if sock is not None and has_unread_bytes(sock):  # its request is here: served first
                continue
            logger.warning(
                "%s: over %d connections waiting for a request "
                "(runtime.rpc.preauth_max_connections): closed the oldest",
                self.owner,
                cap,
            )
            conn._head_late()
            count -= 1

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_deadline is not None and self.cycle is not self._waiting_after:  # a head came
            self._head_deadline.cancel()
            self._head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_deadline is None and not self.transport.is_closing():  # the next request's head
            self._waiting_since, self._waiting_after = time.monotonic(), self.cycle
            self._head_deadline = self.loop.call_later(self.wire_limits.preauth_timeout_s, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def _head_late(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()
