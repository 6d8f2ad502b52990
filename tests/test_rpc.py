"""Signed calls (ZMQ and the direct lane): codec round trips, calls and errors, and hostile input that must be dropped and counted."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.core.execute import execute, execute_async, long_poll, quick
from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.inference.service import InferenceService
from nexrl_hpc.pool.train_batch_pool import TrainBatchPool
from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
from nexrl_hpc.rpc.calls import CallTimeout, PeerDeadError
from nexrl_hpc.rpc.codec import HandleRef, RemoteError, decode, encode
from nexrl_hpc.rpc.endpoint import RpcEndpoint
from nexrl_hpc.rpc.handles import Directory, ModuleRegistry, RemoteModuleHandle
from nexrl_hpc.rpc.lane import lane_parts
from nexrl_hpc.rpc.limits import MessageTooLarge
from nexrl_hpc.rpc.preauth import FRAME_BYTES, cut_frames, join_frames, secure_client
from nexrl_hpc.rpc.server import reply_batch, request_batch
from nexrl_hpc.rpc.wire import RejectedMessage, seal, seal_message, sign
from nexrl_hpc.scheduler.rollout_scheduler import RolloutScheduler
from nexrl_hpc.types import Batch, PutStatus, RolloutServiceStatus
from nexrl_hpc.validate.validator import Validator
from tests.conftest import wire_limits


def test_codec_round_trip_without_pickle() -> None:
    value: dict[str, Any] = {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "i64": torch.tensor([[1, 2]], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "tuple": (1, "a", None),
        "batch": Batch(values={"x": torch.ones(2)}, metadata={"model_tag": "m"}),
        "enum": ErrorSeverity.WARNING,
        "exc": ValueError("boom"),
        "ref": HandleRef("trajectory_pool"),
        "nested": [{"a": [1.5, True]}],
    }
    header, buffers = encode(value)
    out = decode(header, [bytes(b) for b in buffers])
    assert torch.equal(out["f32"], value["f32"]) and out["f32"].dtype == torch.float32
    assert torch.equal(out["bf16"], value["bf16"]) and out["bf16"].dtype == torch.bfloat16
    assert torch.equal(out["i64"], value["i64"]) and out["empty"].shape == (0, 4)
    assert out["tuple"] == (1, "a", None) and out["enum"] is ErrorSeverity.WARNING
    assert isinstance(out["batch"], Batch) and torch.equal(out["batch"].values["x"], torch.ones(2))
    assert (
        isinstance(out["exc"], RemoteError)
        and out["exc"].type_name == "ValueError"
        and "boom" in str(out["exc"])
    )
    assert out["ref"] == HandleRef("trajectory_pool") and out["nested"] == [{"a": [1.5, True]}]
    with pytest.raises(TypeError, match="cannot send a builtins.object"):
        encode({"x": object()})


def test_statuses_cross_the_wire_as_their_enums_and_equal_their_strings() -> None:
    value = [PutStatus.SUCCESS, PutStatus.FAIL, PutStatus.RE_ROLLOUT, RolloutServiceStatus.BLOCK]
    header, buffers = encode(value)
    out = decode(header, [bytes(b) for b in buffers])
    assert out == value and [type(v) for v in out] == [type(v) for v in value]
    assert out == ["success", "fail", "re-rollout", "block"]
    assert [str(v) for v in out] == ["success", "fail", "re-rollout", "block"]
    assert json.dumps(out) == '["success", "fail", "re-rollout", "block"]'


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self._changed = threading.Condition()

    def add(self, k: int = 1) -> int:
        with self._changed:
            self.n += k
            self._changed.notify_all()
        return self.n

    @long_poll
    def wait_until(self, n: int, timeout: float) -> int:  # as a loader's fetch waits for tasks
        with self._changed:
            self._changed.wait_for(lambda: self.n >= n, timeout)
            return self.n

    def fail(self) -> None:
        raise KeyError("no such thing")

    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def echo(self, x: Any) -> Any:
        return x

    @quick
    def peek(self) -> int:
        return self.n

    @quick
    def mirror(self, x: Any) -> Any:  # tensors both ways on the direct lane
        return x

    @quick
    def stall(self, seconds: float) -> int:  # a misbehaving quick method: holds the IO thread
        time.sleep(seconds)
        return -1

    def _secret(self) -> str:
        return "never"


@pytest.fixture
def pair() -> Iterator[tuple[RpcEndpoint, RpcEndpoint, Counter, bytes]]:
    key = secrets.token_bytes(32)
    registry = ModuleRegistry()
    counter = Counter()
    registry.add("counter", counter)
    server = RpcEndpoint(
        1,
        "127.0.0.1",
        key,
        1 << 20,
        4,
        5.0,
        registry.lookup,
        direct_sockets_per_peer=4,
        long_poll_threads=8,
        limits=wire_limits(),
    )
    client = RpcEndpoint(
        0,
        "127.0.0.1",
        key,
        1 << 20,
        4,
        5.0,
        ModuleRegistry().lookup,
        direct_sockets_per_peer=4,
        long_poll_threads=8,
        limits=wire_limits(),
    )
    client.connect({1: server.address}, {1: server.lane_address})
    server.connect({0: client.address}, {0: client.lane_address})  # replies travel to the caller's ROUTER
    yield client, server, counter, key
    client.close()
    server.close()


def handle(client: RpcEndpoint) -> Any:
    return RemoteModuleHandle(client, 1, "counter", Counter)


def test_calls_mirror_the_module_and_errors_come_back_with_their_type(pair: Any) -> None:
    client, server, counter, _ = pair
    h = handle(client)
    assert execute(h.add, 2) == 2 and execute(h.add, k=3) == 5 and counter.n == 5
    futures = [execute_async(h.add) for _ in range(50)]  # pipelined
    assert sorted(f.result() for f in futures) == list(range(6, 56))
    with pytest.raises(RemoteError) as err:
        execute(h.fail)
    assert (
        err.value.type_name == "KeyError" and "no such thing" in str(err.value) and "rank 1" in str(err.value)
    )
    assert "Traceback" in err.value.remote_traceback
    with pytest.raises(RemoteError, match="PermissionError"):
        client.call_async(1, "counter", "_secret", (), {}).result()
    with pytest.raises(RemoteError, match="LookupError"):
        client.call_async(1, "nothere", "add", (), {}).result()
    tensor = torch.randn(64, 1024)
    assert torch.equal(execute(h.echo, tensor), tensor)
    with pytest.raises(MessageTooLarge, match="exceeds runtime.rpc.max_message_mb"):
        execute(h.echo, torch.randn(512, 1024))  # refused before sending, not dropped silently
    assert not hasattr(h, "_secret") and h.get_module_name() == "counter"


def test_a_long_call_does_not_block_others(pair: Any) -> None:
    client, *_ = pair
    h = handle(client)
    slow = execute_async(h.slow, 0.5)
    t0 = time.monotonic()
    assert execute(h.add) == 1
    assert time.monotonic() - t0 < 0.4
    assert slow.result() == "done"


def test_waiting_long_polls_never_hold_the_threads_other_calls_need(pair: Any) -> None:
    """More callers wait in a long poll than the server has threads (4 here); the call that ends
    their wait must still run at once. (With long polls in the same pool, as 32 rollout ranks'
    fetches were, it queued until the polls timed out.)"""
    client, *_ = pair
    h = handle(client)
    waiting = [execute_async(h.wait_until, 10, 5.0) for _ in range(6)]
    time.sleep(0.2)  # every poll is waiting on the server
    assert not any(w.done() for w in waiting)
    t0 = time.monotonic()
    assert execute(h.add, 10) == 10
    assert [w.result(timeout=2.0) for w in waiting] == [10] * 6
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "cls, method",
    [
        (DatasetLoader, "get_next_items"),  # a rollout rank's fetch of tasks
        (TrajectoryPool, "get_batch_any"),
        (TrainBatchPool, "get_batch"),
        (Validator, "wait_complete"),
        (RolloutScheduler, "wait_for_progress"),
        (InferenceService, "wait_ready"),
    ],
)
def test_module_methods_that_wait_for_work_are_served_as_long_polls(cls: type, method: str) -> None:
    """Each of these can wait up to its timeout; served from the ordinary pool, enough callers in
    them would hold every thread (the stall the test above shows)."""
    registry = ModuleRegistry()
    registry.add("module", object.__new__(cls))  # the lookup the endpoint dispatches on
    served = registry.lookup("module", method)
    assert getattr(served, "__nexrl_long_poll__", False)
    assert not getattr(served, "__nexrl_quick__", False)


def test_deadline_and_dead_peer_never_hang(pair: Any) -> None:
    client, *_ = pair
    with pytest.raises(CallTimeout, match="counter.slow on rank 1"):
        client.call_async(1, "counter", "slow", (2.0,), {}, timeout=0.3).result()
    pending = client.call_async(1, "counter", "slow", (2.0,), {})
    client.fail_peer(1, "heartbeats stopped")
    with pytest.raises(PeerDeadError, match="rank 1 is dead"):
        pending.result(timeout=1)
    with pytest.raises(PeerDeadError):
        client.call_async(1, "counter", "add", (), {}).result(timeout=1)


def test_directory_resolves_local_objects_and_remote_handles(pair: Any) -> None:
    client, *_ = pair
    registry = ModuleRegistry()
    mine = Counter()
    registry.add("mine", mine)
    directory = Directory(0, client, registry, {"mine": (0, Counter), "counter": (1, Counter)})
    assert directory.resolve("mine") is mine
    remote = directory.resolve("counter")
    assert isinstance(remote, RemoteModuleHandle) and remote.rank == 1 and execute(remote.add) == 1
    with pytest.raises(LookupError):
        directory.resolve("ghost")


class Evil:
    """Unpickling this would run a shell command that creates a file."""

    path = ""

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def raw_zmtp_client(port: int, mechanism: bytes = b"NULL", host: str = "127.0.0.1") -> socket.socket:
    """A raw TCP peer that sends a ZMTP 3.0 greeting (and, for NULL, a DEALER's READY); the run's
    sockets speak PLAIN and close it."""
    s = socket.create_connection((host, port))
    s.sendall(
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    )
    if mechanism == b"NULL":
        props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        cmd = b"\x05READY" + props
        s.sendall(b"\x04" + bytes([len(cmd)]) + cmd)
    return s


def attack(address: str, key_guess: bytes, marker: Path) -> None:
    """The hostile inputs the mpi mode must survive, against one listening ZMQ socket: none of them
    gets past the handshake (PLAIN with the password derived from the key)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    # 1. random bytes
    with socket.create_connection((host, int(port))) as s:
        s.sendall(os.urandom(512))
        time.sleep(0.2)
    ctx = zmq.Context()
    # 2. a well-formed request signed with a guessed key, over credentials derived from it
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, key_guess, wire_limits())
    dealer.connect(address)
    envelope = msgpack.packb(
        {"t": "req", "id": 1, "src": 9, "to": 1, "s": "attacker", "q": 1, "m": "counter", "f": "add"}
    )
    payload, _ = encode([[1000], {}])
    with contextlib.suppress(zmq.Again):  # no connection to queue on: refused at the handshake
        dealer.send_multipart(seal(key_guess, envelope, [payload]), zmq.NOBLOCK)
    time.sleep(0.2)
    dealer.close()
    # 3. a pickled object whose __reduce__ would create a file (unsigned, no credentials)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    Evil.path = str(marker)
    with contextlib.suppress(zmq.Again):
        dealer.send_multipart([b"\x00" * 32, pickle.dumps(Evil()), pickle.dumps(Evil())], zmq.NOBLOCK)
    time.sleep(0.2)
    dealer.close()
    ctx.term()
    # 4. a frame header announcing 2 GiB
    s = raw_zmtp_client(int(port), host=host)
    with contextlib.suppress(OSError):
        s.sendall(b"\x02" + struct.pack(">Q", 2**31))
    time.sleep(0.2)
    s.close()


