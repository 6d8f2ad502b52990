"""The direct lane: a blocking call to a ``@quick`` method over a plain TCP connection of its own.

Over ZMQ a message crosses two extra threads per direction (the caller's libzmq IO thread, the
peer's), and each wake-up costs tens of microseconds on a small VM: a bare pyzmq round trip is
~100-200 µs here whatever Python does, a plain TCP one ~15-40 µs. On the lane the caller writes its
signed request to a socket it owns and blocks reading the reply; the peer's RPC IO thread polls the
lane's sockets next to its ROUTER, answers at once and writes the reply on the same connection.

Messages are exactly the signed messages of the ZMQ path (``seal_message`` / ``open_message``),
framed on the byte stream as::

    b"NXL1" | frame count (u32) | total bytes (u64) | one u64 length per frame | the frames

The header is checked (magic, frame count, total against the size limit) before anything more is
buffered, and a message is verified (HMAC, sender sequence) before a byte of it is decoded. A
byte stream cannot resynchronise after garbage, so a connection that sends anything else is
counted, logged with its address and closed.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from nexrl_hpc.rpc.wire import RejectedMessage

MAGIC = b"NXL1"
_HEAD = struct.Struct(">4sIQ")
_LENGTH = struct.Struct(">Q")
MAX_FRAMES = 4096  # a message has a signature, a header, a payload and one frame per tensor
SENDMSG_MAX_BUFFERS = 512  # per sendmsg call (the kernel refuses more than IOV_MAX, 1024 on Linux)
RECV_BYTES = 64 << 10  # per recv: under malloc's mmap threshold (a bigger buffer costs an mmap per call)


def lane_parts(frames: list[Any]) -> list[Any]:
    """The byte strings that carry ``frames`` on the stream, in order (for ``sendmsg``)."""
    views = [memoryview(f).cast("B") for f in frames]
    lengths = b"".join(_LENGTH.pack(v.nbytes) for v in views)
    return [_HEAD.pack(MAGIC, len(views), sum(v.nbytes for v in views)) + lengths, *views]


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Write every byte of ``parts`` on a blocking socket (one syscall when the kernel takes it all)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        drop_sent(views, sock.sendmsg(views[:SENDMSG_MAX_BUFFERS]))


def drop_sent(views: list[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes from ``views`` (what a ``sendmsg`` took), in place."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]


class LaneReader:
    """Cuts a byte stream into messages (lists of frames); raises ``RejectedMessage`` on anything
    that is not a well-formed message within ``max_bytes`` (the lane server raises it once the
    connection has authenticated: before, a message may be at most the pre-authentication budget)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._lengths: list[int] | None = None
        self._body_at = 0

    @property
    def idle(self) -> bool:
        """No partial message buffered."""
        return not self._buf

    def feed(self, data: bytes) -> list[list[bytes]]:
        self._buf += data
        messages: list[list[bytes]] = []
        while True:
            message = self.next_message()
            if message is None:
                return messages
            messages.append(message)

    def add(self, data: bytes) -> None:
        """Buffer ``data``; take the messages one at a time with ``next_message``."""
        self._buf += data

    def next_message(self) -> list[bytes] | None:
        """The next whole message buffered, or None."""
        buf = self._buf
        if self._lengths is None:
            if len(buf) < _HEAD.size:
                return None
            magic, count, total = _HEAD.unpack_from(buf)
            if magic != MAGIC:
                raise RejectedMessage("not a lane message (bad magic)")
            if not 1 <= count <= MAX_FRAMES:
                raise RejectedMessage(f"a lane message announcing {count} frames")
            if total > self.max_bytes:
                raise RejectedMessage(
                    f"a lane message announcing {total} bytes exceeds the {self.max_bytes}-byte limit"
                )
            lengths_end = _HEAD.size + count * _LENGTH.size
            if len(buf) < lengths_end:
                return None
            lengths = [_LENGTH.unpack_from(buf, _HEAD.size + i * _LENGTH.size)[0] for i in range(count)]
            if sum(lengths) != total:
                raise RejectedMessage("malformed lane message (frame lengths do not add up)")
            self._lengths, self._body_at = lengths, lengths_end
        end = self._body_at + sum(self._lengths)
        if len(buf) < end:
            return None
        frames, at = [], self._body_at
        for n in self._lengths:
            frames.append(bytes(buf[at : at + n]))
            at += n
        del buf[:end]
        self._lengths = None
        return frames


def connect_lane(address: str, timeout_s: float) -> socket.socket:
    """A blocking TCP connection to a lane at ``tcp://host:port``; reads wake every ``timeout_s``."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    return sock


def listen_lane(host: str) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on ``host`` (an address, never a wildcard by default) and
    its ``tcp://host:port`` address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(256)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    return sock, f"tcp://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}"
