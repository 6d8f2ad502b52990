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


class Rejections:
    """Dropped messages and connections of one rank: counted (``count``) and logged."""

    def __init__(self, rank: int):
        self._rank = rank
        self._lock = threading.Lock()
        self._count = 0

    def reject(self, reason: str, peer: str) -> None:
        with self._lock:
            self._count += 1
        logger.warning(
            "rank %d: rejected a message from %s: %s", self._rank, peer or "<unknown peer>", reason
        )

    @property
    def count(self) -> int:
        with self._lock:
            return self._count