def test_hostile_input_is_dropped_counted_and_nothing_runs(pair: Any, tmp_path: Path, caplog: Any) -> None:
    client, server, counter, _ = pair
    marker = tmp_path / "pwned"
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    attack(server.address, secrets.token_bytes(32), marker)
    deadline = time.monotonic() + 5
    while server.stats()["rejected"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    # each input is counted at least once (a DEALER refused at the handshake retries)
    assert server.stats()["rejected"] >= 4
    assert "refused a ZMQ connection from 127.0.0.1: wrong credentials" in caplog.text  # the guessed key
    assert "closed before it authenticated" in caplog.text and "from 127.0.0.1:" in caplog.text
    assert "bad signature" not in caplog.text  # nothing got as far as the signature check
    assert not marker.exists() and counter.n == 0
    assert execute(handle(client).add) == 1  # still serving


def test_a_message_signed_with_another_key_over_an_authenticated_connection_is_dropped(
    pair: Any, caplog: Any
) -> None:
    """Past the handshake the signature still decides: a wrong key is counted and nothing runs."""
    client, server, counter, key = pair
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, key, wire_limits())
    dealer.connect(server.address)
    envelope = msgpack.packb(
        {"t": "req", "id": 1, "src": 9, "to": 1, "s": "attacker", "q": 1, "m": "counter", "f": "add"}
    )
    payload, _ = encode([[1000], {}])
    dealer.send_multipart(seal(secrets.token_bytes(32), envelope, [payload]))
    deadline = time.monotonic() + 5
    while server.stats()["rejected"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats()["rejected"] == 1 and "bad signature" in caplog.text and counter.n == 0
    dealer.close()
    ctx.term()


def test_a_replayed_signed_message_is_rejected(pair: Any) -> None:
    client, server, counter, key = pair
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, key, wire_limits())
    dealer.connect(server.address)
    envelope = msgpack.packb(
        {"t": "req", "id": 1, "src": 9, "to": 1, "s": "recorded", "q": 5, "m": "counter", "f": "add"}
    )
    payload, _ = encode([[10], {}])
    frames = seal(key, envelope, [payload])
    dealer.send_multipart(frames)
    deadline = time.monotonic() + 2
    while counter.n != 10 and time.monotonic() < deadline:  # the original is served
        time.sleep(0.01)
    dealer.send_multipart(frames)  # the same bytes again
    time.sleep(0.3)
    assert counter.n == 10 and server.stats()["rejected"] == 1
    dealer.close()
    ctx.term()


