"""The lane server: answers blocking ``@quick`` calls on the direct lane (``nexrl_hpc/rpc/lane.py``).

Accepts TCP connections on the lane's listening socket, reads signed requests from them, checks
each (size, HMAC, recipient, sender sequence) before decoding it, runs the quick method right away
and writes the reply on the same connection. Only ``@quick`` methods are served; anything else is
answered with a ``PermissionError``. Writes never block: what the kernel does not take waits for
the socket to become writable. A connection that sends anything but well-formed signed requests is
counted, logged with its address and closed.

Before a connection has sent a valid signed message (the caller's first is a small hello), it may
announce at most ``preauth_max_bytes`` and must authenticate within ``preauth_timeout_s``; at most
``preauth_max_connections`` such connections wait at once (beyond, the oldest is closed:
``preauth.over_cap``). An
authenticated connection that stops midway through a message for ``preauth_timeout_s`` is closed.

The lane's sockets wait in a selector of their own (epoll on Linux): the endpoint's IO thread polls
only its descriptor (``fileno``) next to the ROUTER, so a rank with hundreds of lane connections
still polls four items per wake-up, and calls ``on_ready`` when it is readable.

Threads and locks: IO thread only (``on_ready``, ``tick``, ``close``), no locks; the shared
``SequenceGuard`` has a lock of its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable

import msgpack

from nexrl_hpc.rpc.codec import encode, encode_exception
from nexrl_hpc.rpc.invoke import Invoker, raiser
from nexrl_hpc.rpc.lane import RECV_BYTES, SENDMSG_MAX_BUFFERS, LaneReader, drop_sent, lane_parts, listen_lane
from nexrl_hpc.rpc.limits import WIRE_ERRORS, MessageTooLarge, message_size, over_limit
from nexrl_hpc.rpc.preauth import WireLimits, has_unread_bytes, over_cap
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, check_request, open_message, seal_message

logger = logging.getLogger(__name__)

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class LaneClient:
    """The server side of one accepted lane connection."""

    __slots__ = ("socket", "peer", "reader", "unsent", "waiting", "sender", "seq", "authed", "since")

    def __init__(self, sock: socket.socket, peer: str, sender: str, preauth_bytes: int, now: float):
        self.socket, self.peer, self.sender, self.seq = sock, peer, sender, 0
        self.reader = LaneReader(preauth_bytes)  # raised to the message limit once authenticated
        self.unsent: list[memoryview] = []  # reply bytes the kernel has not taken yet
        self.waiting = False  # registered for writability (``unsent`` is not empty)
        self.authed = False  # a valid signed message came in
        self.since = now  # accepted at (before authentication), or the last bytes received at


class LaneServer:
    """The listening lane socket of one rank and its accepted connections."""

    def __init__(
        self,
        rank: int,
        host: str,
        key: bytes,
        max_message_bytes: int,
        guard: SequenceGuard,
        invoker: Invoker,
        reject: Callable[[str, str], None],
        limits: WireLimits,
    ):
        self.rank = rank
        self._key = key
        self._max_bytes = max_message_bytes
        self._limits = limits
        self._guard = guard
        self._invoker = invoker
        self._reject = reject
        self._listener, self.address = listen_lane(host)
        self._listener_fd = self._listener.fileno()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener_fd, _READ)
        self.clients: dict[int, LaneClient] = {}  # by file descriptor
        self._unauthed: dict[int, LaneClient] = {}  # not authenticated yet, oldest first
        self._next_stall_check = 0.0
        self._accepts_paused_until: float | None = None
        self._sender_prefix = f"{rank}:{os.getpid()}:io"  # + ">lane<n>", one sender per connection
        self._connection_ids = itertools.count()

    def fileno(self) -> int:
        """The selector's descriptor: readable when a lane socket has something to do."""
        return self._selector.fileno()

    def on_ready(self) -> None:
        """Accept, read, serve and write whatever is ready now (never blocks)."""
        for key, what in self._selector.select(0):
            self._on_event(key.fd, what)

    def tick(self, now: float) -> None:
        """Resume accepting once a pause after a failed accept is over; close connections that did
        not authenticate in time, and (every second) authenticated ones stalled midway."""
        paused = self._accepts_paused_until
        if paused is not None and now >= paused:
            self._accepts_paused_until = None
            self._selector.register(self._listener_fd, _READ)
        self._cap(now)
        timeout = self._limits.preauth_timeout_s
        while self._unauthed:
            fd, client = next(iter(self._unauthed.items()))
            if now - client.since < timeout:
                break
            self._reject(
                f"direct lane: not authenticated within {timeout:g} s (runtime.rpc.preauth_timeout_s)",
                client.peer,
            )
            self._drop(fd)
        if now >= self._next_stall_check:
            self._next_stall_check = now + 1.0
            for fd, client in list(self.clients.items()):
                if client.authed and not client.reader.idle and now - client.since >= timeout:
                    self._reject(f"direct lane: a message stalled midway for {timeout:g} s", client.peer)
                    self._drop(fd)

    def _on_event(self, fd: int, what: int) -> None:
        if fd == self._listener_fd:
            self._accept()
            return
        client = self.clients.get(fd)
        if client is None:
            return
        if what & _WRITE:
            self._flush(fd, client)
        if what & _READ and fd in self.clients:
            self._read(fd, client)

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, ...: stop accepting for a second (the listener
                # would stay readable and spin this thread); waiting peers are accepted afterwards
                logger.warning(
                    "rank %d: direct lane accept failed (%s): pausing accepts for 1 s", self.rank, exc
                )
                self._selector.unregister(self._listener_fd)
                self._accepts_paused_until = time.monotonic() + 1.0
                return
            peer = f"{address[0]}:{address[1]}"
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = sock.fileno()
            sender = f"{self._sender_prefix}>lane{next(self._connection_ids)}"
            client = LaneClient(sock, peer, sender, self._limits.preauth_max_bytes, time.monotonic())
            self.clients[fd] = client
            self._unauthed[fd] = client
            self._selector.register(fd, _READ)
            self._cap(client.since)

    def _cap(self, now: float) -> None:
        """Close the oldest connections waiting to authenticate while over the cap (never the run's own)."""
        cap = self._limits.preauth_max_connections
        if not over_cap(len(self._unauthed), float("inf"), cap):
            return
        for fd, client in list(self._unauthed.items()):  # oldest first
            if not over_cap(len(self._unauthed), now - client.since, cap):
                return
            if has_unread_bytes(client.socket):  # its first message is here: read it first
                continue
            self._reject(
                f"direct lane: over {cap} connections waiting to authenticate "
                "(runtime.rpc.preauth_max_connections): closed the oldest",
                client.peer,
            )
            self._drop(fd)

    def _read(self, fd: int, client: LaneClient) -> None:
        try:
            data = client.socket.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(fd)
            return
        if client.authed:
            client.since = time.monotonic()  # progress: not stalled
        reader = client.reader
        reader.add(data)
        try:
            while (frames := reader.next_message()) is not None:
                self._serve(client, frames)
                if not client.authed:  # the first valid message: the full limit from now on
                    client.authed = True
                    client.since = time.monotonic()
                    reader.max_bytes = self._max_bytes
                    self._unauthed.pop(fd, None)
        except WIRE_ERRORS as exc:
            self._reject(f"direct lane: {exc}", client.peer)
            self._drop(fd)
            return
        except Exception as exc:  # a bug must cost one connection, never the IO thread
            logger.exception("rank %d: direct lane request from %s failed", self.rank, client.peer)
            self._reject(f"direct lane: {type(exc).__name__}: {exc}", client.peer)
            self._drop(fd)
            return
        self._flush(fd, client)

    def _serve(self, client: LaneClient, frames: list[bytes]) -> None:
        """Check, run and answer one request (raises what a bad message raises, before decoding);
        a hello only authenticates the connection."""
        envelope_bytes, rest = open_message(self._key, frames, self._max_bytes)
        envelope = msgpack.unpackb(envelope_bytes, raw=False)
        kind = check_request(envelope, self.rank, ("req", "hi"))
        if not rest:
            raise RejectedMessage("no payload")
        self._guard.check(envelope["s"], envelope["q"])
        if kind == "hi":
            return
        fn = self._invoker.find(envelope["m"], envelope["f"])
        if not getattr(fn, "__nexrl_quick__", False):
            fn = raiser(
                PermissionError(
                    f"{envelope['m']}.{envelope['f']} is not @quick: it cannot be called directly"
                )
            )
        ok, body, out_buffers = self._invoker.run(fn, rest[0], rest[1:])
        client.seq += 1
        reply = {
            "t": "rep",
            "id": envelope["id"],
            "ok": ok,
            "src": self.rank,
            "to": envelope["src"],
            "s": client.sender,
            "q": client.seq,
        }
        frames_out = seal_message(self._key, msgpack.packb(reply), body, out_buffers)
        size = message_size(frames_out)
        if size > self._max_bytes:
            error = MessageTooLarge(
                f"{envelope['m']}.{envelope['f']} reply: {over_limit(size, self._max_bytes)}"
            )
            body, out_buffers = encode(encode_exception(error))
            reply["ok"] = False
            frames_out = seal_message(self._key, msgpack.packb(reply), body, out_buffers)
        client.unsent.extend(memoryview(p).cast("B") for p in lane_parts(frames_out))

    def _flush(self, fd: int, client: LaneClient) -> None:
        """Write what the kernel takes now; wait for POLLOUT for the rest (a slow reader never
        blocks the IO thread)."""
        out = client.unsent
        while out:
            try:
                drop_sent(out, client.socket.sendmsg(out[:SENDMSG_MAX_BUFFERS]))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(fd)
                return
        if bool(out) != client.waiting:
            client.waiting = bool(out)
            self._selector.modify(fd, _READ | (_WRITE if out else 0))

    def _drop(self, fd: int) -> None:
        client = self.clients.pop(fd, None)
        self._unauthed.pop(fd, None)
        if client is None:
            return
        try:
            self._selector.unregister(fd)
        except KeyError:
            pass
        client.socket.close()

    def close(self) -> None:
        """Close every connection, the selector and the listening socket."""
        for fd in list(self.clients):
            self._drop(fd)
        self._selector.close()
        self._listener.close()
