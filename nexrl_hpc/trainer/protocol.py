"""Messages between a train-service client and trainer rank 0 (the rank-0-centric protocol).

Every message is a msgpack header (kind, op id, operation, arguments) plus raw tensor buffers
described in it — no pickle — in ``rpc.bulk``'s signed format (a Poly1305 tag per head and chunk,
keys derived from the group key, sequence numbers checked). Kinds:

- ``data``    client -> rank 0: a whole batch for ``operation``; rank 0 keeps it and answers ``ack``.
- ``execute`` client or API server -> rank 0: run the op whose data was ACKed; rank 0 answers
  ``started`` to the sender and, when done, ``result`` to the client that sent the data.
- ``call``    -> rank 0: an operation without a batch (init_model, save_checkpoint, ...); ``result``.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

import torch
import zmq

from nexrl_hpc.rpc.bulk.format import MAX_BODY_BYTES
from nexrl_hpc.rpc.bulk.receiver import BulkReceiver
from nexrl_hpc.rpc.bulk.sender import BulkSender

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
    """Signs what it sends and checks what it receives, in ``rpc.bulk``'s format: a Poly1305 tag
    per head and per chunk under one-time keys derived from the group key, so a whole batch is
    authenticated at close to the socket's speed; nothing is decoded before its tag checks out."""

    def __init__(self, key: bytes, max_bytes: int, name: str = "", chunk_bytes: int = 4 << 20):
        self.sender = f"{name}:{secrets.token_hex(6)}"
        self._out = BulkSender(key, self.sender, chunk_bytes=chunk_bytes)
        self._in = BulkReceiver(key, max_bytes, name=name or "train service")
        self.max_frame_bytes = max(chunk_bytes, MAX_BODY_BYTES) + (1 << 16)

    @property
    def rejected(self) -> int:
        return self._in.rejected

    def prepare(self, sock: zmq.Socket) -> None:
        """ZMQ refuses a frame over what this format ever sends before allocating it."""
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)

    def send(
        self,
        sock: zmq.Socket,
        header: dict[str, Any],
        tensors: dict[str, torch.Tensor] | None = None,
        routing_id: bytes | None = None,
    ) -> None:
        self._out.send(sock, header, tensors, routing_id=routing_id)

    def feed(self, frames: list[Any]) -> tuple[bytes | None, dict[str, Any], dict[str, torch.Tensor]] | None:
        """One received ZMQ message; (routing id, header, tensors) once a whole verified message is
        in, else None (a chunk of a longer one, or something dropped and counted)."""
        self._in.expire()
        msg = self._in.feed(frames)
        if msg is None:
            return None
        if not isinstance(msg.header, dict) or "kind" not in msg.header:
            self._in.rejected += 1
            return None
        return msg.routing_id, msg.header, dict(msg.tensors)
