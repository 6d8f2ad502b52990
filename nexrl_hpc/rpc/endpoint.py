"""One RPC endpoint per rank: a ZMQ ROUTER that serves this rank's modules, DEALERs to the peers.

Threads: an IO thread owns every ZMQ socket (ROUTER, DEALERs, the monitor, the in-process outbox);
callers and server workers encode + sign in their own thread and hand finished frames to the IO
thread through per-thread in-process PUSH sockets (so each sender's sequence numbers stay in
order). Requests run on a thread pool, so a long poll never blocks another call. Every frame is
verified (size, HMAC, sequence) before anything in it is decoded; failures are dropped, counted
and logged with the peer address. A call to a rank declared dead fails at once; every call has a
deadline, so nothing waits forever.
"""

from __future__ import annotations

import itertools
import logging
import os
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
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, open_frames, seal

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


class PeerDeadError(ConnectionError):
    """The rank a call went to was declared dead."""


class CallTimeout(TimeoutError):
    pass


class MessageTooLarge(ValueError):
    pass


class _Pending:
    __slots__ = ("future", "rank", "what", "deadline")

    def __init__(self, future: Future, rank: int, what: str, deadline: float):
        self.future, self.rank, self.what, self.deadline = future, rank, what, deadline


class RpcFuture(Future):
    """Resolves with the raw reply; the caller's thread decodes it on ``result()``."""

    def __init__(self, resolve_handle: Callable[[str], Any] | None):
        super().__init__()
        self._resolve_handle = resolve_handle
        self._decoded = False
        self._value: Any = None

    def result(self, timeout: float | None = None) -> Any:
        raw = super().result(timeout)
        if not self._decoded:
            payload, buffers, ok = raw
            value = decode(payload, buffers, self._resolve_handle)
            self._value = (value, ok)
            self._decoded = True
        value, ok = self._value
        if not ok:
            raise value
        return value


