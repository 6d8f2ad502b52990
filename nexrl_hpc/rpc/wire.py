"""Signed messages: ``[signature, header, buffer...]``, or one packed frame when small.

The signature is HMAC-SHA256 with the job key over every part, each preceded by its length (so
parts cannot be re-cut). A message of a header and one small payload travels as a single frame
``signature | len(header) | header | payload`` — same signature, but one ZMQ frame instead of three
(per-frame sends and receives were a third of a small call's cost). A message is checked — frame
count, sizes, signature, sender sequence number — before a single byte of it is decoded; anything
that fails is dropped and counted.

Every envelope names its kind (the direction: ``req``/``reqs``/``hi`` go to a server, ``rep``/``reps``
back to a caller), its sender rank (``src``) and its recipient rank (``to``), all under the
signature: a message meant for another rank is rejected (``check_request``) before the replay guard
sees it, so it cannot resolve another rank's pending call, and cannot use up a sequence number.
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
_HEADER_LEN = struct.Struct(">I")
_PACKED_PREFIX = SIG_BYTES + _HEADER_LEN.size
PACK_BELOW_BYTES = 64 << 10  # header + payload under this (and no buffers): one frame


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


def seal_message(key: bytes, header: bytes, payload: bytes, buffers: list[Any]) -> list[Any]:
    """The frames to send: one packed frame for a small message without buffers, else ``seal``."""
    if buffers or len(header) + len(payload) >= PACK_BELOW_BYTES:
        return seal(key, header, [payload, *buffers])
    mac = hmac.digest(
        key, b"".join((_LEN.pack(len(header)), header, _LEN.pack(len(payload)), payload)), "sha256"
    )
    return [b"".join((mac, _HEADER_LEN.pack(len(header)), header, payload))]


def open_message(key: bytes, frames: list[Any], max_bytes: int) -> tuple[bytes, list[Any]]:
    """Verify a received message (packed or multipart); return (header, [payload, buffers...])."""
    if len(frames) != 1:
        return open_frames(key, frames, max_bytes)
    frame = memoryview(frames[0])
    size = frame.nbytes
    if size > max_bytes:
        raise RejectedMessage(f"{size} bytes exceeds the {max_bytes}-byte limit")
    if size < _PACKED_PREFIX:
        raise RejectedMessage(f"a {size}-byte frame is too short for a signed message")
    (header_len,) = _HEADER_LEN.unpack_from(frame, SIG_BYTES)
    if _PACKED_PREFIX + header_len > size:
        raise RejectedMessage("malformed packed message (header length past the end)")
    header = frame[_PACKED_PREFIX : _PACKED_PREFIX + header_len].tobytes()
    payload = frame[_PACKED_PREFIX + header_len :].tobytes()
    expected = hmac.digest(
        key, b"".join((_LEN.pack(header_len), header, _LEN.pack(len(payload)), payload)), "sha256"
    )
    if not hmac.compare_digest(frame[:SIG_BYTES].tobytes(), expected):
        raise RejectedMessage("bad signature")
    return header, [payload]


# the fields every kind of envelope must carry, and their types (besides t, src, to, s, q)
_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "req": (("id", int), ("m", str), ("f", str)),
    "reqs": (),
    "hi": (),
    "rep": (("id", int), ("ok", bool)),
    "reps": (),
}


def check_request(envelope: Any, rank: int, kinds: tuple[str, ...]) -> str:
    """The kind of a verified envelope meant for ``rank``; ``RejectedMessage`` for anything else
    (another recipient, another kind, a missing or mistyped field): nothing downstream may fail on it."""
    if type(envelope) is not dict:
        raise RejectedMessage("the envelope is not a map")
    kind = envelope.get("t")
    if kind not in kinds:
        raise RejectedMessage(f"unexpected message kind {kind!r}")
    to = envelope.get("to")
    if to != rank or type(to) is not int:
        raise RejectedMessage(f"a message for rank {to!r} (replayed or misrouted)")
    if (
        type(envelope.get("src")) is not int
        or type(envelope.get("s")) is not str
        or type(envelope.get("q")) is not int
    ):
        raise RejectedMessage("malformed envelope (src, s or q)")
    for name, kind_type in _FIELDS[kind]:
        if type(envelope.get(name)) is not kind_type:
            raise RejectedMessage(f"malformed envelope ({name})")
    return kind


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
