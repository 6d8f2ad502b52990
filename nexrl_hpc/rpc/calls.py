"""The caller side of an RPC endpoint: pending calls and the per-peer sending sockets with their outbox.

Requests and replies both travel to the destination's ROUTER, so a caller (or a server thread
answering) sends straight from its own thread on the peer's DEALER — no hand-off to another thread
on the way out. Every sending thread signs with a sender id of its own (per-thread sequence
numbers, so the receiver's replay guard sees each sender's messages in order). A small request to a
``@quick`` method while another to the same peer is unanswered waits in the peer's outbox and
leaves with the others that queue meanwhile, as one signed message, when an answer comes in (or
at 64 requests / 256 KiB, or when someone waits on one of them): Nagle's rule, per peer.

Locks and threads:
- ``Peer.lock`` (one per peer): held while a message is signed and sent on the peer's DEALER, and
  around the peer's outbox and ``quick_in_flight``; any thread, one at a time per peer.
- ``Calls._pending_lock``: around ``_pending`` (the unanswered calls), any thread; never held while
  a ``Peer.lock`` is taken.
- ``complete`` and ``expire`` run on the endpoint's IO thread; the rest on any thread.
- ``dead`` is written by ``fail_peer`` (one writer at a time) and read without a lock.

Every message names its recipient (``to``) and sender rank (``src``) under the signature; call ids
come from one counter per endpoint shared with the direct lanes (``call_ids``), starting at a random
point, and a reply completes a call only if it comes from the rank the call went to. A DEALER
authenticates with the ZMTP PLAIN password derived from the key and sends a hello at once, so the
peer's ROUTER counts the connection as authenticated (``nexrl_hpc/rpc/watch.py``); parts over
``FRAME_BYTES`` travel cut into frames (the peer's frame limit is the pre-authentication budget).
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgpack
import zmq

from nexrl_hpc.rpc.codec import decode, encode
from nexrl_hpc.rpc.limits import (
    BATCH_REQUESTS,
    HELD_BATCH_BYTES,
    HOLD_REPLY_BYTES,
    ZERO_COPY_BYTES,
    MessageTooLarge,
    message_size,
    over_limit,
)
from nexrl_hpc.rpc.preauth import FRAME_BYTES, WireLimits, cut_frames, secure_client
from nexrl_hpc.rpc.wire import seal_message

_SNDMORE = int(zmq.SNDMORE)


class PeerDeadError(ConnectionError):
    """The rank a call went to was declared dead."""


class CallTimeout(TimeoutError):
    pass


class RpcFuture(Future):
    """Resolves with the raw reply; the caller's thread decodes it on ``result()``."""

    def __init__(self, resolve_handle: Callable[[str], Any] | None):
        super().__init__()
        self._resolve_handle = resolve_handle
        self._decoded = False
        self._value: Any = None
        self.send_queued: Callable[[], None] | None = None  # set while the request waits in an outbox

    def result(self, timeout: float | None = None) -> Any:
        if self.send_queued is not None and not self.done():
            self.send_queued()  # whoever waits for a queued request sends it now
        raw = super().result(timeout)
        if not self._decoded:
            payload, buffers, ok = raw
            self._value = (decode(payload, buffers, self._resolve_handle), ok)
            self._decoded = True
        value, ok = self._value
        if not ok:
            raise value
        return value


class Peer:
    """The sending side towards one rank: a DEALER any thread may use, one at a time (``lock``)."""

    __slots__ = ("socket", "lock", "address", "rank", "quick_in_flight", "outbox", "outbox_bytes")

    def __init__(self, sock: zmq.Socket, address: str, rank: int):
        self.socket, self.lock, self.address, self.rank = sock, threading.Lock(), address, rank
        # asynchronous quick calls (under ``lock``): how many are unanswered, and the requests that
        # wait for an answer before leaving together (Nagle's rule, per peer)
        self.quick_in_flight = 0
        self.outbox: list[list[Any]] = []  # [call id, module, method, payload]
        self.outbox_bytes = 0


class Pending:
    __slots__ = ("future", "rank", "what", "deadline", "quick_peer")

    def __init__(self, future: Future, rank: int, what: str, deadline: float, quick_peer: Peer | None = None):
        self.future, self.rank, self.what, self.deadline = future, rank, what, deadline
        self.quick_peer = quick_peer  # an async quick call counted in that peer's quick_in_flight


