"""What a peer costs before it proves it holds the key: the limits every listening port of a run keeps.

A port of a run is visible to every user of the node (``/proc/net/tcp``). Until a connection has
proven the key, it gets little: at most ``preauth_max_bytes`` buffered, ``preauth_timeout_s`` to
authenticate, and at most ``preauth_max_connections`` such connections per port (the oldest one is
closed for a new one, so a flood never locks the run's own ranks out, and the process keeps its file
descriptors for its own files).

ZMQ sockets: libzmq buffers a multipart message until its last frame arrives, and a frame up to
``MAXMSGSIZE`` even during the handshake. So every ZMQ socket of a run speaks ZMTP's PLAIN mechanism
with a password derived from the key (checked by ``ZapHandler``, on the thread of the port's
``ConnectionWatch``): a peer
without it never gets past the handshake, which libzmq ends after ``HANDSHAKE_IVL``; ``MAXMSGSIZE`` is
the pre-authentication budget, and every frame the run sends is at most ``FRAME_BYTES`` (bigger
parts are cut, see ``cut_frames``).

The cap closes the oldest waiting connection once it had ``CAP_GRACE_S`` to authenticate (a burst
of new connections does not push out a legitimate one whose first message is on its way), and at
once beyond ``HARD_CAP_FACTOR`` times the cap (descriptors stay bounded whatever the burst). The password travels in clear like the rest of the wire: it
keeps out peers that can reach a port, not those that can read the network (docs/security.md).

Threads: pure functions and constants, except ``ZapHandler`` (used by the connection watch's thread).
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import resource
import struct
import termios
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

logger = logging.getLogger(__name__)

FRAME_BYTES = (
    256 << 10
)  # no ZMQ frame the run sends is larger: runtime.rpc.preauth_max_bytes is at least this
FD_RESERVE = 256  # descriptors kept free for the run's own files beyond the connection caps
CAP_GRACE_S = 0.5  # the cap closes a waiting connection only once it had this long to authenticate...
HARD_CAP_FACTOR = 2  # ...unless this many times the cap are waiting (then the oldest goes at once)
MIN_TOKEN_CHARS = 16  # a bearer token (the train service's) shorter than this is refused: guessable
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
PLAIN_USERNAME = b"nexrl"


@dataclass(frozen=True)
class WireLimits:
    """``runtime.rpc``'s pre-authentication settings (docs/security.md)."""

    preauth_max_bytes: int  # bytes a connection may send before it authenticated (also ZMQ's frame limit)
    preauth_timeout_s: float  # to authenticate, and the longest a message may stall midway
    preauth_max_connections: int  # unauthenticated connections per listening port
    heartbeat_s: float  # ZMQ heartbeat interval; a peer silent for 3 of them is dropped

    @classmethod
    def from_config(cls, rpc: Mapping[str, Any]) -> WireLimits:
        return cls(
            rpc["preauth_max_bytes"],
            float(rpc["preauth_timeout_s"]),
            rpc["preauth_max_connections"],
            float(rpc["heartbeat_s"]),
        )


def token_problem(token: str, where: str) -> str | None:
    """Why the bearer token read from ``where`` (a variable, a setting) cannot be used, or None."""
    if not token:
        return f"the bearer token is read from {where}, which is not set"
    if len(token) < MIN_TOKEN_CHARS:
        return (
            f"the bearer token in {where} has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}: too easy "
            "to guess (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return None


def zmtp_password(key: bytes) -> bytes:
    """The ZMTP PLAIN password of everything signed with ``key`` (never the key itself)."""
    return hmac.digest(key, b"nexrl-zmtp-plain-v1", "sha256").hex().encode()


def _common(sock: zmq.Socket, limits: WireLimits) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, limits.preauth_max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(limits.preauth_timeout_s * 1000))
    ivl = int(limits.heartbeat_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)


