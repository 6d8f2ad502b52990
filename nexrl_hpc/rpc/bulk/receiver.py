"""Receiving bulk messages: reassembled from verified chunks into reused buffers.

API (one ``BulkReceiver`` per receiving socket/thread; the format is in
``nexrl_hpc/rpc/bulk/format.py``, the sender in ``sender.py``)::

    receiver = BulkReceiver(key, max_bytes, chunk_timeout_s=30.0)
    msg = receiver.feed(socket.recv_multipart(copy=False))    # BulkMessage or None
    msg = receiver.recv(socket, timeout_s=5.0)                 # the same, polling until done
    msg.routing_id, msg.header, msg.tensors, msg.sender, msg.seq
    receiver.rejected                                          # messages dropped (any reason)
    receiver.expire()                                          # drop partials idle too long

The receiver accepts a DEALER's messages and a ROUTER's (a ROUTER puts the peer's routing id
first, returned as ``msg.routing_id``). No frame exceeds ``max(chunk_bytes, MAX_BODY_BYTES)``: set
``zmq.MAXMSGSIZE`` on the receiving socket a little above that, so ZMQ refuses a giant frame before
allocating it. The receiver verifies chunk ``i`` while chunk ``i + 1`` arrives; it copies a chunk
into the destination only after its tag checks out (nothing unverified is ever decoded), and
returns the message only once every chunk did.

Receiving. The destination is one buffer per message, from a ``BufferPool`` (buffers of earlier
messages come back once their tensors are gone: no page faults; new ones are numpy arrays, for
which numpy asks the kernel for transparent huge pages); the tensors are views of it, so its
memory is released with the last of them. Copying a verified chunk from ZMQ's buffer into it is
the one copy on the receiving side (ZMQ's chunk-sized buffers are reused by malloc, so the kernel
writes into warm memory). Anything malformed, forged, truncated, replayed, oversized, out of order or timed out is
dropped, counted in ``rejected`` and logged once per message with the peer named.

Threads and locks: a ``BulkReceiver`` belongs to one receiving thread (no lock); its
``BufferPool`` has a lock of its own, because a buffer comes back from whatever thread drops the
last tensor viewing it.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch
import zmq

from nexrl_hpc.rpc.bulk.format import (
    ALIGN,
    CHUNK,
    CHUNK_META,
    DTYPES,
    HEAD,
    HEAD_META,
    MAX_BODY_BYTES,
    MAX_SENDER_ID_BYTES,
    TAG_BYTES,
    bulk_key,
    one_time_key,
    verify,
)
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard

logger = logging.getLogger(__name__)


class BulkMessage(NamedTuple):
    """A verified message: the ROUTER routing id (None on a DEALER), header, tensors, sender, seq."""

    routing_id: bytes | None
    header: Any
    tensors: dict[str, torch.Tensor]
    sender: str
    seq: int


class BufferPool:
    """Reuses the receive buffers of large messages once every tensor viewing them is gone.

    A trainer gets a batch of about the same size every step; writing it into memory it already
    touched avoids the page faults of fresh memory (4 KiB faults, and huge pages a compaction stall
    now and then), the largest cost of receiving. A buffer goes back
    to the pool when the numpy view the tensors share is freed (``weakref.finalize``, from whatever
    thread drops the last tensor), and is reused for a message of 1/2 to 1 times its size; at
    most ``max_bytes`` are kept.
    """

    MIN_BYTES = 1 << 20
    _ROUND = 2 << 20  # huge-page multiples, so that slightly different sizes share buffers

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        """A fresh-or-reused uint8 array of exactly ``nbytes`` (contents undefined)."""
        if nbytes < self.MIN_BYTES or self.max_bytes <= 0:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes]
            base = min(fits, key=lambda b: b.nbytes) if fits else None
            if base is not None:
                self._free.remove(base)
        if base is None:  # numpy asks for transparent huge pages on large arrays
            base = np.empty(-(-nbytes // self._ROUND) * self._ROUND, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._put, base).atexit = False
        return view

    def _put(self, base: np.ndarray) -> None:
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop()  # the largest goes first

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)


@dataclass
class _Partial:
    routing_id: bytes | None
    sender: str
    nonce: bytes
    seq: int
    header: Any
    tensors: dict[str, torch.Tensor]
    dest: np.ndarray
    chunk_bytes: int
    n_chunks: int
    received: int = 0  # chunks in (they come in order)
    last_progress: float = 0.0


class BulkReceiver:
    """Reassembles and verifies bulk messages from one socket's stream of ZMQ messages.

        ``max_bytes`` bounds the tensor bytes of one message; ``pool_bytes`` (default
        ``min(max_bytes, 1 GiB)``, 0 disables) bounds the receive buffers kept for reuse (``BufferPool``). A sender has at most one message in
        flight (its chunks follow its head on one connection; chunks from another connection are
        refused), so a new head from a sender drops the sender's unfinished message; ``chunk_timeout_s`` bounds how long an unfinished one waits for its
        next chunk. With ``recipient`` set, a message whose header does not name it in ``to`` is
    dropped before the replay guard sees it. Not thread-safe: one receiving thread.
    """

    def __init__(
        self,
        key: bytes,
        max_bytes: int,
        chunk_timeout_s: float = 30.0,
        guard: SequenceGuard | None = None,
        name: str = "bulk receiver",
        pool_bytes: int | None = None,
        recipient: str | None = None,
    ):
        self._key = bulk_key(key)
        self.max_bytes = max_bytes
        self.chunk_timeout_s = chunk_timeout_s
        self._guard = guard or SequenceGuard()
        self._name = name
        self.recipient = recipient  # when set, a head's header must say {"to": recipient, ...}
        self.pool = BufferPool(min(max_bytes, 1 << 30) if pool_bytes is None else pool_bytes)
        self._partials: dict[tuple[bytes | None, str], _Partial] = {}  # by (routing id, sender id)
        self._last_logged: tuple[str, int] | None = None
        self.rejected = 0

    @property
    def pending(self) -> int:
        """Messages whose head checked out and whose chunks are still coming."""
        return len(self._partials)

    def recv(self, socket: zmq.Socket, timeout_s: float) -> BulkMessage | None:
        """Receive from ``socket`` until a whole verified message is in, or None at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(max(1, int(remaining * 1000))):
                self.expire()
                return None
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = self.feed(frames)
                if msg is not None:
                    return msg

    def feed(self, frames: Sequence[Any]) -> BulkMessage | None:
        """Take one ZMQ message (frames as received); return the message it completes, if any."""
        views = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in frames]
        routing_id: bytes | None = None
        if views and views[0] not in (HEAD, CHUNK):  # ROUTER: the peer's routing id comes first
            routing_id = views[0].tobytes()
            views = views[1:]
        where = _peer_name(routing_id)
        try:
            if len(views) >= 4 and views[0] == HEAD:
                return self._head(routing_id, views)
            if len(views) >= 3 and views[0] == CHUNK:
                return self._chunk(routing_id, views)
            raise RejectedMessage(f"not a bulk message ({len(views)} frames)")
        except RejectedMessage as exc:
            self._reject(where, str(exc), getattr(exc, "msg_id", None))
            return None
        finally:
            self.expire()

    def expire(self, now: float | None = None) -> int:
        """Drop unfinished messages that got no chunk for ``chunk_timeout_s``; returns how many."""
        if not self._partials:
            return 0
        now = time.monotonic() if now is None else now
        stale = [k for k, p in self._partials.items() if now - p.last_progress > self.chunk_timeout_s]
        for k in stale:
            p = self._partials.pop(k)
            self._reject(
                f"{p.sender} ({_peer_name(p.routing_id)})",
                f"timed out with {p.received}/{p.n_chunks} chunks",
                (p.sender, p.seq),
            )
        return len(stale)

    def _reject(self, where: str, reason: str, msg_id: tuple[str, int] | None) -> None:
        self.rejected += 1
        if msg_id is None or msg_id != self._last_logged:  # one line per message, not per chunk
            logger.warning("%s: dropped a bulk message from %s: %s", self._name, where, reason)
        self._last_logged = msg_id

    def _head(self, routing_id: bytes | None, views: list[memoryview]) -> BulkMessage | None:
        meta, body, tag, data = views[1], views[2], views[3], views[4:]
        nonce, seq, sender = _parse_meta(HEAD_META, meta)[:3]
        msg_id = (sender, seq)
        if body.nbytes > MAX_BODY_BYTES or tag.nbytes != TAG_BYTES:
            raise _rejected(msg_id, "malformed head")
        inline = sum(v.nbytes for v in data)
        if inline > self.max_bytes:
            raise _rejected(msg_id, f"{inline} bytes exceeds the {self.max_bytes}-byte limit")
        key = one_time_key(self._key, b"H", nonce, seq, 0, sender.encode())
        try:
            verify(key, [meta, body, *data], tag.tobytes())
        except RejectedMessage as exc:
            raise _rejected(msg_id, str(exc)) from None
        # verified: decode the body (still checked: a key holder's bug must not crash the receiver)
        try:
            header, specs, total, chunk_bytes, n_chunks = _parse_body(body, self.max_bytes)
        except (ValueError, TypeError, KeyError, RuntimeError, msgpack.UnpackException) as exc:
            raise _rejected(msg_id, f"bad head body: {exc}") from None
        # meant for another receiver (replayed or misrouted): dropped before the replay guard, so
        # that it cannot use up the sender's sequence number here
        if self.recipient is not None and (
            not isinstance(header, dict) or header.get("to") != self.recipient
        ):
            to = header.get("to") if isinstance(header, dict) else None
            raise _rejected(msg_id, f"meant for {to!r}, not {self.recipient!r} (replayed or misrouted)")
        try:
            self._guard.check(sender, seq)
        except RejectedMessage as exc:
            raise _rejected(msg_id, str(exc)) from None
        try:
            if n_chunks != (0 if total <= chunk_bytes else math.ceil(total / chunk_bytes)):
                raise ValueError("inconsistent chunk count")
            if n_chunks == 0 and inline != total:
                raise ValueError(f"{inline} inline bytes, head says {total}")
            dest = self.pool.get(total)
            flat = torch.from_numpy(dest)
            tensors = {}
            for name, dtype, shape, offset, nbytes in specs:
                tensors[name] = flat[offset : offset + nbytes].view(dtype).reshape(shape)
        except (ValueError, TypeError, KeyError, RuntimeError, msgpack.UnpackException) as exc:
            raise _rejected(msg_id, f"bad head body: {exc}") from None
        old = self._partials.pop((routing_id, sender), None)
        if old is not None:
            self._reject(sender, f"unfinished message {old.seq} superseded by {seq}", (sender, old.seq))
        if n_chunks == 0:
            _copy_into(dest, 0, data)
            return BulkMessage(routing_id, header, tensors, sender, seq)
        self._partials[(routing_id, sender)] = _Partial(
            routing_id,
            sender,
            nonce,
            seq,
            header,
            tensors,
            dest,
            chunk_bytes,
            n_chunks,
            last_progress=time.monotonic(),
        )
        return None

    def _chunk(self, routing_id: bytes | None, views: list[memoryview]) -> BulkMessage | None:
        meta, tag, data = views[1], views[2], views[3:]
        nonce, seq, sender, index, n_chunks = _parse_meta(CHUNK_META, meta)
        msg_id = (sender, seq)
        p = self._partials.get((routing_id, sender))  # chunks must come over the head's connection
        if p is None or p.seq != seq or p.nonce != nonce:
            raise _rejected(msg_id, f"chunk {index} of message {seq}, which is not in progress")
        # from here on the chunk came over the head's connection, whose messages arrive in order and
        # intact: anything wrong means a corrupt stream, and the message is dropped at once
        try:
            self._check_chunk(p, meta, tag, data, index, n_chunks)
        except RejectedMessage as exc:
            del self._partials[(routing_id, sender)]
            raise _rejected(msg_id, f"chunk {index}/{n_chunks}: {exc}") from None
        _copy_into(p.dest, index * p.chunk_bytes, data)
        p.received += 1
        p.last_progress = time.monotonic()
        if p.received < p.n_chunks:
            return None
        del self._partials[(routing_id, sender)]
        return BulkMessage(p.routing_id, p.header, p.tensors, sender, seq)

    def _check_chunk(
        self,
        p: _Partial,
        meta: memoryview,
        tag: memoryview,
        data: list[memoryview],
        index: int,
        n_chunks: int,
    ) -> None:
        if n_chunks != p.n_chunks or index != p.received or tag.nbytes != TAG_BYTES:
            raise RejectedMessage(f"out of place (expected chunk {p.received}/{p.n_chunks})")
        start = index * p.chunk_bytes
        expected = min(start + p.chunk_bytes, p.dest.nbytes) - start
        got = sum(v.nbytes for v in data)
        if got != expected:
            raise RejectedMessage(f"{got} bytes, expected {expected}")
        key = one_time_key(self._key, b"C", p.nonce, p.seq, index, p.sender.encode())
        verify(key, [meta, *data], tag.tobytes())


