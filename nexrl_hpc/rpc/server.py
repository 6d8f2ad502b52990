"""The IO-thread server of an RPC endpoint: the ROUTER every request and reply arrives on.

One IO thread owns the ROUTER: it checks every message (size, HMAC, sender sequence) before
decoding anything, completes the futures of replies (through the caller side, ``Calls``) and
dispatches requests: a ``@quick`` method is answered right on the IO thread, a ``@long_poll`` method
(it waits for work) runs in a pool of its own, so callers waiting in them never hold the threads
every other call needs, and any other method runs in the thread pool. Failures are dropped,
counted and logged with the peer address. The same thread drives the lane server (its selector is
polled next to the ROUTER), the connection watch, the call deadlines and the outboxes.

Asynchronous calls to ``@quick`` methods that arrive together (pipelined) are answered together:
the IO thread holds their small replies until the end of the receive burst and sends one signed
message per caller rank (at most 64 replies, 256 KiB), which halves the messages both sides handle.

The IO thread survives any message: everything a signed envelope carries is checked for kind,
recipient and types before it is used (``check_request``), and whatever still goes wrong with one
message is logged, counted and costs that message only. The ROUTER is guarded by a
``ConnectionWatch`` (ZAP, the pre-authentication cap); a valid message marks its connection
authenticated there.

Threads and locks: the ROUTER, the held replies and everything the lane server owns are
IO thread only (no locks). Replies of pool threads are sent through ``Calls.send`` (the peer's lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import zmq

from nexrl_hpc.rpc.calls import Calls
from nexrl_hpc.rpc.codec import encode, encode_exception
from nexrl_hpc.rpc.invoke import Invoker
from nexrl_hpc.rpc.lane_server import LaneServer
from nexrl_hpc.rpc.limits import (
    HELD_BATCH_BYTES,
    HELD_BATCH_REPLIES,
    HOLD_REPLY_BYTES,
    WIRE_ERRORS,
    MessageTooLarge,
)
from nexrl_hpc.rpc.preauth import WireLimits, join_frames, secure_server
from nexrl_hpc.rpc.watch import ConnectionWatch
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, check_request, open_message

logger = logging.getLogger(__name__)


class HeldReplies:
    """Small quick replies to one caller rank, waiting for the end of the receive burst."""

    __slots__ = ("items", "size")

    def __init__(self) -> None:
        self.items: list[list[Any]] = []  # [call id, ok, body]
        self.size = 0

    def add(self, call_id: int, ok: bool, body: bytes) -> bool:
        """Hold a reply; True when the batch is full and should leave now."""
        self.items.append([call_id, ok, body])
        self.size += len(body)
        return self.size >= HELD_BATCH_BYTES or len(self.items) >= HELD_BATCH_REPLIES


class IoServer:
    """The ROUTER, the IO thread that reads it, and the thread pools requests run in."""

    def __init__(
        self,
        rank: int,
        ctx: zmq.Context,
        host: str,
        key: bytes,
        max_message_bytes: int,
        server_threads: int,
        long_poll_threads: int,
        calls: Calls,
        lanes: LaneServer,
        invoker: Invoker,
        guard: SequenceGuard,
        reject: Callable[[str, str], None],
        limits: WireLimits,
    ):
        self.rank = rank
        self._key = key
        self._max_bytes = max_message_bytes
        self._calls = calls
        self._lanes = lanes
        self._invoker = invoker
        self._guard = guard
        self._reject = reject
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        secure_server(self._router, limits)  # frames up to the pre-auth budget; PLAIN before any frame
        self._watch = ConnectionWatch(self._router, key, limits, reject, f"rank {rank}")
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._held_replies: dict[int, HeldReplies] = {}  # small quick replies per caller rank
        self._pool = ThreadPoolExecutor(max_workers=server_threads, thread_name_prefix=f"rpc{rank}")
        # long polls wait on threads of their own: with them in the pool above, 16 waiting fetches
        # held every thread and the puts that would end their wait queued behind them (a stall per
        # step at 32 rollout ranks, until the polls timed out)
        self._long_poll_pool = ThreadPoolExecutor(
            max_workers=long_poll_threads, thread_name_prefix=f"rpc{rank}-poll"
        )
        self.closing = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._io_loop, name=f"rpc-io-{rank}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the IO thread (it closes the ROUTER, the watch and the lane server) and the pools."""
        self.closing = True
        self._stop.set()
        self.thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._long_poll_pool.shutdown(wait=False, cancel_futures=True)

    # --- receiving (IO thread) ------------------------------------------------------------------
    def _io_loop(self) -> None:
        calls, lanes = self._calls, self._lanes
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        lane_fd = lanes.fileno()
        poller.register(lane_fd, zmq.POLLIN)
        next_deadline_check = time.monotonic() + 0.1
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if events.get(lane_fd):
                lanes.on_ready()
            if self._router in events:
                for _ in range(1000):
                    try:
                        msg = _recv_frames(self._router, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    # a large (multipart) message: held replies do not wait for its check
                    if self._held_replies and len(msg) > 2:
                        self._send_held_replies()
                    try:
                        self._on_message(msg)
                    except Exception as exc:  # a bug costs this message, never the IO thread
                        logger.exception("rank %d: a message failed on the IO thread", self.rank)
                        self._reject(f"{type(exc).__name__}: {exc}", _peer_address(msg[0]))
                self._send_held_replies()
                calls.flush_outboxes()  # answers came in: the requests queued behind them leave
            now = time.monotonic()
            if now >= next_deadline_check:
                calls.expire(now)
                calls.flush_outboxes()
                next_deadline_check = now + 0.1
                lanes.tick(now)
        self._watch.close()
        self._router.close(linger=0)
        lanes.close()

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        routing_id, frames = msg[0], msg[1:]
        try:
            envelope_bytes, rest = open_message(self._key, [f.buffer for f in frames], self._max_bytes)
            envelope = msgpack.unpackb(envelope_bytes, raw=False)
            kind = check_request(envelope, self.rank, _KINDS)
            if not rest:
                raise RejectedMessage("no payload")
            self._guard.check(envelope["s"], envelope["q"])
            if "k" in envelope:  # parts cut into frames
                rest = join_frames(rest, envelope["k"])
            replies = reply_batch(rest[0]) if kind == "reps" else None
            requests = request_batch(rest[0]) if kind == "reqs" else None
        except WIRE_ERRORS as exc:
            self._reject(str(exc), _peer_address(routing_id))
            return
        if self._watch.unmarked:  # connections wait to authenticate: this one has
            self._watch.mark(frames[0].get(zmq.SRCFD))
        src = envelope["src"]
        if kind == "hi":
            return
        if src in self._calls.dead and kind in ("req", "reqs"):
            return  # a rank declared dead is dead: its late requests (a task put back) are not served
        if replies is not None:
            for call_id, ok, body in replies:
                self._complete(call_id, body, [], ok, src, routing_id)
            return
        if requests is not None:
            for call_id, module, method, payload in requests:
                self._dispatch({"id": call_id, "src": src, "m": module, "f": method}, payload, [])
            return
        if kind == "req":
            self._dispatch(envelope, rest[0], rest[1:])
            return
        self._complete(
            envelope["id"], bytes(rest[0]), [bytes(b) for b in rest[1:]], envelope["ok"], src, routing_id
        )

    def _complete(
        self, call_id: int, body: bytes, buffers: list[bytes], ok: bool, src: int, routing_id: zmq.Frame
    ) -> None:
        if not self._calls.complete(call_id, body, buffers, ok, src):
            self._reject(
                f"a reply from rank {src} to call {call_id}, which went to another rank",
                _peer_address(routing_id),
            )

    def _dispatch(self, envelope: dict[str, Any], payload: Any, buffers: list[Any]) -> None:
        """A checked request: a quick method is answered right here (no thread hand-off), a long
        poll in the long-poll pool, any other in the thread pool."""
        fn = self._invoker.find(envelope["m"], envelope["f"])
        if getattr(fn, "__nexrl_quick__", False):
            self._serve(fn, envelope, payload, buffers, hold=True)
        elif getattr(fn, "__nexrl_long_poll__", False):
            self._long_poll_pool.submit(self._serve, fn, envelope, payload, buffers)
        else:
            self._pool.submit(self._serve, fn, envelope, payload, buffers)

    # --- answering (IO thread with ``hold``, else a pool thread) ---------------------------------
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
        ok, body, out_buffers = self._invoker.run(fn, payload, buffers)
        src = int(envelope["src"])
        peers = self._calls.peers
        if hold and not out_buffers and len(body) <= HOLD_REPLY_BYTES and src in peers:
            if self._held_replies.setdefault(src, HeldReplies()).add(envelope["id"], ok, body):
                self._send_held_replies(src)
            return
        peer = peers.get(src)
        if peer is None:
            logger.warning("rank %d: no connection back to rank %s for a reply", self.rank, envelope["src"])
            return
        reply = {"t": "rep", "id": envelope["id"], "ok": ok, "src": self.rank, "to": src}
        error = self._calls.send(peer, reply, body, out_buffers)
        if error is not None:
            reply["ok"] = False
            body, out_buffers = encode(
                encode_exception(MessageTooLarge(f"{envelope['m']}.{envelope['f']} reply: {error}"))
            )
            self._calls.send(peer, reply, body, out_buffers)

    def _send_held_replies(self, only: int | None = None) -> None:
        """Send the held replies: one signed message per rank (a lone reply in the usual form)."""
        for src in [only] if only is not None else list(self._held_replies):
            held = self._held_replies.pop(src, None)
            if held is None:
                continue
            items, peer = held.items, self._calls.peers[src]
            if len(items) == 1:
                call_id, ok, body = items[0]
                self._calls.send(
                    peer, {"t": "rep", "id": call_id, "ok": ok, "src": self.rank, "to": src}, body, []
                )
            else:
                self._calls.send(peer, {"t": "reps", "src": self.rank, "to": src}, msgpack.packb(items), [])


_KINDS = ("req", "reqs", "rep", "reps", "hi")


def request_batch(payload: Any) -> list[tuple[int, str, str, bytes]]:
    """The (call id, module, method, payload) of a "reqs" message, checked for shape."""
    return _checked_batch(payload, "request", (int, str, str, bytes))


def reply_batch(payload: Any) -> list[tuple[int, bool, bytes]]:
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


def _recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one message (all its frames); raises ``zmq.Again`` as ``recv`` does."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def _peer_address(frame: zmq.Frame) -> str:
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return ""
    return address if isinstance(address, str) else ""