def test_blocking_quick_calls_use_the_callers_own_sockets(pair: Any) -> None:
    """``execute`` of a @quick method goes on a borrowed lane connection (at most 4 per peer, shared
    by any number of threads) and comes back in order and signed; nothing is rejected."""
    import threading

    client, server, counter, _ = pair
    h = handle(client)
    counter.n = 7
    results: list[int] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(50):
                results.append(execute(h.peek))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [7] * 400
    peer = client._direct.peers[1]
    assert 1 <= peer.count <= 4 and len(peer.idle) == peer.count
    assert client.stats()["rejected"] == 0 and server.stats()["rejected"] == 0
    with pytest.raises(
        RemoteError, match="not @quick"
    ):  # the server answers direct calls to quick methods only
        client.call_direct(1, "counter", "add", (), {})
    assert counter.n == 7


def test_a_late_direct_reply_is_discarded_and_dead_peers_fail_direct_calls(pair: Any) -> None:
    client, server, *_ = pair
    h = handle(client)
    with pytest.raises(CallTimeout, match="counter.stall on rank 1"):
        client.call_direct(1, "counter", "stall", (0.6,), {}, timeout=0.2)
    # the connection that timed out is closed (its late reply can never be read as another's)
    assert client._direct.peers[1].count == 0 and not client._direct.peers[1].idle
    assert execute(h.add, 5) == 5 and execute(h.peek) == 5
    time.sleep(0.6)  # the stalled reply went to a closed connection: nothing to reject anywhere
    assert client.stats()["rejected"] == 0 and server.stats()["rejected"] == 0
    t0 = time.monotonic()
    waiting = execute_async(h.slow, 5.0)
    client.fail_peer(1, "heartbeats stopped")
    with pytest.raises(PeerDeadError, match="rank 1 is dead"):
        execute(h.peek)
    with pytest.raises(PeerDeadError):
        waiting.result(timeout=1)
    assert time.monotonic() - t0 < 1.0