def _rejected(msg_id: tuple[str, int], reason: str) -> RejectedMessage:
    exc = RejectedMessage(f"message {msg_id[1]} of {msg_id[0]}: {reason}")
    exc.msg_id = msg_id  # type: ignore[attr-defined]
    return exc


def _peer_name(routing_id: bytes | None) -> str:
    return f"peer {routing_id.hex()}" if routing_id is not None else "the connected peer"


def _parse_meta(layout: struct.Struct, meta: memoryview) -> tuple[Any, ...]:
    """Fixed fields + sender id of an unverified meta frame (bounds-checked, nothing else decoded)."""
    if not layout.size < meta.nbytes <= layout.size + MAX_SENDER_ID_BYTES:
        raise RejectedMessage("malformed meta frame")
    fields = layout.unpack(meta[: layout.size])
    try:
        sender = meta[layout.size :].tobytes().decode()
    except UnicodeDecodeError:
        raise RejectedMessage("malformed sender id") from None
    return (fields[0], fields[1], sender, *fields[2:])


def _parse_body(
    body: memoryview, max_bytes: int
) -> tuple[Any, list[tuple[str, torch.dtype, list[int], int, int]], int, int, int]:
    """Decode a verified head body and check the layout: aligned, in order, within ``max_bytes``."""
    doc = msgpack.unpackb(body, raw=False, strict_map_key=False)
    header, raw_specs, total, chunk_bytes, n_chunks = doc["h"], doc["t"], doc["n"], doc["c"], doc["k"]
    for value in (total, chunk_bytes, n_chunks):
        if not isinstance(value, int) or value < 0:
            raise ValueError("bad layout numbers")
    if total > max_bytes:
        raise ValueError(f"{total} bytes exceeds the {max_bytes}-byte limit")
    if chunk_bytes < ALIGN:
        raise ValueError("chunk size too small")
    specs = []
    end = 0
    names = set()
    for name, dtype_name, shape, offset in raw_specs:
        dtype = DTYPES[dtype_name]
        if not isinstance(name, str) or name in names:
            raise ValueError(f"bad or repeated tensor name {name!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(offset, int):
            raise ValueError(f"bad shape/offset for {name!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % ALIGN or offset < end or offset + nbytes > total:
            raise ValueError(f"tensor {name!r} out of the stream")
        names.add(name)
        specs.append((name, dtype, shape, offset, nbytes))
        end = offset + nbytes
    if end != total:
        raise ValueError("stream length does not match the tensors")
    return header, specs, total, chunk_bytes, n_chunks


def _copy_into(dest: np.ndarray, start: int, data: Sequence[memoryview]) -> None:
    pos = start
    for view in data:
        n = view.nbytes
        if n:
            dest[pos : pos + n] = np.frombuffer(view, dtype=np.uint8)
            pos += n
