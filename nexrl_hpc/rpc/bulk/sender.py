"""Sending a bulk message: a signed head plus signed chunks (format: ``nexrl_hpc/rpc/bulk/format.py``).

API (one ``BulkSender`` per sending thread)::

    sender = BulkSender(key, sender_id, chunk_bytes=4 << 20)
    seq = sender.send(socket, header: dict, tensors: dict[str, torch.Tensor], routing_id=None)

``socket`` is a DEALER (or PAIR/PUSH), or a ROUTER when ``routing_id`` is given. ``sender_id``
must be unique per ``BulkSender`` in the job (its sequence numbers must increase). No frame
exceeds ``FRAME_BYTES`` (``nexrl_hpc/rpc/preauth.py``): data is cut into frames of at most that.

Why chunks. ZMQ hands a multipart message over only once all of it is in, so one big message
would serialise MAC, transfer and verification. With chunks the sender's MAC of chunk ``i + 1``
runs while ZMQ's IO thread sends chunk ``i``, and the receiver verifies chunk ``i`` while chunk
``i + 1`` arrives.

Threads: a sender is not thread-safe (neither are ZMQ sockets) and has no lock.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
import zmq

from nexrl_hpc.rpc.bulk.format import (
    ALIGN,
    CHUNK,
    CHUNK_META,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    FRAME_BYTES,
    HEAD,
    HEAD_META,
    MAX_BODY_BYTES,
    MAX_SENDER_ID_BYTES,
    bulk_key,
    one_time_key,
    tag,
)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a contiguous CPU copy only if it is not one already)."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class BulkSender:
    """Sends ``(header, tensors)`` as a signed head plus signed chunks (see the module docstring).

    Not thread-safe (neither are ZMQ sockets): one sender per sending thread, or a lock around
    ``send``. Tensors go out zero-copy: do not modify them in place until the peer acknowledged.
    """

    def __init__(self, key: bytes, sender_id: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        """``sender_id`` must be unique per sender object in the job (receivers check that its
        sequence numbers increase), e.g. ``f"{rank}:{pid}:{n}"`` as the RPC endpoint does."""
        self._key = bulk_key(key)
        self._sender = sender_id.encode()
        if not 0 < len(self._sender) <= MAX_SENDER_ID_BYTES:
            raise ValueError(f"sender id must be 1-{MAX_SENDER_ID_BYTES} bytes")
        if chunk_bytes < ALIGN:
            raise ValueError(f"chunk_bytes must be >= {ALIGN}")
        self.sender_id = sender_id
        self.chunk_bytes = chunk_bytes
        self._nonce = secrets.token_bytes(16)
        # starts at the clock so that a restarted sender (same id) passes the receivers' replay guard
        self._seq = itertools.count(time.time_ns())

    def send(
        self,
        socket: zmq.Socket,
        header: Any,
        tensors: Mapping[str, torch.Tensor] | None = None,
        routing_id: bytes | None = None,
    ) -> int:
        """Queue the message on ``socket``; returns its sequence number (to match an ACK)."""
        seq = next(self._seq)
        specs: list[list[Any]] = []
        segments: list[tuple[int, memoryview]] = []  # (stream offset, bytes)
        offset = 0
        for name, tensor in (tensors or {}).items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be sent")
            offset = -(-offset // ALIGN) * ALIGN
            view = _byte_view(tensor)
            specs.append([name, dtype, list(tensor.shape), offset])
            segments.append((offset, view))
            offset += view.nbytes
        total = offset
        n_chunks = 0 if total <= self.chunk_bytes else math.ceil(total / self.chunk_bytes)
        body = msgpack.packb(
            {"h": header, "t": specs, "n": total, "c": self.chunk_bytes, "k": n_chunks}, use_bin_type=True
        )
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"header and specs take {len(body)} bytes (max {MAX_BODY_BYTES})")
        prefix = [routing_id] if routing_id is not None else []
        meta = HEAD_META.pack(self._nonce, seq) + self._sender
        data = _cut(segments, 0, total) if n_chunks == 0 else []
        key = one_time_key(self._key, b"H", self._nonce, seq, 0, self._sender)
        mac = tag(key, [meta, body, *data])
        socket.send_multipart([*prefix, HEAD, meta, body, mac, *data], copy=False)
        for index in range(n_chunks):
            start = index * self.chunk_bytes
            data = _cut(segments, start, min(start + self.chunk_bytes, total))
            meta = CHUNK_META.pack(self._nonce, seq, index, n_chunks) + self._sender
            key = one_time_key(self._key, b"C", self._nonce, seq, index, self._sender)
            mac = tag(key, [meta, *data])
            socket.send_multipart([*prefix, CHUNK, meta, mac, *data], copy=False)
        return seq


def _cut(segments: list[tuple[int, memoryview]], start: int, end: int) -> list[Any]:
    """Frames for stream bytes [start, end): slices of the tensors, zeros for the alignment gaps."""
    frames: list[Any] = []
    pos = start
    for offset, view in segments:
        seg_end = offset + view.nbytes
        if seg_end <= pos or view.nbytes == 0:
            continue
        if offset >= end:
            break
        if offset > pos:
            frames.append(bytes(offset - pos))  # an alignment gap: under 64 bytes
            pos = offset
        stop = min(seg_end, end)
        for at in range(pos, stop, FRAME_BYTES):  # no frame over the receivers' frame limit
            frames.append(view[at - offset : min(at + FRAME_BYTES, stop) - offset])
        pos = stop
    if pos < end:  # cannot happen: the stream ends with the last tensor
        frames.append(bytes(end - pos))
    return frames
