"""What an RPC message may be, and the count of what was refused.

The size limit (``runtime.rpc.max_message_mb``) and the error a caller gets when its own message
would break it, the bounds of the batches that share one signed message (requests in an outbox,
held replies), the errors a hostile message can raise while it is checked, and ``Rejections``:
every dropped message or connection, counted and logged with the peer's address.

Locks: ``Rejections`` has one lock of its own around its counter (any thread may reject); the rest
is constants and pure functions.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgpack

from nexrl_hpc.rpc.wire import RejectedMessage

logger = logging.getLogger(__name__)

# what a malformed or hostile message can raise while it is checked (never escapes the IO thread)
WIRE_ERRORS: tuple[type[Exception], ...] = (
    RejectedMessage,
    ValueError,
    KeyError,
    TypeError,
    msgpack.ExtraData,
    msgpack.FormatError,
    msgpack.StackError,
    OverflowError,
)
ZERO_COPY_BYTES = 64 << 10  # frames from this size are sent zero-copy; smaller ones are cheaper copied
HOLD_REPLY_BYTES = 16 << 10  # quick replies up to this size may share one message with others
HELD_BATCH_BYTES = 256 << 10  # a batch of held replies goes out at this size or count at the latest
HELD_BATCH_REPLIES = 64
BATCH_REQUESTS = 64  # queued quick requests to one peer leave together at this count at the latest


class MessageTooLarge(ValueError):
    pass


def message_size(frames: list[Any]) -> int:
    """Bytes on the wire; a packed single frame (the usual small call) is a plain ``bytes``."""
    if len(frames) == 1 and isinstance(frames[0], bytes):
        return len(frames[0])
    return sum(memoryview(f).nbytes for f in frames)


def over_limit(size: int, max_bytes: int) -> str:
    """Why a ``size``-byte message cannot be sent (the receiver would drop it)."""
    return f"a {size}-byte message exceeds runtime.rpc.max_message_mb ({max_bytes >> 20} MB)"


LOG_BURST = 50  # rejections logged one by one per LOG_WINDOW_S; beyond, counted and summed up
LOG_WINDOW_S = 10.0


class Rejections:
    """Dropped messages and connections of one rank: counted (``count``) and logged — one line
    each up to ``LOG_BURST`` per ``LOG_WINDOW_S``, then one line for the rest, so a flood does
    not fill the disk with the run's log."""

    def __init__(self, rank: int | str):
        self._who = f"rank {rank}" if isinstance(rank, int) else rank
        self._lock = threading.Lock()
        self._count = 0
        self._window_start = 0.0
        self._in_window = 0
        self._quiet = 0

    def reject(self, reason: str, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._count += 1
            if now - self._window_start >= LOG_WINDOW_S:
                quiet, self._quiet = self._quiet, 0
                self._window_start, self._in_window = now, 0
            else:
                quiet = 0
            self._in_window += 1
            log = self._in_window <= LOG_BURST
            if not log:
                self._quiet += 1
        if quiet:
            logger.warning("%s: %d more rejections not logged one by one", self._who, quiet)
        if log:
            logger.warning("%s: rejected a message from %s: %s", self._who, peer or "<unknown peer>", reason)

    @property
    def count(self) -> int:
        with self._lock:
            return self._count
