"""The parts of an RPC endpoint, each on its own: real sockets on 127.0.0.1, real signing."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from nexrl_hpc.core.execute import quick
from nexrl_hpc.rpc.calls import Calls, CallTimeout, PeerDeadError, new_call_ids
from nexrl_hpc.rpc.codec import RemoteError, decode, encode
from nexrl_hpc.rpc.direct import DirectPool
from nexrl_hpc.rpc.invoke import Invoker
from nexrl_hpc.rpc.lane_server import LaneServer
from nexrl_hpc.rpc.limits import LOG_BURST, LOG_WINDOW_S, Rejections, message_size, over_limit
from nexrl_hpc.rpc.preauth import secure_client, secure_server
from nexrl_hpc.rpc.server import IoServer
from nexrl_hpc.rpc.watch import ConnectionWatch
from nexrl_hpc.rpc.wire import SequenceGuard, open_message, seal_message
from tests.conftest import wire_limits

KEY = secrets.token_bytes(32)
LIMITS = wire_limits()


class Adder:
    def __init__(self) -> None:
        self.n = 0

    @quick
    def peek(self) -> int:
        return self.n

    def add(self, k: int) -> int:
        self.n += k
        return self.n


def lookup_for(module: Any) -> Callable[[str, str], Callable[..., Any]]:
    def lookup(name: str, method: str) -> Callable[..., Any]:
        if name != "adder" or method.startswith("_"):
            raise LookupError(f"no method {name}.{method}")
        return getattr(module, method)

    return lookup


def receive(router: zmq.Socket, timeout_s: float = 5.0) -> tuple[dict[str, Any], list[Any]]:
    """One signed message from a raw ROUTER: (envelope, [payload, buffers...]), verified."""
    assert router.poll(int(timeout_s * 1000)), "nothing arrived"
    frames = router.recv_multipart()[1:]  # without the routing id
    envelope, rest = open_message(KEY, frames, 1 << 20)
    return msgpack.unpackb(envelope, raw=False), rest


@pytest.fixture
def router() -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    """A caller rank's ROUTER as the run sets it up (PLAIN, its watch answering ZAP)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, LIMITS)
    watch = ConnectionWatch(sock, KEY, LIMITS, lambda reason, peer: None, "caller")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, sock, f"tcp://127.0.0.1:{port}"
    watch.close()
    sock.close()
    ctx.term()


def test_limits_name_the_size_and_count_every_rejection(caplog: Any) -> None:
    assert message_size([b"x" * 10]) == 10 and message_size([b"ab", memoryview(b"cde")]) == 5
    assert over_limit(3 << 20, 2 << 20) == (
        "a 3145728-byte message exceeds runtime.rpc.max_message_mb (2 MB)"
    )
    rejections = Rejections(7)
    caplog.set_level("WARNING", logger="nexrl_hpc.rpc")
    rejections.reject("bad signature", "10.0.0.1:5")
    rejections.reject("too short", "")
    assert rejections.count == 2
    assert "rank 7: rejected a message from 10.0.0.1:5: bad signature" in caplog.text
    assert "from <unknown peer>: too short" in caplog.text
    caplog.clear()
    flood = Rejections(8)
    for i in range(LOG_BURST + 100):  # a flood: every one counted, not every one logged
        flood.reject("closed before it authenticated", f"10.0.0.2:{i}")
    assert flood.count == LOG_BURST + 100 and caplog.text.count("rank 8: rejected") == LOG_BURST
    flood._window_start -= LOG_WINDOW_S  # the next window: the rest is summed up in one line
    flood.reject("bad signature", "10.0.0.2:1")
    assert "rank 8: 100 more rejections not logged one by one" in caplog.text
    assert caplog.text.count("rank 8: rejected") == LOG_BURST + 1