def secure_server(sock: zmq.Socket, limits: WireLimits) -> None:
    """A listening socket: PLAIN server (its context needs a ``ZapHandler``), bounded frames and handshake."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    _common(sock, limits)


def secure_client(sock: zmq.Socket, key: bytes, limits: WireLimits) -> None:
    """A connecting socket: PLAIN credentials derived from ``key``, bounded frames and handshake."""
    sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, zmtp_password(key))
    _common(sock, limits)


def cut_frames(parts: list[Any]) -> tuple[list[Any], list[int] | None]:
    """``parts`` with every part over ``FRAME_BYTES`` cut into frames of at most that size, and the
    number of frames per part (None when nothing was cut: the usual small message costs nothing)."""
    if all(memoryview(p).nbytes <= FRAME_BYTES for p in parts):
        return parts, None
    frames: list[Any] = []
    counts: list[int] = []
    for part in parts:
        view = memoryview(part).cast("B")
        if view.nbytes <= FRAME_BYTES:
            frames.append(part)
            counts.append(1)
            continue
        pieces = [view[i : i + FRAME_BYTES] for i in range(0, view.nbytes, FRAME_BYTES)]
        frames.extend(pieces)
        counts.append(len(pieces))
    return frames, counts


def join_frames(frames: list[Any], counts: Any) -> list[Any]:
    """Inverse of ``cut_frames`` on a verified message; raises ``ValueError`` on counts that do not fit."""
    if not (isinstance(counts, list) and all(type(c) is int and c >= 1 for c in counts)):
        raise ValueError("malformed frame counts")
    if sum(counts) != len(frames):
        raise ValueError(f"frame counts add up to {sum(counts)}, the message has {len(frames)}")
    parts: list[Any] = []
    at = 0
    for count in counts:
        parts.append(frames[at] if count == 1 else b"".join(frames[at : at + count]))
        at += count
    return parts


def ensure_fd_room(listeners: int, limits: WireLimits, accept_burst: int = 0) -> None:
    """Make sure the connection caps of ``listeners`` new listening ports fit under the process's
    descriptor limit with ``FD_RESERVE`` to spare (raising the soft limit up to the hard one if
    needed); a ``ValueError`` naming the setting if they cannot. ``accept_burst``: connections a
    port may accept at once before its cap closes the extra ones (an event loop's accept batch)."""
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    needed = (
        open_now + listeners * (HARD_CAP_FACTOR * limits.preauth_max_connections + accept_burst) + FD_RESERVE
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ValueError(
            f"runtime.rpc.preauth_max_connections={limits.preauth_max_connections}: {listeners} port(s) x "
            f"{HARD_CAP_FACTOR * limits.preauth_max_connections} + {open_now} open + {FD_RESERVE} kept for the run's files "
            f"= {needed} descriptors, over the hard limit {hard} (ulimit -Hn): lower the setting"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    logger.info(
        "raised the soft descriptor limit from %d to %d (connection caps + room for files)", soft, needed
    )


class ZapHandler:
    """Answers libzmq's authentication requests (ZAP, RFC 27) for one context: PLAIN with the
    password derived from the key, or the connection is refused (libzmq closes it; the connection
    watch counts it). ``answer`` when ``socket`` is readable; one thread (the watch's)."""

    def __init__(self, ctx: zmq.Context, key: bytes, owner: str):
        self._password = zmtp_password(key)
        self._owner = owner
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def answer(self) -> None:
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._verdict(request))

    def _verdict(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed", b"", b""]
        version, request_id, address, mechanism = request[0], request[1], request[3], request[5]
        creds = request[6:]
        ok = (
            mechanism == b"PLAIN"
            and len(creds) == 2
            and hmac.compare_digest(creds[0], PLAIN_USERNAME)
            and hmac.compare_digest(creds[1], self._password)
        )
        if not ok:
            logger.warning(
                "%s: refused a ZMQ connection from %s: %s",
                self._owner,
                address.decode(errors="replace"),
                "wrong credentials"
                if mechanism == b"PLAIN"
                else f"mechanism {mechanism.decode(errors='replace')}",
            )
        return [version, request_id, b"200" if ok else b"400", b"OK" if ok else b"refused", b"", b""]

    def close(self) -> None:
        self.socket.close(linger=0)


def over_cap(waiting: int, oldest_age_s: float, cap: int) -> bool:
    """Whether the oldest of ``waiting`` unauthenticated connections (waiting ``oldest_age_s``) must go."""
    return waiting > HARD_CAP_FACTOR * cap or (waiting > cap and oldest_age_s >= CAP_GRACE_S)


def has_unread_bytes(sock: Any) -> bool:
    """Whether socket ``sock`` (anything with ``fileno``) has received bytes nobody read yet: a
    connection whose first message is already here (behind a burst of others) is not the one the
    cap closes."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] > 0
    except OSError:
        return False
