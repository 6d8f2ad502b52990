"""Messages between a train-service client and trainer rank 0 (the rank-0-centric protocol).

Every message is a msgpack header (kind, op id, operation, arguments) plus raw tensor buffers
described in it — no pickle — in ``rpc.bulk``'s signed format (a Poly1305 tag per head and chunk,
keys derived from the group key, sequence numbers checked). Kinds:

- ``data``    client -> rank 0: a whole batch for ``operation``; rank 0 keeps it and answers ``ack``.
- ``execute`` client or API server -> rank 0: run the op whose data was ACKed; rank 0 answers
  ``started`` to the sender and, when done, ``result`` to the client that sent the data.
- ``call``    -> rank 0: an operation without a batch (init_model, save_checkpoint, ...); ``result``.

Every header names its recipient (``to``, under the tags): rank 0's address for what goes to rank
0, the client channel's sender id for its answers; a message for anyone else is dropped and
counted. The sockets speak ZMTP PLAIN with the password derived from the group key, frames at most
the pre-authentication budget (``nexrl_hpc/rpc/preauth.py``). A standalone worker group's key is
derived from the bearer token and a session the API server draws at each group start
(``key_from_token``), so what was captured before a restart does not replay after it.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

import torch
import zmq

from nexrl_hpc.rpc.bulk.receiver import BulkReceiver
from nexrl_hpc.rpc.bulk.sender import BulkSender
from nexrl_hpc.rpc.preauth import WireLimits, secure_client, secure_server

BATCH_OPERATIONS = ("compute_log_prob", "update_actor")
CALL_OPERATIONS = (
    "initialize_worker",
    "init_model",
    "save_checkpoint",
    "load_checkpoint",
    "export_weights",
    "broadcast_weights",
    "ping",
)


class TrainerRankError(RuntimeError):
    """A trainer group operation failed or a rank did not answer; the message names the rank."""


def key_from_token(token: str, identifier: str, session: str) -> bytes:
    """The signing key of a standalone worker group for one start of it (``session``, drawn by the
    API server when the group registers): only holders of the bearer token have it, and it changes
    with every start."""
    info = b"nexrl-train-service:" + identifier.encode() + b"\x00" + session.encode()
    return hmac.digest(token.encode(), info, "sha256")


class SignedChannel:
    """Signs what it sends and checks what it receives, in ``rpc.bulk``'s format: a Poly1305 tag
    per head and per chunk under one-time keys derived from the group key, so a whole batch is
    authenticated at close to the socket's speed; nothing is decoded before its tag checks out.
    ``me`` is what the ``to`` of an accepted message must say (default: this channel's sender id;
    trainer rank 0 sets its address)."""

    def __init__(
        self, key: bytes, max_bytes: int, limits: WireLimits, name: str = "", chunk_bytes: int = 4 << 20
    ):
        self.sender = f"{name}:{secrets.token_hex(6)}"
        self._key = key
        self._limits = limits
        self._out = BulkSender(key, self.sender, chunk_bytes=chunk_bytes)
        self._in = BulkReceiver(key, max_bytes, name=name or "train service", recipient=self.sender)

    @property
    def me(self) -> str:
        return self._in.recipient or ""

    @me.setter
    def me(self, name: str) -> None:
        self._in.recipient = name

    @property
    def rejected(self) -> int:
        return self._in.rejected

    def prepare_server(self, sock: zmq.Socket) -> None:
        """A listening socket: PLAIN (its context needs a ``ConnectionWatch``), bounded frames."""
        secure_server(sock, self._limits)

    def prepare_client(self, sock: zmq.Socket) -> None:
        """A connecting socket: the PLAIN password derived from the key, bounded frames."""
        secure_client(sock, self._key, self._limits)

    def send(
        self,
        sock: zmq.Socket,
        header: dict[str, Any],
        to: str,
        tensors: dict[str, torch.Tensor] | None = None,
        routing_id: bytes | None = None,
    ) -> None:
        self._out.send(sock, dict(header, to=to), tensors, routing_id=routing_id)

    def feed(
        self, frames: list[Any]
    ) -> tuple[bytes | None, str, dict[str, Any], dict[str, torch.Tensor]] | None:
        """One received ZMQ message; (routing id, sender, header, tensors) once a whole verified
        message for this channel is in, else None (a chunk of a longer one, or something dropped
        and counted)."""
        self._in.expire()
        msg = self._in.feed(frames)
        if msg is None:
            return None
        if not isinstance(msg.header, dict) or "kind" not in msg.header:
            self._in.rejected += 1
            return None
        return msg.routing_id, msg.sender, msg.header, dict(msg.tensors)