def test_invoker_runs_encodes_and_names_the_rank_of_an_error() -> None:
    adder = Adder()
    invoker = Invoker(3, lookup_for(adder))
    payload, buffers = encode([[4], {}])
    ok, body, out = invoker.run(invoker.find("adder", "add"), payload, buffers)
    assert ok and decode(body, out) == 4 and adder.n == 4
    missing = invoker.find("adder", "_secret")
    assert getattr(missing, "__nexrl_quick__", False)  # answered at once, on the receiving thread
    ok, body, out = invoker.run(missing, *encode([[], {}]))
    error = decode(body, out)
    assert not ok and isinstance(error, RemoteError) and error.type_name == "LookupError"
    assert "rank 3" in str(error) and "no method adder._secret" in str(error)


def test_calls_sign_requests_complete_replies_and_batch_queued_quick_requests(router: Any) -> None:
    ctx, sock, address = router
    calls = Calls(0, KEY, 1 << 20, 5.0, LIMITS, new_call_ids())
    calls.connect(ctx, 1, address)
    hello, _ = receive(sock)  # the DEALER says hello first: the peer's watch counts it authenticated
    assert {k: hello[k] for k in ("t", "src", "to", "q")} == {"t": "hi", "src": 0, "to": 1, "q": 1}
    first = calls.call_async(1, "adder", "peek", (), {}, quick=True)
    envelope, rest = receive(sock)
    assert {k: envelope[k] for k in ("t", "src", "to", "m", "f", "q")} == {
        "t": "req",
        "src": 0,
        "to": 1,
        "m": "adder",
        "f": "peek",
        "q": 2,
    }
    assert decode(bytes(rest[0]), []) == [[], {}]
    # while it is unanswered, the next quick requests wait in the outbox ...
    queued = [calls.call_async(1, "adder", "peek", (i,), {}, quick=True) for i in range(2)]
    assert len(calls.peers[1].outbox) == 2 and not sock.poll(100)
    body, _ = encode(41)
    assert not calls.complete(envelope["id"], body, [], True, 2)  # from another rank: not its answer
    assert calls.complete(envelope["id"], body, [], True, 1)
    assert first.result(timeout=1) == 41 and calls.peers[1].quick_in_flight == 2
    calls.flush_outboxes()  # ... and leave as one signed message when an answer came in
    batch, rest = receive(sock)
    assert batch["t"] == "reqs" and batch["q"] == 3 and batch["to"] == 1 and not calls.peers[1].outbox
    items = msgpack.unpackb(bytes(rest[0]), raw=False)
    assert [(m, f, decode(p, [])) for _, m, f, p in items] == [
        ("adder", "peek", [[0], {}]),
        ("adder", "peek", [[1], {}]),
    ]
    calls.expire(time.monotonic() + 10)
    for future in queued:
        with pytest.raises(CallTimeout, match="adder.peek on rank 1: no reply before the deadline"):
            future.result(timeout=1)
    calls.fail_peer(1, "heartbeats stopped")
    with pytest.raises(PeerDeadError, match=r"rank 1 is dead \(heartbeats stopped\); adder.add not sent"):
        calls.call_async(1, "adder", "add", (1,), {}).result(timeout=1)
    calls.close()