def test_a_forged_direct_reply_is_rejected(pair: Any) -> None:
    """A "peer" answering on the lane with another key: the reply is counted and the call fails
    (it never decodes); the connection is not reused."""
    client, server, *_ = pair
    fake = socket.create_server(("127.0.0.1", 0))
    client.connect({5: server.address}, {5: f"tcp://127.0.0.1:{fake.getsockname()[1]}"})

    def answer_forged() -> None:
        conn, _ = fake.accept()
        conn.recv(65536)
        envelope = msgpack.packb({"t": "rep", "id": 1, "ok": True, "s": "forger", "q": 1})
        body, _ = encode(42)
        conn.sendall(b"".join(lane_parts(seal_message(secrets.token_bytes(32), envelope, body, []))))
        time.sleep(0.5)
        conn.close()

    import threading

    t = threading.Thread(target=answer_forged)
    t.start()
    with pytest.raises(ConnectionError, match="rejected reply on the direct lane"):
        client.call_direct(5, "counter", "peek", (), {}, timeout=5)
    t.join()
    fake.close()
    assert client.stats()["rejected"] == 1 and client._direct.peers[5].count == 0


def attack_lane(address: str, key_guess: bytes, marker: Path) -> None:
    """The hostile inputs the mpi mode must survive, framed for a direct lane (and unframed bytes)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    envelope = msgpack.packb(
        {"t": "req", "id": 1, "src": 9, "s": "attacker", "q": 1, "m": "counter", "f": "peek"}
    )
    payload, _ = encode([[], {}])
    Evil.path = str(marker)
    for data in (
        os.urandom(512),  # 1. random bytes
        b"".join(lane_parts(seal_message(key_guess, envelope, payload, []))),  # 2. a wrong key
        b"".join(lane_parts([b"\x00" * 32, pickle.dumps(Evil()), pickle.dumps(Evil())])),  # 3. pickle
        b"NXL1" + struct.pack(">IQ", 1, 2**31),  # 4. a header announcing 2 GiB
    ):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(data)
            s.settimeout(2.0)
            assert s.recv(1024) == b""  # dropped: the endpoint closes the connection, no reply


def test_hostile_input_on_the_direct_lane_is_dropped_counted_and_nothing_runs(
    pair: Any, tmp_path: Path, caplog: Any
) -> None:
    client, server, counter, _ = pair
    marker = tmp_path / "pwned"
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    attack_lane(server.lane_address, secrets.token_bytes(32), marker)
    assert server.stats()["rejected"] == 4
    assert "bad magic" in caplog.text and caplog.text.count("bad signature") == 2
    assert "announcing 2147483648 bytes exceeds" in caplog.text
    assert "direct lane" in caplog.text and "from 127.0.0.1:" in caplog.text  # with the peer address
    assert not marker.exists() and counter.n == 0
    counter.n = 6
    assert execute(handle(client).peek) == 6  # still serving, on the lane
    assert client._direct.peers[1].count == 1


def test_direct_calls_carry_tensors_both_ways(pair: Any) -> None:
    client, *_ = pair
    h = handle(client)
    tensor = torch.randn(128, 512)  # 256 KiB: over the packed single-frame size, several frames
    assert torch.equal(execute(h.mirror, {"t": tensor, "b": tensor.to(torch.bfloat16)})["t"], tensor)
    with pytest.raises(MessageTooLarge, match="exceeds runtime.rpc.max_message_mb"):
        execute(h.mirror, torch.randn(512, 1024))  # refused before sending
    assert client._direct.peers[1].count == 1  # the connection was neither broken nor lost


def test_big_parts_travel_cut_into_frames_within_the_peers_frame_limit() -> None:
    """Every frame on the ZMQ path is at most FRAME_BYTES (a ROUTER's frame limit is the pre-auth
    budget, here its smallest): a 600 KiB tensor and a 300 KiB payload are cut into frames and
    arrive whole, both ways."""
    key, limits = secrets.token_bytes(32), wire_limits(preauth_max_bytes=FRAME_BYTES)
    registry = ModuleRegistry()
    registry.add("counter", Counter())
    ends = [
        RpcEndpoint(
            rank,
            "127.0.0.1",
            key,
            4 << 20,
            4,
            10.0,
            lookup,
            direct_sockets_per_peer=0,
            long_poll_threads=2,
            limits=limits,
        )
        for rank, lookup in ((0, ModuleRegistry().lookup), (1, registry.lookup))
    ]
    try:
        ends[0].connect({1: ends[1].address})
        ends[1].connect({0: ends[0].address})
        tensor = torch.randn(150 << 10)  # 600 KiB
        words = ["x" * 100] * 3000  # ~300 KiB of msgpack
        out = execute(RemoteModuleHandle(ends[0], 1, "counter", Counter).echo, {"t": tensor, "w": words})
        assert torch.equal(out["t"], tensor) and out["w"] == words
        assert ends[0].stats()["rejected"] == 0 and ends[1].stats()["rejected"] == 0
        parts = [b"a" * 10, bytes(range(256)) * 3000]
        frames, counts = cut_frames(parts)
        assert counts == [1, 3] and max(len(f) for f in frames) <= FRAME_BYTES
        assert join_frames(frames, counts) == parts
    finally:
        for e in ends:
            e.close()


def test_packed_single_frame_messages_are_verified_like_multipart_ones(pair: Any, caplog: Any) -> None:
    """Small messages travel as one frame; the same key, length and signature checks apply."""
    client, server, counter, key = pair
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    envelope = msgpack.packb(
        {"t": "req", "id": 1, "src": 9, "to": 1, "s": "packer", "q": 1, "m": "counter", "f": "add"}
    )
    payload, _ = encode([[3], {}])
    (good,) = seal_message(key, envelope, payload, [])
    (wrong_key,) = seal_message(secrets.token_bytes(32), envelope, payload, [])
    assert good[:32] == sign(key, [envelope, payload])  # the multipart signature, not a weaker one
    overlong = good[:32] + struct.pack(">I", 1 << 20) + good[36:]  # header length past the end
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, key, wire_limits())
    dealer.connect(server.address)
    for frame in (wrong_key, good[:20], overlong, good[:-1]):
        dealer.send(frame)
    dealer.send(good)
    deadline = time.monotonic() + 3
    while counter.n != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counter.n == 3 and server.stats()["rejected"] == 4
    assert (
        caplog.text.count("bad signature") == 2
        and "too short" in caplog.text
        and "past the end" in caplog.text
    )
    dealer.close()
    ctx.term()


def test_without_direct_sockets_quick_calls_take_the_queued_path(pair: Any) -> None:
    client, server, counter, key = pair
    plain = RpcEndpoint(
        2,
        "127.0.0.1",
        key,
        1 << 20,
        4,
        5.0,
        ModuleRegistry().lookup,
        direct_sockets_per_peer=0,
        long_poll_threads=8,
        limits=wire_limits(),
    )
    try:
        plain.connect({1: server.address})
        server.connect({2: plain.address})
        counter.n = 4
        assert execute(RemoteModuleHandle(plain, 1, "counter", Counter).peek) == 4
        assert plain._direct.peers[1].count == 0 and plain.stats()["rejected"] == 0
    finally:
        plain.close()


def count_messages(endpoint: RpcEndpoint) -> list[int]:
    """Every message ``endpoint`` takes in from now on (its frame count), in a list."""
    received: list[int] = []
    server = endpoint._server
    on_message = server._on_message

    def counting(msg: Any) -> None:
        received.append(len(msg))
        on_message(msg)

    server._on_message = counting  # type: ignore[method-assign]
    return received


def test_pipelined_quick_calls_share_messages_both_ways_and_each_gets_its_own(pair: Any) -> None:
    """Async quick calls queued while one to the same peer is unanswered leave as one signed
    message when its answer arrives (Nagle's rule); their replies, arriving together, leave as one
    message per caller rank (at most 64 each); every future still gets its own value."""
    client, server, counter, _ = pair
    h = handle(client)
    counter.n = 11
    requests, replies = count_messages(server), count_messages(client)
    futures = [execute_async(h.peek) for _ in range(600)]
    assert [f.result(timeout=10) for f in futures] == [11] * 600
    assert len(requests) < 300 and len(replies) < 300  # batched both ways
    assert client._calls.peers[1].quick_in_flight == 0 and not client._calls.peers[1].outbox
    assert execute_async(h.add, 4).result(timeout=5) == 15  # a non-quick call is not held back
    assert client.stats()["rejected"] == 0 and server.stats()["rejected"] == 0
    with pytest.raises(RejectedMessage, match="malformed reply batch"):  # signed, but the wrong shape
        reply_batch(msgpack.packb([[1, True, "not bytes"]]))
    with pytest.raises(RejectedMessage, match="malformed request batch"):
        request_batch(msgpack.packb([[1, "counter", "peek", "not bytes"]]))


def test_queued_quick_requests_to_a_dead_peer_fail_at_once(pair: Any) -> None:
    client, *_ = pair
    h = handle(client)
    stalled = execute_async(h.stall, 2.0)  # holds the peer's IO thread: no answer for 2 s
    queued = [execute_async(h.peek) for _ in range(10)]
    assert len(client._calls.peers[1].outbox) == 10
    t0 = time.monotonic()
    client.fail_peer(1, "heartbeats stopped")
    for f in [stalled, *queued]:
        with pytest.raises(PeerDeadError, match="rank 1 is dead"):
            f.result(timeout=1)
    assert time.monotonic() - t0 < 1.0 and not client._calls.peers[1].outbox


def test_a_lane_out_of_descriptors_pauses_accepts_instead_of_spinning(pair: Any, caplog: Any) -> None:
    """Accept failing (EMFILE) leaves the listener readable: the IO thread stops accepting for a
    second instead of spinning, and takes the waiting connections once descriptors are free."""
    import resource

    client, server, counter, _ = pair
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    host, port = server.lane_address.removeprefix("tcp://").rsplit(":", 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = [socket.create_connection((host, int(port))) for _ in range(3)]  # fds taken before the cap
    used = len(os.listdir("/proc/self/fd"))
    extra: list[socket.socket] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, hard))
        for s in spare:
            s.close()  # 3 free descriptors: the next connections exhaust them on the server's side
        for _ in range(6):
            try:
                extra.append(socket.create_connection((host, int(port)), timeout=1))
            except OSError:
                break
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        spent = time.process_time() - cpu0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "pausing accepts" in caplog.text
    assert spent < 0.5 * (time.monotonic() - t0), spent  # no busy loop
    for s in extra:
        s.close()
    counter.n = 2
    assert execute(handle(client).peek) == 2  # accepting again


def test_lane_framing_round_trips_and_refuses_malformed_headers() -> None:
    """Messages cut anywhere arrive whole (3,000 frames: more than one sendmsg takes); a header
    is refused before its body is buffered."""
    import threading

    from nexrl_hpc.rpc.lane import LaneReader, send_parts

    a, b = socket.socketpair()
    frames = [bytes([i % 256]) * (i % 7) for i in range(3000)]
    got: list[list[bytes]] = []

    def read() -> None:
        reader = LaneReader(1 << 20)
        while len(got) < 2:
            got.extend(reader.feed(b.recv(997)))  # odd cuts through headers and frames

    t = threading.Thread(target=read)
    t.start()
    send_parts(a, lane_parts(frames))
    send_parts(a, lane_parts([b"second"]))
    t.join(timeout=10)
    a.close()
    b.close()
    assert got == [frames, [b"second"]]
    good = b"".join(lane_parts([b"abc", b"de"]))
    for bad, reason in (
        (b"XXXX" + good[4:], "bad magic"),
        (good[:4] + struct.pack(">IQ", 0, 0), "announcing 0 frames"),
        (good[:4] + struct.pack(">IQ", 1, 2**40), "exceeds the 1048576-byte limit"),
        (good[:4] + struct.pack(">IQ", 2, 5) + struct.pack(">QQ", 3, 3), "do not add up"),
    ):
        with pytest.raises(RejectedMessage, match=reason):
            LaneReader(1 << 20).feed(bad)
