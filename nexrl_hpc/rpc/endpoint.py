"""One RPC endpoint per rank: a ZMQ ROUTER that receives, a DEALER per peer that sends.

Requests and replies both travel to the destination's ROUTER, so a caller (or a server thread
answering) sends straight from its own thread on the peer's DEALER (one lock per peer keeps each
sender's messages in order) — no hand-off to another thread on the way out. One IO thread owns
the ROUTER: it checks every message (size, HMAC, sender sequence) before decoding anything,
queues requests for a thread pool and completes the futures of replies. Calls to ``@long_poll``
methods (they wait for work) run in a pool of their own, so callers waiting in them never hold
the threads every other call needs. Failures are dropped, counted and logged with the peer
address. A call to a rank declared dead fails at once; every call has a deadline, so nothing
waits forever.

Blocking calls to ``@quick`` methods take a shorter road (``call_direct``): the caller borrows a
TCP connection of its own to the peer's *direct lane* (``nexrl_hpc/rpc/lane.py``), the peer's IO
thread answers on it right away, and the caller reads the reply itself — no thread hand-off on
either side and no libzmq IO threads in between. Each lane connection signs with its own sender
id, so its sequence numbers stay in order. Asynchronous calls to ``@quick`` methods that arrive
together (pipelined) are answered together: the IO thread holds their small replies until the end
of the receive burst and sends one signed message per caller rank (at most 64 replies, 256 KiB),
which halves the messages both sides handle.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from nexrl_hpc.rpc.codec import RemoteError, decode, encode, encode_exception
from nexrl_hpc.rpc.lane import (
    RECV_BYTES,
    SENDMSG_MAX_BUFFERS,
    LaneReader,
    connect_lane,
    drop_sent,
    lane_parts,
    listen_lane,
    send_parts,
)
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, open_message, seal_message

logger = logging.getLogger(__name__)

RPC_MODULE = "__rpc__"
# what a malformed or hostile message can raise while it is checked (never escapes the IO thread)
_WIRE_ERRORS = (
    RejectedMessage,
    ValueError,
    KeyError,
    TypeError,
    msgpack.ExtraData,
    msgpack.FormatError,
    msgpack.StackError,
)
_SUSPICIOUS_LIFETIME_S = 5.0
_ZERO_COPY_BYTES = 64 << 10
_SNDMORE = int(zmq.SNDMORE)
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_HOLD_REPLY_BYTES = 16 << 10  # quick replies up to this size may share one message with others
_HELD_BATCH_BYTES = 256 << 10  # a batch of held replies goes out at this size or count at the latest
_HELD_BATCH_REPLIES = 64
_BATCH_REQUESTS = 64  # queued quick requests to one peer leave together at this count at the latest
_DIRECT_WAKE_S = 0.1  # a direct caller looks at deadline, dead peers and close this often
_MAX_LANE_CONNECTIONS = 4096  # accepted lane connections per endpoint (beyond: refused, counted)


class PeerDeadError(ConnectionError):
    """The rank a call went to was declared dead."""


class CallTimeout(TimeoutError):
    pass


class MessageTooLarge(ValueError):
    pass


class _Pending:
    __slots__ = ("future", "rank", "what", "deadline", "quick_peer")

    def __init__(
        self, future: Future, rank: int, what: str, deadline: float, quick_peer: _Peer | None = None
    ):
        self.future, self.rank, self.what, self.deadline = future, rank, what, deadline
        self.quick_peer = quick_peer  # an async quick call counted in that peer's quick_in_flight


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


class _Peer:
    """The sending side towards one rank: a DEALER any thread may use, one at a time, and the idle
    connections to its direct lane (each used by one caller at a time, borrowed and given back)."""

    __slots__ = (
        "socket", "lock", "address", "lane", "idle_direct", "direct_count", "quick_in_flight", "outbox",
        "outbox_bytes",
    )  # fmt: skip

    def __init__(self, sock: zmq.Socket, address: str, lane: str | None):
        self.socket, self.lock, self.address, self.lane = sock, threading.Lock(), address, lane
        self.idle_direct: list[_DirectConnection] = []
        self.direct_count = 0
        # asynchronous quick calls (under ``lock``): how many are unanswered, and the requests that
        # wait for an answer before leaving together (Nagle's rule, per peer)
        self.quick_in_flight = 0
        self.outbox: list[list[Any]] = []  # [call id, module, method, payload]
        self.outbox_bytes = 0


class _DirectConnection:
    """A caller's own connection to one peer's lane: it sends a request and reads the reply on it."""

    __slots__ = ("socket", "sender", "seq", "reader")

    def __init__(self, sock: socket.socket, sender: str, max_bytes: int):
        self.socket, self.sender, self.seq = sock, sender, 0
        self.reader = LaneReader(max_bytes)


class _LaneClient:
    """The server side of one accepted lane connection (IO thread only)."""

    __slots__ = ("socket", "peer", "reader", "unsent", "waiting", "sender", "seq")

    def __init__(self, sock: socket.socket, peer: str, sender: str, max_bytes: int):
        self.socket, self.peer, self.sender, self.seq = sock, peer, sender, 0
        self.reader = LaneReader(max_bytes)
        self.unsent: list[memoryview] = []  # reply bytes the kernel has not taken yet
        self.waiting = False  # registered for writability (``unsent`` is not empty)


class _HeldReplies:
    """Small quick replies to one caller rank, waiting for the end of the receive burst."""

    __slots__ = ("items", "size")

    def __init__(self) -> None:
        self.items: list[list[Any]] = []  # [call id, ok, body]
        self.size = 0

    def add(self, call_id: int, ok: bool, body: bytes) -> bool:
        """Hold a reply; True when the batch is full and should leave now."""
        self.items.append([call_id, ok, body])
        self.size += len(body)
        return self.size >= _HELD_BATCH_BYTES or len(self.items) >= _HELD_BATCH_REPLIES


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


class RpcEndpoint:
    def __init__(
        self,
        rank: int,
        host: str,
        key: bytes,
        max_message_bytes: int,
        server_threads: int,
        call_timeout_s: float,
        lookup: Callable[[str, str], Callable[..., Any]],
        resolve_handle: Callable[[str], Any] | None = None,
        *,
        direct_sockets_per_peer: int,
        long_poll_threads: int,
    ):
        self.rank = rank
        self._key = key
        self._max_bytes = max_message_bytes
        self._call_timeout = call_timeout_s
        self._lookup = lookup
        self._resolve_handle = resolve_handle
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._lane_listener, self.lane_address = listen_lane(host)
        self._lane_listener_fd = self._lane_listener.fileno()
        # the lane's sockets wait in a selector of their own (epoll on Linux); the IO thread's zmq
        # poller watches only its descriptor, so a rank with hundreds of lane connections still
        # polls four items per wake-up
        self._lane_selector = selectors.DefaultSelector()
        self._lane_selector.register(self._lane_listener_fd, _READ)
        self._lane_clients: dict[int, _LaneClient] = {}  # IO thread only: by file descriptor
        self._lane_accepts_paused_until: float | None = None  # IO thread only
        self._watch = ConnectionWatch(self._router, self._reject, f"rank {rank}")
        self._peers: dict[int, _Peer] = {}
        self._local = threading.local()
        self._pending: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sender_ids = itertools.count()
        self._dead: dict[int, str] = {}
        self._max_direct = direct_sockets_per_peer
        self._direct_lock = threading.Lock()
        self._direct_ids = itertools.count()
        # IO thread only: small quick replies per caller rank, sent together after each receive burst
        self._held_replies: dict[int, _HeldReplies] = {}
        self._guard = SequenceGuard()
        self._pool = ThreadPoolExecutor(max_workers=server_threads, thread_name_prefix=f"rpc{rank}")
        # long polls wait on threads of their own: with them in the pool above, 16 waiting fetches
        # held every thread and the puts that would end their wait queued behind them (a 0.4 s stall
        # per step at 32 rollout ranks, until the polls timed out)
        self._long_poll_pool = ThreadPoolExecutor(
            max_workers=long_poll_threads, thread_name_prefix=f"rpc{rank}-poll"
        )
        self._rejected = 0
        self._stats_lock = threading.Lock()
        self._closing = False
        self._stop = threading.Event()
        self._io_sender = f"{rank}:{os.getpid()}:io"
        self._io = threading.Thread(target=self._io_loop, name=f"rpc-io-{rank}", daemon=True)
        self._io.start()

    # --- set-up -----------------------------------------------------------------------------------
    def connect(self, peers: dict[int, str], lanes: dict[int, str] | None = None) -> None:
        """Open a DEALER to every peer's ROUTER (the own rank is skipped). ``lanes``: the peers'
        direct lanes (``lane_address``); blocking quick calls to a peer without one go over ZMQ."""
        for rank, address in peers.items():
            if rank == self.rank or rank in self._peers:
                continue
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.ROUTING_ID, f"r{self.rank}".encode())
            sock.connect(address)
            self._peers[rank] = _Peer(sock, address, (lanes or {}).get(rank))

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
        """Send a request; the future resolves with the reply. A small request to a ``@quick``
        method while another to the same peer is unanswered waits in the peer's outbox and leaves
        with the others that queue meanwhile, as one signed message, when an answer comes in (or
        at 64 requests / 256 KiB, or when someone waits on one of them)."""
        future = RpcFuture(self._resolve_handle)
        peer, refused = self._peer_for_call(rank, module, method)
        if refused is not None:
            future.set_exception(refused)
            return future
        call_id = next(self._ids)
        payload, buffers = encode([list(args), kwargs])
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        batchable = quick and not buffers and len(payload) <= _HOLD_REPLY_BYTES
        with self._pending_lock:
            self._pending[call_id] = _Pending(
                future, rank, f"{module}.{method}", deadline, peer if batchable else None
            )
        if batchable:
            with peer.lock:
                peer.quick_in_flight += 1
                if peer.quick_in_flight > 1:  # an earlier one is unanswered: its answer sends this
                    peer.outbox.append([call_id, module, method, payload])
                    peer.outbox_bytes += len(payload)
                    if len(peer.outbox) >= _BATCH_REQUESTS or peer.outbox_bytes >= _HELD_BATCH_BYTES:
                        self._flush_outbox_locked(peer)
                    else:
                        future.send_queued = lambda: self._flush_outbox(peer)
                    return future
                error = self._send_locked(peer, self._request(call_id, module, method), payload, [])
        else:
            error = self._send(peer, self._request(call_id, module, method), payload, buffers)
        if error is not None:
            with self._pending_lock:
                self._pending.pop(call_id, None)
            future.set_exception(MessageTooLarge(f"{module}.{method}: {error}"))
        return future

    def _peer_for_call(self, rank: int, module: str, method: str) -> tuple[Any, Exception | None]:
        """The peer a call goes to, or why it cannot be sent (a dead or unknown rank)."""
        if threading.current_thread() is self._io:  # would wait for a reply only this thread can read
            raise RuntimeError(
                f"{module}.{method} called from a @quick method: quick methods must not call other modules"
            )
        if rank in self._dead:
            return None, PeerDeadError(
                f"rank {rank} is dead ({self._dead[rank]}); {module}.{method} not sent"
            )
        peer = self._peers.get(rank)
        if peer is None:
            return None, PeerDeadError(f"no connection to rank {rank}; {module}.{method} not sent")
        return peer, None

    def call_direct(
        self,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> Any:
        """Call a ``@quick`` method and wait for its result on a lane connection of this caller's
        own (the peer answers on its IO thread). Falls back to ``call_async`` when the peer has no
        lane or every connection to it is in use."""
        peer, refused = self._peer_for_call(rank, module, method)
        if refused is not None:
            raise refused
        if self._closing:
            raise PeerDeadError(f"endpoint of rank {self.rank} closed; {module}.{method} not sent")
        direct = self._borrow_direct(peer, rank, module, method)
        if direct is None:
            return self.call_async(rank, module, method, args, kwargs, timeout).result()
        healthy = False
        try:
            value, ok = self._call_on(direct, rank, module, method, args, kwargs, timeout)
            healthy = direct.reader.idle
        except MessageTooLarge:
            healthy = True  # refused before sending: the connection is untouched
            raise
        finally:  # a connection left mid-call may still get a late reply: it is never reused
            self._return_direct(peer, direct, healthy)
        if not ok:
            raise value
        return value

    def _borrow_direct(self, peer: _Peer, rank: int, module: str, method: str) -> _DirectConnection | None:
        if peer.lane is None:
            return None
        with self._direct_lock:
            if self._closing:
                raise PeerDeadError(f"endpoint of rank {self.rank} closed")
            if peer.idle_direct:
                return peer.idle_direct.pop()
            if peer.direct_count >= self._max_direct:
                return None
            peer.direct_count += 1
            number = next(self._direct_ids)
        try:
            sock = connect_lane(peer.lane, _DIRECT_WAKE_S)
        except OSError as exc:
            with self._direct_lock:
                peer.direct_count -= 1
            raise PeerDeadError(
                f"rank {rank}'s direct lane {peer.lane} refused the connection ({exc}); {module}.{method} not sent"
            ) from exc
        return _DirectConnection(sock, f"{self.rank}:{os.getpid()}:d{number}", self._max_bytes)

    def _return_direct(self, peer: _Peer, direct: _DirectConnection, healthy: bool) -> None:
        with self._direct_lock:
            if healthy and not self._closing:
                peer.idle_direct.append(direct)
                return
            peer.direct_count -= 1
        direct.socket.close()

    def _call_on(
        self,
        direct: _DirectConnection,
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
        direct.seq += 1
        envelope = {**self._request(call_id, module, method), "s": direct.sender, "q": direct.seq}
        frames = seal_message(self._key, msgpack.packb(envelope), payload, buffers)
        size = _message_size(frames)
        if size > self._max_bytes:
            raise MessageTooLarge(
                f"{module}.{method}: a {size}-byte message exceeds runtime.rpc.max_message_mb "
                f"({self._max_bytes >> 20} MB)"
            )
        sock = direct.socket
        try:
            send_parts(sock, lane_parts(frames))
        except OSError as exc:
            raise PeerDeadError(
                f"rank {rank}: direct lane failed ({exc}); {module}.{method} not sent"
            ) from exc
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        while True:
            if rank in self._dead:
                raise PeerDeadError(f"rank {rank} is dead ({self._dead[rank]}); {module}.{method} failed")
            if self._closing:
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
            envelope, body, out_buffers = self._open_direct_reply(messages[0], call_id, sock, rank)
            return decode(body, out_buffers, self._resolve_handle), bool(envelope["ok"])

    def _open_direct_reply(
        self, frames: list[bytes], call_id: int, sock: socket.socket, rank: int
    ) -> tuple[dict[str, Any], Any, list[Any]]:
        try:
            envelope_bytes, rest = open_message(self._key, frames, self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            if not isinstance(envelope, dict) or envelope.get("t") != "rep" or not rest:
                raise RejectedMessage("not a reply")
            self._guard.check(str(envelope["s"]), int(envelope["q"]))
            if envelope["id"] != call_id:
                raise RejectedMessage(f"a reply to call {envelope['id']}, expected {call_id}")
        except _WIRE_ERRORS as exc:
            self._reject(f"direct lane: {exc}", _sock_peer(sock))
            raise ConnectionError(f"rank {rank}: rejected reply on the direct lane ({exc})") from exc
        return envelope, rest[0], rest[1:]

    def fail_peer(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead: fail its pending calls now, refuse new ones."""
        self._dead[rank] = reason
        peer = self._peers.get(rank)
        if peer is not None:  # its queued requests will never leave (their futures fail below)
            with peer.lock:
                peer.outbox, peer.outbox_bytes, peer.quick_in_flight = [], 0, 0
        with self._pending_lock:
            doomed = [cid for cid, p in self._pending.items() if p.rank == rank]
            pendings = [self._pending.pop(cid) for cid in doomed]
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(PeerDeadError(f"rank {rank} is dead ({reason}); {p.what} failed"))

    def is_dead(self, rank: int) -> bool:
        return rank in self._dead

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return {"rejected": self._rejected}

    # --- sending (any thread) -------------------------------------------------------------------
    def _send(self, peer: _Peer, envelope: dict[str, Any], payload: bytes, buffers: list[Any]) -> str | None:
        """Sign and send; returns why not when the message is over the size limit. A request leaves
        after the queued ones (one connection, one order)."""
        with peer.lock:
            if peer.outbox and envelope["t"] == "req":
                self._flush_outbox_locked(peer)
            return self._send_locked(peer, envelope, payload, buffers)

    def _request(self, call_id: int, module: str, method: str) -> dict[str, Any]:
        return {"t": "req", "id": call_id, "src": self.rank, "m": module, "f": method}

    def _flush_outbox(self, peer: _Peer) -> None:
        with peer.lock:
            if peer.outbox:
                self._flush_outbox_locked(peer)

    def _flush_outbox_locked(self, peer: _Peer) -> None:
        """Send the queued quick requests (``peer.lock`` held): one signed message for them all."""
        items, peer.outbox, peer.outbox_bytes = peer.outbox, [], 0
        if len(items) == 1:
            call_id, module, method, payload = items[0]
            self._send_locked(peer, self._request(call_id, module, method), payload, [])
        else:
            self._send_locked(peer, {"t": "reqs", "src": self.rank}, msgpack.packb(items), [])

    def _quick_answered(self, pendings: list[_Pending]) -> None:
        """Answered, failed or expired async quick calls: the queue behind them may leave."""
        for p in pendings:
            peer = p.quick_peer
            if peer is not None:
                with peer.lock:
                    peer.quick_in_flight = max(0, peer.quick_in_flight - 1)

    def _send_locked(
        self, peer: _Peer, envelope: dict[str, Any], payload: bytes, buffers: list[Any]
    ) -> str | None:
        local = self._local
        if not hasattr(local, "sender"):  # unique per thread for the endpoint's life (idents get reused)
            local.sender = f"{self.rank}:{os.getpid()}:{next(self._sender_ids)}"
            local.seq = 0
        local.seq += 1
        envelope["s"], envelope["q"] = local.sender, local.seq
        frames = seal_message(self._key, msgpack.packb(envelope), payload, buffers)
        size = _message_size(frames)
        if size > self._max_bytes:  # the receiver would drop it: fail here, loudly
            return f"a {size}-byte message exceeds runtime.rpc.max_message_mb ({self._max_bytes >> 20} MB)"
        if not self._closing:  # zero-copy pays off only for big buffers; small frames are cheaper copied
            _send_frames(peer.socket, frames, size < _ZERO_COPY_BYTES)
        return None

    def _reject(self, reason: str, peer: str) -> None:
        with self._stats_lock:
            self._rejected += 1
        logger.warning("rank %d: rejected a message from %s: %s", self.rank, peer or "<unknown peer>", reason)

    # --- receiving (IO thread) ------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._watch.socket, zmq.POLLIN)
        poller.register(self._lane_selector.fileno(), zmq.POLLIN)
        next_deadline_check = time.monotonic() + 0.1
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if events.get(self._lane_selector.fileno()):
                for key, what in self._lane_selector.select(0):
                    self._on_lane_event(key.fd, what)
            if self._router in events:
                for _ in range(1000):
                    try:
                        msg = _recv_frames(self._router, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    # a large (multipart) message: held replies do not wait for its check
                    if self._held_replies and len(msg) > 2:
                        self._send_held_replies()
                    self._on_message(msg)
                self._send_held_replies()
                self._flush_outboxes()  # answers came in: the requests queued behind them leave
            if self._watch.socket in events:
                self._watch.drain(self._closing)
            now = time.monotonic()
            if now >= next_deadline_check:
                self._expire(now)
                self._flush_outboxes()
                next_deadline_check = now + 0.1
                paused = self._lane_accepts_paused_until
                if paused is not None and now >= paused:
                    self._lane_accepts_paused_until = None
                    self._lane_selector.register(self._lane_listener_fd, _READ)
        self._router.close(linger=0)
        self._watch.close()
        for fd in list(self._lane_clients):
            self._drop_lane_client(fd)
        self._lane_selector.close()
        self._lane_listener.close()

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        routing_id, frames = msg[0], msg[1:]
        try:
            envelope_bytes, rest = open_message(self._key, [f.buffer for f in frames], self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            kind = envelope.get("t") if isinstance(envelope, dict) else None
            if kind not in ("req", "reqs", "rep", "reps") or not rest:
                raise RejectedMessage("neither a request nor a reply")
            self._guard.check(str(envelope["s"]), int(envelope["q"]))
            replies = _reply_batch(rest[0]) if kind == "reps" else None
            requests = _request_batch(rest[0]) if kind == "reqs" else None
        except _WIRE_ERRORS as exc:
            self._reject(str(exc), _peer_address(routing_id))
            return
        if replies is not None:
            for call_id, ok, body in replies:
                self._complete(call_id, body, [], ok)
            return
        if requests is not None:
            src = envelope["src"]
            for call_id, module, method, payload in requests:
                self._dispatch({"id": call_id, "src": src, "m": module, "f": method}, payload, [])
            return
        if kind == "req":
            self._dispatch(envelope, rest[0], rest[1:])
            return
        self._complete(envelope["id"], bytes(rest[0]), [bytes(b) for b in rest[1:]], bool(envelope["ok"]))

    def _dispatch(self, envelope: dict[str, Any], payload: Any, buffers: list[Any]) -> None:
        """A checked request: a quick method is answered right here (no thread hand-off), a long
        poll in the long-poll pool, any other in the thread pool."""
        try:
            fn = self._lookup(envelope["m"], envelope["f"])
        except Exception as exc:
            fn = _raiser(exc)
        if getattr(fn, "__nexrl_quick__", False):
            self._serve(fn, envelope, payload, buffers, hold=True)
        elif getattr(fn, "__nexrl_long_poll__", False):
            self._long_poll_pool.submit(self._serve, fn, envelope, payload, buffers)
        else:
            self._pool.submit(self._serve, fn, envelope, payload, buffers)

    def _complete(self, call_id: int, body: bytes, buffers: list[bytes], ok: bool) -> None:
        with self._pending_lock:
            pending = self._pending.pop(call_id, None)
        if pending is None:
            return
        if pending.quick_peer is not None:
            self._quick_answered([pending])
        if not pending.future.done():
            pending.future.set_result((body, buffers, ok))

    def _run(self, fn: Callable[..., Any], payload: Any, buffers: list[Any]) -> tuple[bool, bytes, list[Any]]:
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

    # --- the direct lane (IO thread) ------------------------------------------------------------
    def _on_lane_event(self, fd: int, what: int) -> None:
        if fd == self._lane_listener_fd:
            self._accept_lane_clients()
            return
        client = self._lane_clients.get(fd)
        if client is None:
            return
        if what & _WRITE:
            self._flush_lane_client(fd, client)
        if what & _READ and fd in self._lane_clients:
            self._read_lane_client(fd, client)

    def _accept_lane_clients(self) -> None:
        while True:
            try:
                sock, address = self._lane_listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, ...: stop accepting for a second (the listener
                # would stay readable and spin this thread); waiting peers are accepted afterwards
                logger.warning(
                    "rank %d: direct lane accept failed (%s): pausing accepts for 1 s", self.rank, exc
                )
                self._lane_selector.unregister(self._lane_listener_fd)
                self._lane_accepts_paused_until = time.monotonic() + 1.0
                return
            peer = f"{address[0]}:{address[1]}"
            if len(self._lane_clients) >= _MAX_LANE_CONNECTIONS:
                sock.close()
                self._reject(f"direct lane: over {_MAX_LANE_CONNECTIONS} connections", peer)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = sock.fileno()
            sender = f"{self._io_sender}>lane{next(self._direct_ids)}"
            self._lane_clients[fd] = _LaneClient(sock, peer, sender, self._max_bytes)
            self._lane_selector.register(fd, _READ)

    def _read_lane_client(self, fd: int, client: _LaneClient) -> None:
        try:
            data = client.socket.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_lane_client(fd)
            return
        try:
            messages = client.reader.feed(data)
            for frames in messages:
                self._serve_lane_request(client, frames)
        except _WIRE_ERRORS as exc:
            self._reject(f"direct lane: {exc}", client.peer)
            self._drop_lane_client(fd)
            return
        self._flush_lane_client(fd, client)

    def _serve_lane_request(self, client: _LaneClient, frames: list[bytes]) -> None:
        """Check, run and answer one request (raises what a bad message raises, before decoding)."""
        envelope_bytes, rest = open_message(self._key, frames, self._max_bytes)
        envelope = msgpack.unpackb(envelope_bytes, raw=False)
        if not isinstance(envelope, dict) or envelope.get("t") != "req" or not rest:
            raise RejectedMessage("not a request")
        self._guard.check(str(envelope["s"]), int(envelope["q"]))
        try:
            fn = self._lookup(envelope["m"], envelope["f"])
        except Exception as exc:
            fn = _raiser(exc)
        if not getattr(fn, "__nexrl_quick__", False):
            fn = _raiser(
                PermissionError(
                    f"{envelope['m']}.{envelope['f']} is not @quick: it cannot be called directly"
                )
            )
        ok, body, out_buffers = self._run(fn, rest[0], rest[1:])
        client.seq += 1
        reply = {"t": "rep", "id": envelope["id"], "ok": ok, "s": client.sender, "q": client.seq}
        frames_out = seal_message(self._key, msgpack.packb(reply), body, out_buffers)
        size = _message_size(frames_out)
        if size > self._max_bytes:
            error = MessageTooLarge(
                f"{envelope['m']}.{envelope['f']} reply: a {size}-byte message exceeds "
                f"runtime.rpc.max_message_mb ({self._max_bytes >> 20} MB)"
            )
            body, out_buffers = encode(encode_exception(error))
            reply["ok"] = False
            frames_out = seal_message(self._key, msgpack.packb(reply), body, out_buffers)
        client.unsent.extend(memoryview(p).cast("B") for p in lane_parts(frames_out))

    def _flush_lane_client(self, fd: int, client: _LaneClient) -> None:
        """Write what the kernel takes now; wait for POLLOUT for the rest (a slow reader never
        blocks the IO thread)."""
        out = client.unsent
        while out:
            try:
                drop_sent(out, client.socket.sendmsg(out[:SENDMSG_MAX_BUFFERS]))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop_lane_client(fd)
                return
        if bool(out) != client.waiting:
            client.waiting = bool(out)
            self._lane_selector.modify(fd, _READ | (_WRITE if out else 0))

    def _drop_lane_client(self, fd: int) -> None:
        client = self._lane_clients.pop(fd, None)
        if client is None:
            return
        try:
            self._lane_selector.unregister(fd)
        except KeyError:
            pass
        client.socket.close()

    def _serve(
        self,
        fn: Callable[..., Any],
        envelope: dict[str, Any],
        payload: Any,
        buffers: list[Any],
        hold: bool = False,
    ) -> None:
        """Run a request and send the reply; with ``hold`` (IO thread) a small reply waits for the
        end of the current receive burst and leaves with the others to the same rank."""
        ok, body, out_buffers = self._run(fn, payload, buffers)
        src = int(envelope["src"])
        if hold and not out_buffers and len(body) <= _HOLD_REPLY_BYTES and src in self._peers:
            if self._held_replies.setdefault(src, _HeldReplies()).add(envelope["id"], ok, body):
                self._send_held_replies(src)
            return
        peer = self._peers.get(src)
        if peer is None:
            logger.warning("rank %d: no connection back to rank %s for a reply", self.rank, envelope["src"])
            return
        reply = {"t": "rep", "id": envelope["id"], "ok": ok}
        error = self._send(peer, reply, body, out_buffers)
        if error is not None:
            reply["ok"] = False
            body, out_buffers = encode(
                encode_exception(MessageTooLarge(f"{envelope['m']}.{envelope['f']} reply: {error}"))
            )
            self._send(peer, reply, body, out_buffers)

    def _send_held_replies(self, only: int | None = None) -> None:
        """Send the held replies: one signed message per rank (a lone reply in the usual form)."""
        for src in [only] if only is not None else list(self._held_replies):
            held = self._held_replies.pop(src, None)
            if held is None:
                continue
            items, peer = held.items, self._peers[src]
            if len(items) == 1:
                call_id, ok, body = items[0]
                self._send(peer, {"t": "rep", "id": call_id, "ok": ok}, body, [])
            else:
                self._send(peer, {"t": "reps"}, msgpack.packb(items), [])

    def _flush_outboxes(self) -> None:
        for peer in self._peers.values():
            if peer.outbox:
                self._flush_outbox(peer)

    def _expire(self, now: float) -> None:
        with self._pending_lock:
            late = [cid for cid, p in self._pending.items() if p.deadline <= now]
            pendings = [self._pending.pop(cid) for cid in late]
        self._quick_answered(pendings)
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(
                    CallTimeout(f"{p.what} on rank {p.rank}: no reply before the deadline")
                )

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        self._io.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._long_poll_pool.shutdown(wait=False, cancel_futures=True)
        lent = self._close_direct_connections()
        for peer in self._peers.values():
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
        if lent:  # a caller still holds a connection (it gives it up within its 0.1 s poll): don't wait
            return
        try:
            self._ctx.term()
        except zmq.ZMQError:
            pass

    def _close_direct_connections(self, wait_s: float = 0.5) -> int:
        """Close the idle lane connections; wait briefly for lent ones (their callers see ``_closing``
        within one poll and close them). Returns how many are still lent."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._direct_lock:
                idle = [d for peer in self._peers.values() for d in peer.idle_direct]
                for peer in self._peers.values():
                    peer.direct_count -= len(peer.idle_direct)
                    peer.idle_direct.clear()
                lent = sum(peer.direct_count for peer in self._peers.values())
            for direct in idle:
                direct.socket.close()
            if lent == 0 or time.monotonic() >= deadline:
                return lent
            time.sleep(0.02)


def _request_batch(payload: Any) -> list[tuple[int, str, str, bytes]]:
    """The (call id, module, method, payload) of a "reqs" message, checked for shape."""
    return _checked_batch(payload, "request", (int, str, str, bytes))  # type: ignore[return-value]


def _reply_batch(payload: Any) -> list[tuple[int, bool, bytes]]:
    """The (call id, ok, body) triples of a "reps" message, checked for shape."""
    return [(i, bool(ok), body) for i, ok, body in _checked_batch(payload, "reply", (int, object, bytes))]


def _checked_batch(payload: Any, what: str, shape: tuple[type, ...]) -> list[tuple[Any, ...]]:
    items = msgpack.unpackb(bytes(payload), raw=False)
    if not isinstance(items, list):
        raise RejectedMessage(f"a {what} batch that is not a list")
    for item in items:
        if not (isinstance(item, list) and len(item) == len(shape) and all(map(isinstance, item, shape))):
            raise RejectedMessage(f"malformed {what} batch")
    return [tuple(item) for item in items]


def _message_size(frames: list[Any]) -> int:
    """Bytes on the wire; a packed single frame (the usual small call) is a plain ``bytes``."""
    if len(frames) == 1 and isinstance(frames[0], bytes):
        return len(frames[0])
    return sum(memoryview(f).nbytes for f in frames)


def _send_frames(sock: zmq.Socket, frames: list[Any], copy: bool, routing_id: bytes | None = None) -> None:
    """Send one message; a single frame skips ``send_multipart``'s per-frame flag handling."""
    if routing_id is not None:
        sock.send(routing_id, _SNDMORE)
    if len(frames) == 1:
        sock.send(frames[0], copy=copy)
    else:
        sock.send_multipart(frames, copy=copy)


def _recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one message (all its frames); raises ``zmq.Again`` as ``recv`` does."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def _raiser(exc: Exception) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    fail.__nexrl_quick__ = True  # type: ignore[attr-defined]
    return fail


def _with_origin(exc: BaseException, rank: int) -> BaseException:
    if isinstance(exc, RemoteError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteError(type(exc).__name__, str(exc), tb, f"rank {rank}")


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""


def _sock_peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return ""


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
