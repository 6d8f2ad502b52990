"""Guarding a listening ZMQ socket: who may connect, how many may wait, and what was refused.

libzmq accepts every TCP connection and drops the bad ones silently. ``ConnectionWatch`` runs a
thread of its own per listening socket that answers the context's ZAP requests (``preauth.py``:
PLAIN with the password derived from the key), reads the socket's monitor and keeps the
connections that have not authenticated yet under ``preauth_max_connections``: over it, the oldest
is closed (``over_cap``: so a flood cannot lock out the run's own ranks, and descriptors stay free
for the run's files). A connection counts as authenticated once a valid signed message came from it (``mark``,
by the receiving thread, with the frame's source descriptor) or once it has outlived the handshake
timeout (libzmq ends handshakes that take longer: whoever is still there passed PLAIN). Every
connection closed before it authenticated — wrong or no credentials, not a ZMQ peer, an oversized
frame, the handshake timeout, or evicted — is reported to ``reject`` once, with the peer's address.
Used by the RPC endpoint's ROUTER and by trainer rank 0's ROUTER.

Threads and locks: the watch's thread owns the monitor and ZAP sockets; ``_lock`` guards the
connection tables, which ``mark`` (the receiving thread) and the watch's thread both change.
``unmarked`` is read without the lock (a stale read only delays a mark).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from nexrl_hpc.rpc.preauth import WireLimits, ZapHandler, over_cap

logger = logging.getLogger(__name__)


class _Connection:
    __slots__ = ("peer", "accepted", "marked", "evicted")

    def __init__(self, peer: str, accepted: float):
        self.peer, self.accepted, self.marked, self.evicted = peer, accepted, False, False


class ConnectionWatch:
    """ZAP, the monitor and the pre-authentication cap of one listening socket (create it before
    ``bind``, so that no connection arrives before the ZAP handler exists)."""

    def __init__(
        self,
        sock: zmq.Socket,
        key: bytes,
        limits: WireLimits,
        reject: Callable[[str, str], None],
        owner: str,
    ):
        self._zap = ZapHandler(sock.context, key, owner)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._limits = limits
        self._reject = reject
        self._owner = owner
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}  # by descriptor
        self._unmarked: dict[int, _Connection] = {}  # not authenticated yet, oldest first
        self._early: set[int] = set()  # marked before their accept event was read
        self.unmarked = 0
        self.closing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{owner}", daemon=True)
        self._thread.start()

    def mark(self, fd: int) -> None:
        """A valid signed message came from descriptor ``fd``: it is authenticated (any thread)."""
        with self._lock:
            conn = self._unmarked.pop(fd, None)
            if conn is None:
                if fd not in self._connections:
                    self._early.add(fd)
            else:
                conn.marked = True
            self.unmarked = len(self._unmarked)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._zap.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self._zap.socket in events:
                    self._zap.answer()
                if self._monitor in events:
                    self._drain()
                self._enforce(time.monotonic())
        except zmq.ZMQError:
            pass
        finally:
            self._monitor.close(linger=0)
            self._zap.close()

    def _drain(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                conn = _Connection(_peername(fd), time.monotonic())
                with self._lock:
                    self._connections[fd] = conn
                    if fd in self._early:
                        self._early.discard(fd)
                        conn.marked = True
                    else:
                        self._unmarked[fd] = conn
                    self.unmarked = len(self._unmarked)
            elif kind == zmq.EVENT_DISCONNECTED:
                with self._lock:
                    gone = self._connections.pop(fd, None)
                    if fd in self._unmarked:
                        del self._unmarked[fd]
                    self._early.discard(fd)
                    self.unmarked = len(self._unmarked)
                if gone is None or self.closing or gone.evicted:
                    continue
                if gone.marked:
                    logger.info("%s: connection from %s closed", self._owner, gone.peer or "<unknown>")
                else:
                    self._reject(
                        "ZMQ connection closed before it authenticated (no or wrong credentials, not a "
                        "ZMQ peer, an oversized frame, or the handshake timeout)",
                        gone.peer,
                    )

    def _enforce(self, now: float) -> None:
        """Trust what outlived the handshake timeout; close the oldest waiting ones over the cap."""
        trusted_after = self._limits.preauth_timeout_s + 1.0
        doomed: list[tuple[int, _Connection]] = []
        with self._lock:
            while self._unmarked:
                fd, conn = next(iter(self._unmarked.items()))
                if now - conn.accepted < trusted_after:
                    break
                del self._unmarked[fd]
                conn.marked = True
            while self._unmarked:
                fd, conn = next(iter(self._unmarked.items()))
                if not over_cap(
                    len(self._unmarked), now - conn.accepted, self._limits.preauth_max_connections
                ):
                    break
                del self._unmarked[fd]
                conn.evicted = True
                doomed.append((fd, conn))
            self.unmarked = len(self._unmarked)
        for fd, conn in doomed:
            _shutdown(fd, conn.peer)
            self._reject(
                f"over {self._limits.preauth_max_connections} ZMQ connections waiting to authenticate "
                "(runtime.rpc.preauth_max_connections): closed the oldest",
                conn.peer,
            )

    def close(self) -> None:
        self.closing = True
        self._stop.set()
        self._thread.join(timeout=5)


def _peername(fd: int) -> str:
    try:
        dup = os.dup(fd)
    except OSError:
        return ""
    try:
        with socket.socket(fileno=dup) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return ""


def _shutdown(fd: int, peer: str) -> None:
    """End libzmq's connection on ``fd`` (it sees the end of the stream and closes it), unless the
    descriptor has meanwhile been closed and reused for another peer."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        with socket.socket(fileno=dup) as s:
            host, port = s.getpeername()[:2]
            if f"{host}:{port}" == peer:
                s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
