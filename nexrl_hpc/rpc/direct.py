"""The direct-lane client pool: blocking calls to ``@quick`` methods on connections of the caller's own.

The caller borrows a TCP connection to the peer's direct lane (``nexrl_hpc/rpc/lane.py``), writes
its signed request, blocks reading the reply itself and gives the connection back: no thread
hand-off on either side and no libzmq IO threads in between. At most ``max_per_peer`` connections
per peer; a caller that finds them all lent gets None from ``borrow`` (it takes the queued path).
Each connection signs with a sender id of its own, so its sequence numbers stay in order, and
opens with a small signed hello (the lane server gives a connection only a small pre-authentication
budget until one arrives). Requests name the peer (``to``), replies must name this rank and the
call's id. A connection left mid-call (timeout, error) may still get a late reply: it is closed,
never reused.

Locks and threads: any caller thread. ``_lock`` guards every peer's idle list and connection
count (held only to borrow, give back or count, never during I/O); a borrowed connection belongs
to its caller alone until it is given back. ``closing`` and the shared ``dead`` map are read
without a lock (a caller looks at them every ``DIRECT_WAKE_S`` while it waits).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgpack

from nexrl_hpc.rpc.calls import CallTimeout, PeerDeadError
from nexrl_hpc.rpc.codec import decode, encode
from nexrl_hpc.rpc.lane import RECV_BYTES, LaneReader, connect_lane, lane_parts, send_parts
from nexrl_hpc.rpc.limits import WIRE_ERRORS, MessageTooLarge, message_size, over_limit
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, check_request, open_message, seal_message

DIRECT_WAKE_S = 0.1  # a direct caller looks at deadline, dead peers and close this often


class DirectConnection:
    """A caller's own connection to one peer's lane: it sends a request and reads the reply on it."""

    __slots__ = ("socket", "sender", "seq", "reader")

    def __init__(self, sock: socket.socket, sender: str, max_bytes: int):
        self.socket, self.sender, self.seq = sock, sender, 0
        self.reader = LaneReader(max_bytes)


class LanePeer:
    """One peer's lane (None: it has none) and the connections to it: idle ones and how many exist."""

    __slots__ = ("lane", "idle", "count")

    def __init__(self, lane: str | None):
        self.lane = lane
        self.idle: list[DirectConnection] = []
        self.count = 0  # idle + lent