class Calls:
    """Sends requests (and the server's replies) to the peers and tracks the unanswered calls."""

    def __init__(
        self,
        rank: int,
        key: bytes,
        max_message_bytes: int,
        call_timeout_s: float,
        limits: WireLimits,
        call_ids: Iterator[int],
        resolve_handle: Callable[[str], Any] | None = None,
    ):
        self.rank = rank
        self._key = key
        self._limits = limits
        self._max_bytes = max_message_bytes
        self._call_timeout = call_timeout_s
        self._resolve_handle = resolve_handle
        self.peers: dict[int, Peer] = {}
        self.dead: dict[int, str] = {}
        self.closing = False
        self.io_thread: threading.Thread | None = None  # the thread that must never wait for a reply
        self._local = threading.local()
        self._pending: dict[int, Pending] = {}
        self._pending_lock = threading.Lock()
        self._ids = call_ids
        self._sender_ids = itertools.count()

    def connect(self, ctx: zmq.Context, rank: int, address: str) -> None:
        """Open a DEALER to ``rank``'s ROUTER at ``address`` and say hello (authenticates it there)."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"r{self.rank}".encode())
        secure_client(sock, self._key, self._limits)
        sock.connect(address)
        peer = Peer(sock, address, rank)
        self.peers[rank] = peer
        with peer.lock:
            self._send_locked(peer, {"t": "hi", "src": self.rank, "to": rank}, b"", [])

    # --- calls ----------------------------------------------------------------------------------
    def call_async(
        self,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
        quick: bool = False,
    ) -> Future:
        """Send a request; the future resolves with the reply (a small quick request may wait in
        the peer's outbox, see the module docstring)."""
        future = RpcFuture(self._resolve_handle)
        peer = self.peer_for_call(rank, module, method)
        if isinstance(peer, Exception):
            future.set_exception(peer)
            return future
        call_id = next(self._ids)
        payload, buffers = encode([list(args), kwargs])
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        batchable = quick and not buffers and len(payload) <= HOLD_REPLY_BYTES
        with self._pending_lock:
            self._pending[call_id] = Pending(
                future, rank, f"{module}.{method}", deadline, peer if batchable else None
            )
        if batchable:
            with peer.lock:
                peer.quick_in_flight += 1
                if peer.quick_in_flight > 1:  # an earlier one is unanswered: its answer sends this
                    peer.outbox.append([call_id, module, method, payload])
                    peer.outbox_bytes += len(payload)
                    if len(peer.outbox) >= BATCH_REQUESTS or peer.outbox_bytes >= HELD_BATCH_BYTES:
                        self._flush_outbox_locked(peer)
                    else:
                        future.send_queued = lambda: self.flush_outbox(peer)
                    return future
                error = self._send_locked(peer, self.request(call_id, rank, module, method), payload, [])
        else:
            error = self.send(peer, self.request(call_id, rank, module, method), payload, buffers)
        if error is not None:
            with self._pending_lock:
                self._pending.pop(call_id, None)
            future.set_exception(MessageTooLarge(f"{module}.{method}: {error}"))
        return future

    def peer_for_call(self, rank: int, module: str, method: str) -> Peer | Exception:
        """The peer a call goes to, or why it cannot be sent (a dead or unknown rank)."""
        if threading.current_thread() is self.io_thread:  # would wait for a reply only it can read
            raise RuntimeError(
                f"{module}.{method} called from a @quick method: quick methods must not call other modules"
            )
        if rank in self.dead:
            return PeerDeadError(f"rank {rank} is dead ({self.dead[rank]}); {module}.{method} not sent")
        peer = self.peers.get(rank)
        if peer is None:
            return PeerDeadError(f"no connection to rank {rank}; {module}.{method} not sent")
        return peer

    def request(self, call_id: int, rank: int, module: str, method: str) -> dict[str, Any]:
        return {"t": "req", "id": call_id, "src": self.rank, "to": rank, "m": module, "f": method}

    # --- answers (IO thread) --------------------------------------------------------------------
    def complete(self, call_id: int, body: bytes, buffers: list[bytes], ok: bool, src: int) -> bool:
        """Resolve call ``call_id`` with a reply from rank ``src``; False when that call went to
        another rank (the reply is not its answer and is dropped)."""
        with self._pending_lock:
            pending = self._pending.get(call_id)
            if pending is None:  # late: the call already timed out or failed
                return True
            if pending.rank != src:
                return False
            del self._pending[call_id]
        if pending.quick_peer is not None:
            self._quick_answered([pending])
        if not pending.future.done():
            pending.future.set_result((body, buffers, ok))
        return True

    def expire(self, now: float) -> None:
        with self._pending_lock:
            late = [cid for cid, p in self._pending.items() if p.deadline <= now]
            pendings = [self._pending.pop(cid) for cid in late]
        self._quick_answered(pendings)
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(
                    CallTimeout(f"{p.what} on rank {p.rank}: no reply before the deadline")
                )

    def _quick_answered(self, pendings: list[Pending]) -> None:
        """Answered, failed or expired async quick calls: the queue behind them may leave."""
        for p in pendings:
            peer = p.quick_peer
            if peer is not None:
                with peer.lock:
                    peer.quick_in_flight = max(0, peer.quick_in_flight - 1)

    def fail_peer(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead: fail its pending calls now, refuse new ones."""
        self.dead[rank] = reason
        peer = self.peers.get(rank)
        if peer is not None:  # its queued requests will never leave (their futures fail below)
            with peer.lock:
                peer.outbox, peer.outbox_bytes, peer.quick_in_flight = [], 0, 0
        with self._pending_lock:
            doomed = [cid for cid, p in self._pending.items() if p.rank == rank]
            pendings = [self._pending.pop(cid) for cid in doomed]
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(PeerDeadError(f"rank {rank} is dead ({reason}); {p.what} failed"))

    # --- sending (any thread) -------------------------------------------------------------------
    def send(self, peer: Peer, envelope: dict[str, Any], payload: bytes, buffers: list[Any]) -> str | None:
        """Sign and send; returns why not when the message is over the size limit. A request leaves
        after the queued ones (one connection, one order)."""
        with peer.lock:
            if peer.outbox and envelope["t"] == "req":
                self._flush_outbox_locked(peer)
            return self._send_locked(peer, envelope, payload, buffers)

    def flush_outbox(self, peer: Peer) -> None:
        with peer.lock:
            if peer.outbox:
                self._flush_outbox_locked(peer)

    def flush_outboxes(self) -> None:
        for peer in self.peers.values():
            if peer.outbox:
                self.flush_outbox(peer)

    def _flush_outbox_locked(self, peer: Peer) -> None:
        """Send the queued quick requests (``peer.lock`` held): one signed message for them all."""
        items, peer.outbox, peer.outbox_bytes = peer.outbox, [], 0
        if len(items) == 1:
            call_id, module, method, payload = items[0]
            self._send_locked(peer, self.request(call_id, peer.rank, module, method), payload, [])
        else:
            self._send_locked(
                peer, {"t": "reqs", "src": self.rank, "to": peer.rank}, msgpack.packb(items), []
            )

    def _send_locked(
        self, peer: Peer, envelope: dict[str, Any], payload: bytes, buffers: list[Any]
    ) -> str | None:
        local = self._local
        if not hasattr(local, "sender"):  # unique per thread for the endpoint's life (idents get reused)
            local.sender = f"{self.rank}:{os.getpid()}:{next(self._sender_ids)}"
            local.seq = 0
        local.seq += 1
        envelope["s"], envelope["q"] = local.sender, local.seq
        if buffers or len(payload) > FRAME_BYTES:  # the peer takes frames up to its pre-auth budget
            parts, counts = cut_frames([payload, *buffers])
            if counts is not None:
                envelope["k"] = counts
                payload, buffers = parts[0], parts[1:]
        frames = seal_message(self._key, msgpack.packb(envelope), payload, buffers)
        size = message_size(frames)
        if size > self._max_bytes:  # the receiver would drop it: fail here, loudly
            return over_limit(size, self._max_bytes)
        if not self.closing:  # zero-copy pays off only for big buffers; small frames are cheaper copied
            _send_frames(peer.socket, frames, size < ZERO_COPY_BYTES)
        return None

    def close(self) -> None:
        """Close the DEALERs and fail every unanswered call (after the IO thread stopped)."""
        for peer in self.peers.values():
            with peer.lock:
                peer.socket.close(linger=0)
        with self._pending_lock:
            pendings = list(self._pending.values())
            self._pending.clear()
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(
                    PeerDeadError(f"endpoint of rank {self.rank} closed; {p.what} abandoned")
                )


def new_call_ids() -> Iterator[int]:
    """Call ids of one endpoint (ZMQ and lanes alike), from a random start: unique per caller, and
    a reply recorded from another process never matches a call of this one."""
    return itertools.count(secrets.randbits(40) + 1)


def _send_frames(sock: zmq.Socket, frames: list[Any], copy: bool, routing_id: bytes | None = None) -> None:
    """Send one message; a single frame skips ``send_multipart``'s per-frame flag handling."""
    if routing_id is not None:
        sock.send(routing_id, _SNDMORE)
    if len(frames) == 1:
        sock.send(frames[0], copy=copy)
    else:
        sock.send_multipart(frames, copy=copy)
