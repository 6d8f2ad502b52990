"""The bulk wire format and its authentication: frame layouts, the key schedule, Poly1305 tags.

Wire format. A message is a *head* ZMQ message ``[b"NXB1H", meta, body, tag, *data]`` followed,
when the tensor bytes exceed ``chunk_bytes``, by ``n`` *chunk* messages
``[b"NXB1C", meta, tag, *data]``. ``meta`` is a fixed struct (sender nonce, sequence number,
chunk index and count) plus the sender id; ``body`` is msgpack: the user header, the tensor specs
(name, dtype, shape, offset) and the stream layout (total bytes, chunk size). Tensors are laid end
to end in one byte stream (each at a 64-byte aligned offset); chunk ``i`` carries bytes
``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of it, as zero-copy slices of the sender's tensors,
none over ``FRAME_BYTES`` (the receiving socket's frame limit is the pre-authentication budget).
Chunks must arrive in order over the head's connection (ZMQ keeps a connection's order).
``header`` is plain msgpack data; tensors may have any dtype in ``DTYPES`` (bfloat16 included),
any shape (empty too) and arrive with the same dtype, shape and bytes. No pickle anywhere.

Authentication. Every ZMQ message (head or chunk) carries a Poly1305 tag over all of its frames,
each preceded by its length. Poly1305 is a one-time MAC (its key must never authenticate two
messages) and runs at ~5-6 GB/s on one core, against ~1.4 GB/s for HMAC-SHA256, which would cap
the whole transfer below the bare-socket speed. Each head/chunk therefore gets its own key:
``HMAC-SHA256(bulk_key, kind || nonce || seq || index || sender_id)``, with ``bulk_key`` derived
from the job key (domain-separated from the RPC layer's HMAC). HMAC-SHA256 is a PRF, so the keys
are independent and unknown without the job key; ``(nonce, seq, index)`` never repeats for a
sender (``seq`` is a per-sender counter, ``nonce`` is random per sender instance, so a restarted
sender never reuses a key either). This is the key schedule of ChaCha20-Poly1305 with HMAC as the
PRF. The head's tag covers the header and the tensor specs, the chunk tags cover every data byte
and bind it to (sender, message, index, count): chunks cannot be moved between messages or
positions, dropped or duplicated without detection, and the head's sequence number goes through
a ``SequenceGuard`` (replays rejected).

Pure constants and functions: no state, no locks.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from typing import Any

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from nexrl_hpc.rpc.preauth import FRAME_BYTES
from nexrl_hpc.rpc.wire import RejectedMessage

HEAD = b"NXB1H"
CHUNK = b"NXB1C"
TAG_BYTES = 16
ALIGN = 64
DEFAULT_CHUNK_BYTES = 4 << 20  # 1-8 MiB measured alike in bench/transfer.py; 4 MiB stays in L3
MAX_SENDER_ID_BYTES = 255
MAX_BODY_BYTES = FRAME_BYTES  # the head's body is one frame: within every receiver's frame limit
HEAD_META = struct.Struct(">16sQ")  # nonce, seq (+ sender id)
CHUNK_META = struct.Struct(">16sQII")  # nonce, seq, chunk index, chunk count (+ sender id)
_KDF_INPUT = struct.Struct(">c16sQI")
_LEN = struct.Struct(">Q")
_KDF_CONTEXT = b"nexrl-bulk-v1/poly1305-keys"

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def bulk_key(job_key: bytes) -> bytes:
    """The key bulk MAC keys derive from; separate from the RPC layer's use of the job key."""
    return hmac.digest(job_key, _KDF_CONTEXT, "sha256")


def one_time_key(key: bytes, kind: bytes, nonce: bytes, seq: int, index: int, sender: bytes) -> bytes:
    return hmac.digest(key, _KDF_INPUT.pack(kind, nonce, seq, index) + sender, "sha256")


def tag(key: bytes, frames: Sequence[Any]) -> bytes:
    mac = Poly1305(key)
    for frame in frames:
        mac.update(_LEN.pack(memoryview(frame).nbytes))
        mac.update(frame)
    return mac.finalize()


def verify(key: bytes, frames: Sequence[Any], tag: bytes) -> None:
    mac = Poly1305(key)
    for frame in frames:
        mac.update(_LEN.pack(frame.nbytes))
        mac.update(frame)
    try:
        mac.verify(tag)
    except InvalidSignature:
        raise RejectedMessage("bad tag") from None
