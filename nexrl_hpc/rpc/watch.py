"""Watching a listening ZMQ socket for connections that never become valid messages.

libzmq drops such connections silently: random bytes fail the ZMTP handshake, and a frame over
``MAXMSGSIZE`` makes it close the connection right after the handshake. ``ConnectionWatch`` reads
the socket's monitor and reports both (with the peer's address) to a ``reject`` callback, so that
they are counted and logged like any other refused message. Used by the RPC endpoint's ROUTER and
by trainer rank 0's ROUTER.

Threads: the thread that polls the monitor socket (``socket``) calls ``drain`` when it is readable;
one thread only, no locks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

_SUSPICIOUS_LIFETIME_S = 5.0


class ConnectionWatch:
    """Counts what never becomes a valid message on a listening socket: connections that fail the
    ZMTP handshake (random bytes) and connections libzmq drops right after it (a frame over
    MAXMSGSIZE). Reads the socket's monitor; ``drain`` when the monitor socket is readable."""

    def __init__(self, sock: zmq.Socket, reject: Callable[[str, str], None], owner: str):
        events = (
            zmq.EVENT_ACCEPTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        self.socket = sock.get_monitor_socket(events)
        self._reject = reject
        self._owner = owner
        self._accepted: dict[int, tuple[str, float, bool]] = {}  # fd -> (peer, accept time, handshaken)

    def drain(self, closing: bool = False) -> None:
        while True:
            try:
                event = parse_monitor_message(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted[value] = (_peername(value), time.monotonic(), False)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # libzmq does not say which connection: handshakes complete in accept order
                for fd, (peer, t0, done) in self._accepted.items():
                    if not done:
                        self._accepted[fd] = (peer, t0, True)
                        break
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._reject("ZMTP handshake failed", "")
            elif kind == zmq.EVENT_DISCONNECTED and not closing:
                peer, t0, handshaken = self._accepted.pop(value, ("", 0.0, True))
                if not handshaken:
                    self._reject("connection closed before a valid ZMTP handshake (not a ZMQ peer)", peer)
                elif time.monotonic() - t0 < _SUSPICIOUS_LIFETIME_S:
                    # peers stay connected for the whole run; a drop right after the handshake is
                    # libzmq refusing a frame over the size limit (or another protocol violation)
                    self._reject(
                        "connection dropped right after its handshake (oversized frame or protocol violation)",
                        peer,
                    )
                else:
                    logger.info("%s: connection from %s closed", self._owner, peer or "<unknown>")

    def close(self) -> None:
        self.socket.close(linger=0)


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