class DirectPool:
    """Lane connections per peer, lent to one caller at a time, and the blocking call on them."""

    def __init__(
        self,
        rank: int,
        key: bytes,
        max_message_bytes: int,
        call_timeout_s: float,
        max_per_peer: int,
        guard: SequenceGuard,
        reject: Callable[[str, str], None],
        dead: Mapping[int, str],
        call_ids: Iterator[int],
        resolve_handle: Callable[[str], Any] | None = None,
    ):
        self.rank = rank
        self._key = key
        self._max_bytes = max_message_bytes
        self._call_timeout = call_timeout_s
        self._max_per_peer = max_per_peer
        self._guard = guard
        self._reject = reject
        self._dead = dead  # the ranks declared dead (owned by the caller side)
        self._resolve_handle = resolve_handle
        self.peers: dict[int, LanePeer] = {}
        self.closing = False
        self._lock = threading.Lock()
        self._ids = call_ids
        self._connection_ids = itertools.count()

    def add_peer(self, rank: int, lane: str | None) -> None:
        self.peers[rank] = LanePeer(lane)

    def borrow(self, rank: int, module: str, method: str) -> DirectConnection | None:
        """An idle or new connection to ``rank``'s lane, or None (no lane, or all of them lent)."""
        if self.closing:
            raise PeerDeadError(f"endpoint of rank {self.rank} closed; {module}.{method} not sent")
        peer = self.peers.get(rank)
        if peer is None or peer.lane is None:
            return None
        with self._lock:
            if self.closing:
                raise PeerDeadError(f"endpoint of rank {self.rank} closed")
            if peer.idle:
                return peer.idle.pop()
            if peer.count >= self._max_per_peer:
                return None
            peer.count += 1
            number = next(self._connection_ids)
        try:
            sock = connect_lane(peer.lane, DIRECT_WAKE_S)
        except OSError as exc:
            with self._lock:
                peer.count -= 1
            raise PeerDeadError(
                f"rank {rank}'s direct lane {peer.lane} refused the connection ({exc}); {module}.{method} not sent"
            ) from exc
        return DirectConnection(sock, f"{self.rank}:{os.getpid()}:d{number}", self._max_bytes)

    def call(
        self,
        direct: DirectConnection,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> Any:
        """Call on a borrowed connection, give it back, and return the result (or raise the remote
        exception)."""
        healthy = False
        try:
            value, ok = self._call_on(direct, rank, module, method, args, kwargs, timeout)
            healthy = direct.reader.idle
        except MessageTooLarge:
            healthy = True  # refused before sending: the connection is untouched
            raise
        finally:  # a connection left mid-call may still get a late reply: it is never reused
            self._give_back(self.peers[rank], direct, healthy)
        if not ok:
            raise value
        return value

    def _give_back(self, peer: LanePeer, direct: DirectConnection, healthy: bool) -> None:
        with self._lock:
            if healthy and not self.closing:
                peer.idle.append(direct)
                return
            peer.count -= 1
        direct.socket.close()

    def _call_on(
        self,
        direct: DirectConnection,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> tuple[Any, bool]:
        """Send the request on ``direct`` and read its reply: (value or remote exception, ok)."""
        call_id = next(self._ids)
        payload, buffers = encode([list(args), kwargs])
        parts: list[Any] = []
        if direct.seq == 0:  # a new connection: the hello authenticates it before the request
            direct.seq += 1
            hello = {"t": "hi", "src": self.rank, "to": rank, "s": direct.sender, "q": direct.seq}
            parts = lane_parts(seal_message(self._key, msgpack.packb(hello), b"", []))
        direct.seq += 1
        envelope = {
            "t": "req",
            "id": call_id,
            "src": self.rank,
            "to": rank,
            "m": module,
            "f": method,
            "s": direct.sender,
            "q": direct.seq,
        }
        frames = seal_message(self._key, msgpack.packb(envelope), payload, buffers)
        size = message_size(frames)
        if size > self._max_bytes:
            raise MessageTooLarge(f"{module}.{method}: {over_limit(size, self._max_bytes)}")
        sock = direct.socket
        try:
            send_parts(sock, parts + lane_parts(frames))
        except OSError as exc:
            raise PeerDeadError(
                f"rank {rank}: direct lane failed ({exc}); {module}.{method} not sent"
            ) from exc
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        return self._await_reply(direct, rank, module, method, call_id, deadline)

    def _await_reply(
        self, direct: DirectConnection, rank: int, module: str, method: str, call_id: int, deadline: float
    ) -> tuple[Any, bool]:
        """Read ``direct`` until the reply to ``call_id`` is whole: (value or remote exception, ok)."""
        sock = direct.socket
        while True:
            if rank in self._dead:
                raise PeerDeadError(f"rank {rank} is dead ({self._dead[rank]}); {module}.{method} failed")
            if self.closing:
                raise PeerDeadError(f"endpoint of rank {self.rank} closed; {module}.{method} abandoned")
            if time.monotonic() >= deadline:
                raise CallTimeout(f"{module}.{method} on rank {rank}: no reply before the deadline")
            try:  # a blocking receive that wakes every 0.1 s to look at the peer's state
                data = sock.recv(RECV_BYTES)
            except TimeoutError:
                continue
            except OSError as exc:
                raise PeerDeadError(
                    f"rank {rank}: direct lane failed ({exc}); {module}.{method} failed"
                ) from exc
            if not data:
                raise PeerDeadError(f"rank {rank} closed its direct lane; {module}.{method} failed")
            try:
                messages = direct.reader.feed(data)
            except RejectedMessage as exc:
                self._reject(f"direct lane: {exc}", _sock_peer(sock))
                raise ConnectionError(
                    f"rank {rank}: unreadable reply on the direct lane; {module}.{method} failed"
                ) from exc
            if not messages:
                continue
            if len(messages) > 1:  # one request, one reply: anything more is not from our peer
                self._reject("direct lane: unrequested message", _sock_peer(sock))
                raise ConnectionError(
                    f"rank {rank}: unrequested message on the direct lane; {module}.{method} failed"
                )
            envelope, body, out_buffers = self._open_reply(messages[0], call_id, sock, rank)
            return decode(body, out_buffers, self._resolve_handle), bool(envelope["ok"])

    def _open_reply(
        self, frames: list[bytes], call_id: int, sock: socket.socket, rank: int
    ) -> tuple[dict[str, Any], Any, list[Any]]:
        try:
            envelope_bytes, rest = open_message(self._key, frames, self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            check_request(envelope, self.rank, ("rep",))
            if not rest:
                raise RejectedMessage("not a reply")
            if envelope["id"] != call_id or envelope["src"] != rank:
                raise RejectedMessage(
                    f"a reply to call {envelope['id']} from rank {envelope['src']}, expected {call_id} from {rank}"
                )
            self._guard.check(envelope["s"], envelope["q"])
        except WIRE_ERRORS as exc:
            self._reject(f"direct lane: {exc}", _sock_peer(sock))
            raise ConnectionError(f"rank {rank}: rejected reply on the direct lane ({exc})") from exc
        return envelope, rest[0], rest[1:]

    def close(self, wait_s: float = 0.5) -> int:
        """Close the idle connections; wait briefly for lent ones (their callers see ``closing``
        within one poll and close them). Returns how many are still lent."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                idle = [d for peer in self.peers.values() for d in peer.idle]
                for peer in self.peers.values():
                    peer.count -= len(peer.idle)
                    peer.idle.clear()
                lent = sum(peer.count for peer in self.peers.values())
            for direct in idle:
                direct.socket.close()
            if lent == 0 or time.monotonic() >= deadline:
                return lent
            time.sleep(0.02)


def _sock_peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return ""
