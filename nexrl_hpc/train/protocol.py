"""Messages between a train-service client and trainer rank 0 (seed 002's rank-0-centric protocol).

Every message is ``[signature, header, buffers...]`` signed with the group's key (``rpc.wire``):
the header is msgpack (kind, op id, operation, arguments, sender and sequence number), tensors are
raw buffers described in the header — no pickle. Kinds:

- ``data``    client -> rank 0: a whole batch for ``operation``; rank 0 keeps it and answers ``ack``.
- ``execute`` client or API server -> rank 0: run the op whose data was ACKed; rank 0 answers
  ``started`` to the sender and, when done, ``result`` to the client that sent the data.
- ``call``    -> rank 0: an operation without a batch (init_model, save_checkpoint, ...); ``result``.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from typing import Any

import msgpack
import torch
import zmq

from nexrl_hpc.rpc.codec import decode, encode
from nexrl_hpc.rpc.wire import RejectedMessage, SequenceGuard, open_frames, seal

BATCH_OPERATIONS = ("compute_log_prob", "update_actor")
CALL_OPERATIONS = (
    "initialize_worker",
    "init_model",
    "save_checkpoint",
    "load_checkpoint",
    "export_weights",
    "ping",
)


class TrainerRankError(RuntimeError):
    """A trainer group operation failed or a rank did not answer; the message names the rank."""


def key_from_token(token: str, identifier: str) -> bytes:
    """The ZMQ signing key of a standalone worker group: only holders of the bearer token have it."""
    return hmac.digest(token.encode(), b"nexrl-train-service:" + identifier.encode(), "sha256")


class SignedChannel:
    """Signs what it sends and checks what it receives (frame sizes, HMAC, per-sender sequence)."""

    def __init__(self, key: bytes, max_bytes: int, name: str = ""):
        self._key = key
        self._max_bytes = max_bytes
        self.sender = f"{name}:{secrets.token_hex(6)}"
        self._seq = itertools.count(1)
        self._guard = SequenceGuard()
        self.rejected = 0

    def send(
        self,
        sock: zmq.Socket,
        header: dict[str, Any],
        tensors: dict[str, torch.Tensor] | None = None,
        routing_id: bytes | None = None,
    ) -> None:
        header = dict(header, s=self.sender, q=next(self._seq))
        payload, buffers = encode(tensors or {})
        frames = seal(self._key, msgpack.packb(header, use_bin_type=True), [payload, *buffers])
        size = sum(memoryview(f).nbytes for f in frames)
        if size > self._max_bytes:
            raise ValueError(
                f"a {size}-byte {header.get('operation', header.get('kind'))} message exceeds the "
                f"{self._max_bytes >> 20} MB limit (max_message_mb)"
            )
        if routing_id is not None:
            frames = [routing_id, *frames]
        sock.send_multipart(frames, copy=size < (64 << 10))

    def open(self, frames: list[Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Verify, then decode; raises RejectedMessage (nothing decoded) on anything wrong."""
        try:
            header_bytes, rest = open_frames(self._key, frames, self._max_bytes)
            header = msgpack.unpackb(header_bytes, raw=False)
            if not isinstance(header, dict) or "kind" not in header or not rest:
                raise RejectedMessage("not a train-service message")
            self._guard.check(str(header["s"]), int(header["q"]))
        except RejectedMessage:
            self.rejected += 1
            raise
        except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            self.rejected += 1
            raise RejectedMessage(str(exc)) from exc
        tensors = decode(bytes(rest[0]), [bytes(b) if not isinstance(b, bytes) else b for b in rest[1:]])
        return header, tensors


def check_batch(operation: str, tensors: dict[str, Any]) -> None:
    """Names and row counts checked on the client, before a byte is sent."""
    from nexrl_hpc.train.local_engine import REQUIRED_KEYS, check_training_batch

    need = REQUIRED_KEYS + (("old_log_probs", "advantages") if operation == "update_actor" else ())
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{operation} batch: {bad} are not tensors")
    check_training_batch(tensors, need)