class RpcEndpoint:
    def __init__(
        self,
        rank: int,
        host: str,
        key: bytes,
        max_message_bytes: int,
        server_threads: int,
        call_timeout_s: float,
        dispatch: Callable[[str, str, list[Any], dict[str, Any]], Any],
        resolve_handle: Callable[[str], Any] | None = None,
    ):
        self.rank = rank
        self._key = key
        self._max_bytes = max_message_bytes
        self._call_timeout = call_timeout_s
        self._dispatch = dispatch
        self._resolve_handle = resolve_handle
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._monitor = self._router.get_monitor_socket(
            zmq.EVENT_ACCEPTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        self._outbox_addr = f"inproc://nexrl-outbox-{id(self)}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_addr)
        self._local = threading.local()
        self._dealers: dict[int, zmq.Socket] = {}
        self._peer_addresses: dict[int, str] = {}
        self._pending: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._dead: dict[int, str] = {}
        self._request_guard = SequenceGuard()  # requests and replies travel on different connections:
        self._reply_guard = SequenceGuard()  # each channel keeps its own order
        self._sender_ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=server_threads, thread_name_prefix=f"rpc{rank}")
        self._rejected = 0
        self._stats_lock = threading.Lock()
        self._accepted: dict[int, tuple[str, float, bool]] = {}  # fd -> (peer, accept time, handshaken)
        self._closing = False
        self._stop = threading.Event()
        self._io = threading.Thread(target=self._io_loop, name=f"rpc-io-{rank}", daemon=True)
        self._io.start()

    # --- set-up -----------------------------------------------------------------------------------
    def connect(self, peers: dict[int, str]) -> None:
        """Open DEALERs to the peers' ROUTERs (done by the IO thread, which owns all sockets)."""
        self._peer_addresses.update(peers)
        self._send_to_io([b"connect", msgpack.packb(peers)])

    # --- calls ----------------------------------------------------------------------------------
    def call_async(
        self,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> Future:
        future = RpcFuture(self._resolve_handle)
        if rank in self._dead:
            future.set_exception(
                PeerDeadError(f"rank {rank} is dead ({self._dead[rank]}); {module}.{method} not sent")
            )
            return future
        call_id = next(self._ids)
        payload, buffers = encode([list(args), kwargs])
        sender, seq = self._sender()
        envelope = msgpack.packb(
            {"t": "req", "id": call_id, "src": self.rank, "s": sender, "q": seq, "m": module, "f": method}
        )
        frames = seal(self._key, envelope, [payload, *buffers])
        size = sum(memoryview(f).nbytes for f in frames)
        if size > self._max_bytes:  # the receiver would drop it: fail here, loudly
            future.set_exception(
                MessageTooLarge(
                    f"{module}.{method}: a {size}-byte message exceeds runtime.rpc.max_message_mb ({self._max_bytes >> 20} MB)"
                )
            )
            return future
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        with self._pending_lock:
            self._pending[call_id] = _Pending(future, rank, f"{module}.{method}", deadline)
        self._send_to_io([b"req", str(rank).encode(), *frames])
        return future

    def fail_peer(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead: fail its pending calls now, refuse new ones."""
        self._dead[rank] = reason
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

    # --- internals: sending -----------------------------------------------------------------------
    def _sender(self) -> tuple[str, int]:
        local = self._local
        if not hasattr(local, "sender"):  # unique per thread for the endpoint's life (idents get reused)
            local.sender = f"{self.rank}:{os.getpid()}:{next(self._sender_ids)}"
            local.seq = 0
        local.seq += 1
        return local.sender, local.seq

    def _send_to_io(self, frames: list[Any]) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._outbox_addr)
            self._local.push = push
        push.send_multipart(frames, copy=False)

    def _reject(self, reason: str, peer: str) -> None:
        with self._stats_lock:
            self._rejected += 1
        logger.warning("rank %d: rejected a message from %s: %s", self.rank, peer or "<unknown peer>", reason)

    # --- internals: IO thread -------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        by_socket: dict[zmq.Socket, int] = {}
        next_deadline_check = time.monotonic() + 0.1
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if self._outbox in events:
                for _ in range(1000):
                    try:
                        msg = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    kind = msg[0].bytes
                    if kind == b"req":
                        dealer = self._dealers.get(int(msg[1].bytes))
                        if dealer is not None:
                            dealer.send_multipart(msg[2:], copy=False)
                    elif kind == b"rep":
                        try:
                            self._router.send_multipart(msg[1:], copy=False)
                        except zmq.ZMQError as exc:  # the caller went away
                            logger.debug("reply not delivered: %s", exc)
                    elif kind == b"connect":
                        for rank, address in msgpack.unpackb(msg[1].bytes, strict_map_key=False).items():
                            if rank == self.rank or rank in self._dealers:
                                continue
                            dealer = self._ctx.socket(zmq.DEALER)
                            dealer.setsockopt(zmq.LINGER, 0)
                            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
                            dealer.setsockopt(zmq.ROUTING_ID, f"r{self.rank}".encode())
                            dealer.connect(address)
                            self._dealers[rank] = dealer
                            by_socket[dealer] = rank
                            poller.register(dealer, zmq.POLLIN)
                    elif kind == b"stop":
                        self._stop.set()
            if self._router in events:
                for _ in range(1000):
                    try:
                        msg = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_request(msg)
            for sock, rank in list(by_socket.items()):
                if sock in events:
                    for _ in range(1000):
                        try:
                            msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_reply(msg, rank)
            if self._monitor in events:
                self._on_monitor()
            now = time.monotonic()
            if now >= next_deadline_check:
                self._expire(now)
                next_deadline_check = now + 0.1
        for sock in [self._router, self._outbox, self._monitor, *self._dealers.values()]:
            sock.close(linger=0)

    def _peer_of(self, frame: zmq.Frame) -> str:
        try:
            return frame.get("Peer-Address") or ""
        except zmq.ZMQError:
            return ""

    def _on_request(self, msg: list[zmq.Frame]) -> None:
        routing_id, frames = msg[0], msg[1:]
        peer = self._peer_of(routing_id)
        try:
            envelope_bytes, rest = open_frames(self._key, [f.buffer for f in frames], self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            if not isinstance(envelope, dict) or envelope.get("t") != "req" or not rest:
                raise RejectedMessage("not a request")
            self._request_guard.check(str(envelope["s"]), int(envelope["q"]))
        except _WIRE_ERRORS as exc:
            self._reject(str(exc), peer)
            return
        self._pool.submit(self._serve, routing_id.bytes, envelope, rest[0], rest[1:])

    def _serve(self, routing_id: bytes, envelope: dict[str, Any], payload: Any, buffers: list[Any]) -> None:
        ok = True
        try:
            args, kwargs = decode(bytes(payload), buffers, self._resolve_handle)
            result = self._dispatch(envelope["m"], envelope["f"], args, kwargs)
        except BaseException as exc:  # delivered to the caller
            ok = False
            result = exc
        try:
            body, out_buffers = encode(result if ok else encode_exception(_with_origin(result, self.rank)))
        except TypeError as exc:
            ok = False
            body, out_buffers = encode(encode_exception(exc))
        size = len(body) + sum(memoryview(b).nbytes for b in out_buffers)
        if size > self._max_bytes:
            ok = False
            too_large = MessageTooLarge(
                f"{envelope['m']}.{envelope['f']}: a {size}-byte reply exceeds runtime.rpc.max_message_mb"
            )
            body, out_buffers = encode(encode_exception(too_large))
        sender, seq = self._sender()
        reply_env = msgpack.packb({"t": "rep", "id": envelope["id"], "ok": ok, "s": sender, "q": seq})
        self._send_to_io([b"rep", routing_id, *seal(self._key, reply_env, [body, *out_buffers])])

    def _on_reply(self, msg: list[zmq.Frame], rank: int) -> None:
        try:
            envelope_bytes, rest = open_frames(self._key, [f.buffer for f in msg], self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            if not isinstance(envelope, dict) or envelope.get("t") != "rep" or not rest:
                raise RejectedMessage("not a reply")
            self._reply_guard.check(str(envelope["s"]), int(envelope["q"]))
        except _WIRE_ERRORS as exc:
            self._reject(str(exc), self._peer_addresses.get(rank, f"rank {rank}"))
            return
        with self._pending_lock:
            pending = self._pending.pop(envelope["id"], None)
        if pending is not None and not pending.future.done():
            pending.future.set_result((bytes(rest[0]), [bytes(b) for b in rest[1:]], bool(envelope["ok"])))

    def _on_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
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
            elif kind == zmq.EVENT_DISCONNECTED and not self._closing:
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
                    logger.info("rank %d: connection from %s closed", self.rank, peer or "<unknown>")

    def _expire(self, now: float) -> None:
        with self._pending_lock:
            late = [cid for cid, p in self._pending.items() if p.deadline <= now]
            pendings = [self._pending.pop(cid) for cid in late]
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(
                    CallTimeout(f"{p.what} on rank {p.rank}: no reply before the deadline")
                )

    def close(self) -> None:
        self._closing = True
        self._send_to_io([b"stop"])
        self._io.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._pending_lock:
            pendings = list(self._pending.values())
            self._pending.clear()
        for p in pendings:
            if not p.future.done():
                p.future.set_exception(
                    PeerDeadError(f"endpoint of rank {self.rank} closed; {p.what} abandoned")
                )
        try:
            self._ctx.destroy(linger=0)
        except zmq.ZMQError:
            pass


def _with_origin(exc: BaseException, rank: int) -> BaseException:
    if isinstance(exc, RemoteError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteError(type(exc).__name__, str(exc), tb, f"rank {rank}")


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