def serve_in_thread(lanes: LaneServer) -> Callable[[], None]:
    """Drive a lane server as the IO thread would; returns the function that stops it."""
    stop = threading.Event()

    def loop() -> None:
        poller = zmq.Poller()
        poller.register(lanes.fileno(), zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                lanes.on_ready()
        lanes.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(timeout=5)

    return end


def test_the_direct_pool_calls_a_lane_server_and_reuses_its_connection() -> None:
    adder = Adder()
    adder.n = 9
    server_rejections, client_rejections = Rejections(1), Rejections(0)
    lanes = LaneServer(
        1,
        "127.0.0.1",
        KEY,
        1 << 20,
        SequenceGuard(),
        Invoker(1, lookup_for(adder)),
        server_rejections.reject,
        LIMITS,
    )
    end = serve_in_thread(lanes)
    dead: dict[int, str] = {}
    pool = DirectPool(
        0, KEY, 1 << 20, 5.0, 2, SequenceGuard(), client_rejections.reject, dead, new_call_ids()
    )
    pool.add_peer(1, lanes.address)
    pool.add_peer(2, None)
    try:
        for _ in range(3):
            direct = pool.borrow(1, "adder", "peek")
            assert direct is not None
            assert pool.call(direct, 1, "adder", "peek", (), {}) == 9
        assert pool.peers[1].count == 1 and len(pool.peers[1].idle) == 1  # one connection, reused
        assert pool.borrow(2, "adder", "peek") is None  # no lane: the caller takes the queued path
        direct = pool.borrow(1, "adder", "add")
        assert direct is not None
        with pytest.raises(RemoteError, match="adder.add is not @quick"):
            pool.call(direct, 1, "adder", "add", (1,), {})
        assert adder.n == 9 and server_rejections.count == 0 and client_rejections.count == 0
        dead[1] = "gone"
        direct = pool.borrow(1, "adder", "peek")
        assert direct is not None
        with pytest.raises(PeerDeadError, match=r"rank 1 is dead \(gone\)"):
            pool.call(direct, 1, "adder", "peek", (), {})
        assert pool.peers[1].count == 0  # a connection left mid-call is closed, never reused
    finally:
        pool.closing = True
        assert pool.close() == 0
        end()


def test_the_io_server_answers_a_request_batch_with_one_reply_batch(router: Any) -> None:
    """Three quick requests in one signed message: the IO thread answers them right away and
    sends their small replies together, as one signed message to the caller rank's ROUTER."""
    ctx, caller_router, caller_address = router
    adder = Adder()
    adder.n = 5
    guard, rejections = SequenceGuard(), Rejections(1)
    invoker = Invoker(1, lookup_for(adder))
    calls = Calls(1, KEY, 1 << 20, 5.0, LIMITS, new_call_ids())
    lanes = LaneServer(1, "127.0.0.1", KEY, 1 << 20, guard, invoker, rejections.reject, LIMITS)
    server_ctx = zmq.Context()  # a rank's own context: one ZAP handler per context
    server = IoServer(
        1,
        server_ctx,
        "127.0.0.1",
        KEY,
        1 << 20,
        2,
        2,
        calls,
        lanes,
        invoker,
        guard,
        rejections.reject,
        LIMITS,
    )
    calls.io_thread = server.thread
    calls.connect(server_ctx, 0, caller_address)  # replies go to the caller's ROUTER
    server.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, KEY, LIMITS)
    dealer.connect(server.address)
    try:
        assert receive(caller_router)[0]["t"] == "hi"  # the server's DEALER back to the caller
        items = [[10 + i, "adder", "peek", encode([[], {}])[0]] for i in range(3)]
        envelope = msgpack.packb({"t": "reqs", "src": 0, "to": 1, "s": "caller", "q": 1})
        dealer.send_multipart(seal_message(KEY, envelope, msgpack.packb(items), []))
        reply, rest = receive(caller_router)
        assert reply["t"] == "reps" and reply["s"].startswith("1:") and (reply["src"], reply["to"]) == (1, 0)
        assert [(i, ok, decode(body, [])) for i, ok, body in msgpack.unpackb(rest[0])] == [
            (10, True, 5),
            (11, True, 5),
            (12, True, 5),
        ]
        dealer.send_multipart(seal_message(KEY, envelope, msgpack.packb(items), []))  # a replay
        deadline = time.monotonic() + 5
        while rejections.count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rejections.count == 1 and not caller_router.poll(100)
    finally:
        dealer.close()
        server.stop()
        calls.close()
        server_ctx.term()


def test_the_connection_watch_reports_a_peer_that_never_speaks_zmtp() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, LIMITS)
    rejected: list[tuple[str, str]] = []
    watch = ConnectionWatch(sock, KEY, LIMITS, lambda reason, peer: rejected.append((reason, peer)), "test")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" * 4)
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while not rejected and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.close()
        sock.close()
        ctx.term()
    assert len(rejected) == 1, rejected
    reason, peer = rejected[0]
    assert "closed before it authenticated" in reason
    assert peer == "" or peer.startswith("127.0.0.1:")
