"""Signed bulk tensor messages: exact round trips, chunking, and hostile input dropped and counted."""

from __future__ import annotations

import gc
import logging
import math
import secrets
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from nexrl_hpc.rpc.bulk.format import CHUNK, HEAD
from nexrl_hpc.rpc.bulk.receiver import BufferPool, BulkMessage, BulkReceiver
from nexrl_hpc.rpc.bulk.sender import BulkSender

KEY = secrets.token_bytes(32)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """(DEALER, ROUTER) over inproc: the shape of a driver -> trainer rank connection."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://bulk")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("inproc://bulk")
    yield dealer, router
    dealer.close(0)
    router.close(0)
    ctx.term()


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (9,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (2, 2), generator=g, dtype=torch.int32),
        "i16": torch.tensor([-32768, 1, 32767], dtype=torch.int16),
        "i8": torch.tensor([[-128, 5, 127]], dtype=torch.int8),
        "u8": torch.arange(255, dtype=torch.uint8).reshape(5, 51),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
    }


def assert_same(sent: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(sent)
    for name, t in sent.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def capture(
    dealer: zmq.Socket, router: zmq.Socket, sender: BulkSender, header: dict, tensors: dict
) -> list[list[bytes]]:
    """Send one bulk message and return the ZMQ messages the ROUTER got (routing id first)."""
    total = 0
    for t in tensors.values():
        total = -(-total // 64) * 64 + t.numel() * t.element_size()
    expected = 1 + (math.ceil(total / sender.chunk_bytes) if total > sender.chunk_bytes else 0)
    sender.send(dealer, header, tensors)
    msgs = []
    for _ in range(expected):
        assert router.poll(2000)
        msgs.append(router.recv_multipart())
    assert not router.poll(0)
    return msgs


def feed_all(receiver: BulkReceiver, msgs: list[list[bytes]]) -> list[BulkMessage]:
    return [m for frames in msgs if (m := receiver.feed(frames)) is not None]


def test_round_trip_mixed_dtypes_over_sockets(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    sent = mixed_tensors()
    sender, receiver = BulkSender(KEY, "driver"), BulkReceiver(KEY, 1 << 20)
    seq = sender.send(dealer, {"step": 3, "tags": ["a", "b"], "lr": 1e-3}, sent)
    msg = receiver.recv(router, timeout_s=5)
    assert msg is not None
    assert msg.header == {"step": 3, "tags": ["a", "b"], "lr": 1e-3}
    assert (msg.sender, msg.seq) == ("driver", seq)
    assert msg.routing_id is not None  # a ROUTER names the peer
    assert_same(sent, msg.tensors)
    # the answer goes back through the ROUTER to that peer (the ACK direction); no tensors at all
    acker, ack_receiver = BulkSender(KEY, "rank0"), BulkReceiver(KEY, 1 << 20)
    acker.send(router, {"ack": seq}, routing_id=msg.routing_id)
    ack = ack_receiver.recv(dealer, timeout_s=5)
    assert ack is not None and ack.header == {"ack": seq} and ack.tensors == {} and ack.routing_id is None
    assert receiver.rejected == ack_receiver.rejected == 0


def test_big_message_spans_many_chunks(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    sender, receiver = BulkSender(KEY, "driver", chunk_bytes=4096), BulkReceiver(KEY, 1 << 20)
    sent = {
        "ids": torch.arange(10_000, dtype=torch.int64).reshape(100, 100),  # 80 kB: split over chunks
        "mask": torch.rand(333) > 0.5,  # odd length: the next tensor starts at an aligned offset
        "logp": -torch.rand(1000, dtype=torch.float32).to(torch.bfloat16),
        "empty": torch.zeros(0),
    }
    msgs = capture(dealer, router, sender, {"step": 1}, sent)
    assert len(msgs) > 20 and msgs[0][1] == HEAD and all(m[1] == CHUNK for m in msgs[1:])
    done = feed_all(receiver, msgs[:-1])
    assert done == [] and receiver.pending == 1  # never handed out before the last chunk checks out
    msg = receiver.feed(msgs[-1])
    assert msg is not None and receiver.pending == 0 and receiver.rejected == 0
    assert_same(sent, msg.tensors)


def good_message_still_works(dealer: zmq.Socket, router: zmq.Socket, receiver: BulkReceiver) -> None:
    sent = {"x": torch.arange(3000, dtype=torch.int32)}
    msgs = capture(dealer, router, BulkSender(KEY, "driver-2", chunk_bytes=1024), {"ok": True}, sent)
    before = receiver.rejected
    (msg,) = feed_all(receiver, msgs)
    assert msg.header == {"ok": True} and receiver.rejected == before
    assert_same(sent, msg.tensors)


def _flip(frame: bytes, at: int = 0) -> bytes:
    b = bytearray(frame)
    b[at] ^= 1
    return bytes(b)


def test_forged_chunk_drops_the_message(
    pair: tuple[zmq.Socket, zmq.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20)
    msgs = capture(dealer, router, BulkSender(KEY, "driver", chunk_bytes=1024), {}, {"x": torch.ones(2000)})
    msgs[3][-1] = _flip(msgs[3][-1], 17)  # one data bit of chunk 2
    with caplog.at_level(logging.WARNING, logger="nexrl_hpc.rpc.bulk.receiver"):
        assert feed_all(receiver, msgs) == []
    # the forged chunk and every later chunk of that message are dropped; one log line names the peer
    assert receiver.rejected == len(msgs) - 3 and receiver.pending == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "bad tag" in lines[0] and msgs[0][0].hex() in lines[0] and "driver" in lines[0]
    good_message_still_works(dealer, router, receiver)


@pytest.mark.parametrize("what", ["header", "swapped chunks", "chunk index"])
def test_tampered_head_or_chunk_order_is_dropped(pair: tuple[zmq.Socket, zmq.Socket], what: str) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20)
    msgs = capture(
        dealer, router, BulkSender(KEY, "driver", chunk_bytes=1024), {"step": 1}, {"x": torch.arange(1000.0)}
    )
    if what == "header":
        msgs[0][3] = msgs[0][3].replace(b"step", b"stap")
    elif what == "swapped chunks":
        msgs[1][4:], msgs[2][4:] = msgs[2][4:], msgs[1][4:]
    else:  # chunk 0 claims to be chunk 1 (meta: nonce, seq, index, count, sender)
        meta = bytearray(msgs[1][2])
        meta[24:28] = (1).to_bytes(4, "big")
        msgs[1][2] = bytes(meta)
    assert feed_all(receiver, msgs) == []
    assert receiver.rejected >= 1 and receiver.pending == 0
    good_message_still_works(dealer, router, receiver)


def test_wrong_key_is_dropped(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20)
    forger = BulkSender(secrets.token_bytes(32), "driver", chunk_bytes=1024)
    msgs = capture(dealer, router, forger, {"evil": True}, {"x": torch.ones(1000)})
    assert feed_all(receiver, msgs) == []
    assert receiver.rejected == len(msgs) and receiver.pending == 0
    good_message_still_works(dealer, router, receiver)


def test_truncated_messages_are_dropped(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20, chunk_timeout_s=30.0)
    sender = BulkSender(KEY, "driver", chunk_bytes=1024)
    # a chunk cut short
    msgs = capture(dealer, router, sender, {}, {"x": torch.ones(1000)})
    msgs[2][-1] = msgs[2][-1][:-8]
    assert feed_all(receiver, msgs) == [] and receiver.rejected >= 1
    # a frame missing from the head, an empty message
    msgs = capture(dealer, router, sender, {}, {"x": torch.ones(10)})
    rejected = receiver.rejected
    assert receiver.feed(msgs[0][:-1]) is None and receiver.feed([]) is None
    assert receiver.rejected == rejected + 2
    # the last chunk never comes: dropped after the timeout, counted
    msgs = capture(dealer, router, sender, {}, {"x": torch.ones(1000)})
    assert feed_all(receiver, msgs[:-1]) == [] and receiver.pending == 1
    rejected = receiver.rejected
    assert receiver.expire(now=time.monotonic() + 1.0) == 0
    assert receiver.expire(now=time.monotonic() + 31.0) == 1
    assert receiver.pending == 0 and receiver.rejected == rejected + 1
    assert receiver.feed(msgs[-1]) is None and receiver.rejected == rejected + 2  # too late
    good_message_still_works(dealer, router, receiver)


def test_replays_are_dropped(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20)
    msgs = capture(
        dealer, router, BulkSender(KEY, "driver", chunk_bytes=1024), {}, {"x": torch.arange(1000.0)}
    )
    (msg,) = feed_all(receiver, msgs)
    assert torch.equal(msg.tensors["x"], torch.arange(1000.0)) and receiver.rejected == 0
    # the whole message again: head (sequence number) and chunks (no such message) are refused
    assert feed_all(receiver, msgs) == []
    assert receiver.rejected == len(msgs) and receiver.pending == 0
    # a chunk replayed inside a message spoils that message (a connection never repeats one)
    msgs = capture(dealer, router, BulkSender(KEY, "driver", chunk_bytes=1024), {}, {"x": torch.ones(1000)})
    assert feed_all(receiver, [msgs[0], msgs[1], msgs[1], *msgs[2:]]) == []
    assert receiver.pending == 0
    good_message_still_works(dealer, router, receiver)


def test_chunks_from_another_connection_are_dropped(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, 1 << 20)
    msgs = capture(dealer, router, BulkSender(KEY, "driver", chunk_bytes=1024), {}, {"x": torch.ones(1000)})
    msgs[1][0] = b"\x00other"
    assert feed_all(receiver, msgs) == [] and receiver.rejected >= 1


def test_oversized_messages_are_dropped(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    receiver = BulkReceiver(KEY, max_bytes=4096)
    big = {"x": torch.ones(2048)}  # 8 kB
    for chunk_bytes in (1024, 1 << 20):  # chunked, and all in the head
        msgs = capture(dealer, router, BulkSender(KEY, "driver", chunk_bytes=chunk_bytes), {}, big)
        rejected = receiver.rejected
        assert feed_all(receiver, msgs) == []
        assert receiver.rejected == rejected + len(msgs) and receiver.pending == 0
    good_message_still_works(dealer, router, BulkReceiver(KEY, max_bytes=1 << 20))
    (msg,) = feed_all(receiver, capture(dealer, router, BulkSender(KEY, "d3"), {}, {"x": torch.ones(1024)}))
    assert torch.equal(msg.tensors["x"], torch.ones(1024))


def test_not_a_bulk_message_is_dropped() -> None:
    receiver = BulkReceiver(KEY, 1 << 20)
    assert receiver.feed([b"\x00peer", b"hello", b"world"]) is None
    assert receiver.feed([b"\x00peer", HEAD, b"short", b"", b""]) is None
    assert receiver.rejected == 2


def test_receive_buffers_are_reused_once_the_tensors_are_gone() -> None:
    pool = BufferPool(max_bytes=8 << 20)
    a = pool.get(3 << 20)
    base = a.base
    assert pool.pooled_bytes == 0
    del a
    gc.collect()
    assert pool.pooled_bytes == 4 << 20  # rounded up to 2 MiB multiples
    b = pool.get((3 << 20) - 100)
    assert b.base is base and b.nbytes == (3 << 20) - 100 and pool.pooled_bytes == 0
    c = pool.get(1 << 20)  # the free list is empty: a new buffer
    assert c.base is not base


def test_receiver_reuses_a_buffer_only_once_its_tensors_are_gone(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    sender, receiver = BulkSender(KEY, "driver", chunk_bytes=1 << 20), BulkReceiver(KEY, 16 << 20)
    n = 1 << 20  # 4 MiB of float32
    sender.send(dealer, {}, {"x": torch.full((n,), 1.0)})
    first = receiver.recv(router, 5)
    assert first is not None
    sender.send(dealer, {}, {"x": torch.full((n,), 2.0)})
    second = receiver.recv(router, 5)
    assert second is not None  # the first batch is still alive: it must not be written over
    assert torch.equal(first.tensors["x"], torch.full((n,), 1.0))
    assert torch.equal(second.tensors["x"], torch.full((n,), 2.0))
    ptr = first.tensors["x"].data_ptr()
    del first
    gc.collect()
    assert receiver.pool.pooled_bytes == 4 << 20
    sender.send(dealer, {}, {"x": torch.full((n,), 3.0)})
    third = receiver.recv(router, 5)
    assert third is not None and third.tensors["x"].data_ptr() == ptr and receiver.pool.pooled_bytes == 0
    assert torch.equal(third.tensors["x"], torch.full((n,), 3.0))
    assert torch.equal(second.tensors["x"], torch.full((n,), 2.0))


class FakeSocket:
    """Records what a sender queues (frames as bytes), as a socket with nothing in between would."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.sent.append([bytes(f) for f in frames])


@pytest.mark.parametrize("chunk_bytes", [64, 100, 1000, 4096, 1 << 20])
def test_any_chunk_size_reassembles_exactly(chunk_bytes: int) -> None:
    sock, receiver = FakeSocket(), BulkReceiver(KEY, 1 << 20)
    sent = mixed_tensors()
    BulkSender(KEY, "driver", chunk_bytes=chunk_bytes).send(sock, {"c": chunk_bytes}, sent)  # type: ignore[arg-type]
    (msg,) = feed_all(receiver, sock.sent)
    assert msg.routing_id is None and msg.header == {"c": chunk_bytes} and receiver.rejected == 0
    assert_same(sent, msg.tensors)
