"""Signed multipart messages: ``[signature, header, buffer...]``.

The signature is HMAC-SHA256 with the job key over every frame, each preceded by its length (so
frames cannot be re-cut). A message is checked — frame count, sizes, signature, sender sequence
number — before a single byte of it is decoded; anything that fails is dropped and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from typing import Any

SIG_BYTES = 32
_ONE_SHOT_BYTES = 64 << 10
_LEN = struct.Struct(">Q")


class RejectedMessage(Exception):
    """Why a message was dropped (never raised to callers: counted and logged)."""


def sign(key: bytes, frames: list[Any]) -> bytes:
    views = [memoryview(f) for f in frames]
    if sum(v.nbytes for v in views) < _ONE_SHOT_BYTES:  # small: one C call over the length-prefixed frames
        return hmac.digest(key, b"".join(_LEN.pack(v.nbytes) + v.tobytes() for v in views), "sha256")
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for view in views:
        mac.update(_LEN.pack(view.nbytes))
        mac.update(view)
    return mac.digest()


def seal(key: bytes, header: bytes, buffers: list[Any]) -> list[Any]:
    frames = [header, *buffers]
    return [sign(key, frames), *frames]


def open_frames(key: bytes, frames: list[Any], max_bytes: int) -> tuple[bytes, list[Any]]:
    """Verify a received multipart message; return (header, buffers) or raise RejectedMessage."""
    if len(frames) < 2:
        raise RejectedMessage(f"{len(frames)} frame(s), expected a signature and a header")
    total = 0
    for frame in frames:
        total += memoryview(frame).nbytes
    if total > max_bytes:
        raise RejectedMessage(f"{total} bytes exceeds the {max_bytes}-byte limit")
    signature = bytes(frames[0])
    if len(signature) != SIG_BYTES:
        raise RejectedMessage("malformed signature frame")
    if not hmac.compare_digest(signature, sign(key, frames[1:])):
        raise RejectedMessage("bad signature")
    return bytes(frames[1]), list(frames[2:])


class SequenceGuard:
    """Rejects replays: per sender, sequence numbers must increase."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def check(self, sender: str, seq: int) -> None:
        with self._lock:
            last = self._last.get(sender, -1)
            if seq <= last:
                raise RejectedMessage(f"replayed or reordered message from {sender} (seq {seq} <= {last})")
            self._last[sender] = seq
