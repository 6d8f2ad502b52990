"""A hostile neighbour against the standalone train service: messages captured before a
worker group's restart do not replay after it, and its HTTP port keeps the
pre-authentication limits (the token before the body, bounded bodies, idle connections closed).

Real processes: ``python -m launch.train_service`` and ``torchrun -m launch.train_worker``.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexrl_hpc.rpc import http_guard
from nexrl_hpc.rpc.http_guard import FAILED_TOKEN_FIRST_DELAY_S, FAILED_TOKEN_MAX_DELAY_S
from nexrl_hpc.trainer.group_client import ApiServerControl, DirectControl, TrainGroupClient
from nexrl_hpc.trainer.protocol import TrainerRankError, key_from_token
from tests.conftest import REPO, wire_limits
from tests.test_hostile_wire import RecordingProxy, still_open
from tests.test_train_service import TOKEN, env, free_port, stop_group

pytestmark = pytest.mark.e2e
MiB = 1 << 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    log = open(tmp_path / "api_server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.train_service",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--heartbeat-timeout-s",
            "2",
        ],
        cwd=REPO,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{url}/health", headers=AUTH, timeout=1)
            break
        time.sleep(0.2)
    yield url, proc
    proc.terminate()
    proc.wait(10)
    log.close()


def start_group(url: str, identifier: str, port: int, tmp_path: Path, n: int) -> subprocess.Popen:
    log = open(tmp_path / f"workers_{identifier}_{n}.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "launch.train_worker",
        "--api-server-url",
        url,
        "--identifier",
        identifier,
        "--backend",
        "single",
        "--heartbeat-s",
        "0.5",
        "--idle-tick-s",
        "0.5",
        "--port",
        str(port),
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def client_for(
    address: str, info: dict, control: ApiServerControl, via: str | None = None
) -> TrainGroupClient:
    client = TrainGroupClient(
        via or address,
        key_from_token(TOKEN, "replay", info["session"]),
        DirectControl(),
        recv_timeout_ms=5_000,
        total_timeout_ms=5_000,
        max_message_bytes=1 << 20,
        limits=wire_limits(),
    )
    client.address = address  # messages name rank 0 as their recipient, whatever path they take
    return client


def test_messages_captured_before_a_worker_group_restart_do_not_replay_after_it(
    server: tuple[str, subprocess.Popen], tmp_path: Path
) -> None:
    """Row 8: each start of a group draws a session at the API server, and the group's key (and
    ZMTP password) derive from the token and it: the recorded stream of a session is refused by the
    next one at the handshake, and a client still holding the old key gets no answer."""
    url, _ = server
    port = free_port()
    control = ApiServerControl(url, TOKEN, "replay", heartbeat_timeout_s=2.0)
    group = start_group(url, "replay", port, tmp_path, 1)
    try:
        first = control.wait_ready(120)
        address = first["endpoints"]["0"]
        proxy = RecordingProxy(address)  # a sniffer on the path
        old = client_for(address, first, control, via=proxy.address)
        assert DirectControl().call(old, "ping", {}, 5.0) == {"world_size": 1}
        time.sleep(0.2)
        recorded = bytes(proxy.recorded)
        assert len(recorded) > 0
        proxy.close()
        stop_group(group, url, "replay")
        group = start_group(url, "replay", port, tmp_path, 2)  # the same port: a restart
        deadline = time.monotonic() + 120
        while (second := control.group_info())["session"] == first["session"] or not second["ready"]:
            assert time.monotonic() < deadline, "the group did not come back"
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as s:  # the captured stream, replayed
            s.sendall(recorded)
            s.settimeout(5)
            answer = b""
            with contextlib.suppress(OSError):
                while data := s.recv(65536):
                    answer += data
        assert b"result" not in answer and len(answer) < 512  # the handshake's refusal, nothing more
        with pytest.raises(TrainerRankError, match="did not answer"):  # the old key gets no answer
            DirectControl().call(old, "ping", {}, 2.0)
        old.close()
        fresh = client_for(address, second, control)
        assert DirectControl().call(fresh, "ping", {}, 30.0) == {"world_size": 1}
        fresh.close()
        log = (tmp_path / "workers_replay_2.log").read_text()
        assert "refused a ZMQ connection from 127.0.0.1: wrong credentials" in log
    finally:
        stop_group(group, url, "replay")


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def test_the_api_server_reads_no_body_before_the_token_and_closes_idle_connections(
    server: tuple[str, subprocess.Popen],
) -> None:
    """150 MiB posted without the token: 401 before the body is read; with it, over the limit:
    413; 1,000 connections that never send a request are closed within the pre-auth timeout
    (those over the cap at once), while requests with the token keep being answered."""
    url, proc = server
    port = int(url.rsplit(":", 1)[1])
    for _ in range(20):
        httpx.get(f"{url}/health", headers=AUTH)
    before = rss(proc.pid)
    head = (
        "POST /register_worker_group HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {150 * MiB}\r\n"
    )
    for auth in ("", f"Authorization: Bearer {TOKEN}\r\n"):
        with socket.create_connection(("127.0.0.1", port)) as s:  # answered before a byte of the body
            s.sendall((head + auth + "\r\n").encode())
            s.settimeout(5)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 401" if not auth else b"HTTP/1.1 413"), reply[:100]
        with socket.create_connection(("127.0.0.1", port)) as s:  # and the body is not read
            s.sendall((head + auth + "\r\n").encode())
            sent = 0
            with contextlib.suppress(OSError):
                while sent < 150 * MiB:
                    s.sendall(b"x" * MiB)
                    sent += MiB
            assert sent < 150 * MiB
    assert rss(proc.pid) - before <= 8 * MiB
    limits = wire_limits()
    stop, answered, failed = threading.Event(), [0], []

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                assert httpx.get(f"{url}/health", headers=AUTH, timeout=10).status_code == 200
                answered[0] += 1
            except Exception as exc:
                failed.append(repr(exc))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    idle: list[socket.socket] = []
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            idle.append(s)
        capped = time.monotonic() + 5  # well before the timeout: those over the cap go first
        while still_open(idle) > limits.preauth_max_connections and time.monotonic() < capped:
            time.sleep(0.2)
        assert still_open(idle) <= limits.preauth_max_connections
        deadline = t0 + limits.preauth_timeout_s + 5
        while still_open(idle) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = still_open(idle)
    finally:
        stop.set()
        asker.join(30)
        for s in idle:
            s.close()
    assert left == 0
    assert not failed and answered[0] > 0, (answered, failed)


def test_wrong_tokens_are_answered_ever_later_and_the_token_still_at_once(
    server: tuple[str, subprocess.Popen],
) -> None:
    """Each wrong token of a window waits twice as long as the one before (from 50 ms, up to 2 s);
    a request with the token meanwhile is not held."""
    url, _ = server
    waited = []
    for _ in range(6):
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
        waited.append(time.monotonic() - t0)
    expected = [min(FAILED_TOKEN_FIRST_DELAY_S * 2**i, FAILED_TOKEN_MAX_DELAY_S) for i in range(6)]
    assert all(w >= e for w, e in zip(waited, expected)), (waited, expected)
    held = [
        threading.Thread(target=httpx.get, args=(f"{url}/health",), kwargs={"timeout": 30}) for _ in range(8)
    ]
    for thread in held:
        thread.start()
    time.sleep(0.3)  # the eight wait their (maximum) delay now
    t0 = time.monotonic()
    assert httpx.get(f"{url}/health", headers=AUTH).status_code == 200
    assert time.monotonic() - t0 < FAILED_TOKEN_MAX_DELAY_S
    for thread in held:
        thread.join(30)


def test_the_throttle_doubles_per_failure_within_its_window_and_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(http_guard.time, "monotonic", lambda: now[0])
    throttle = http_guard.FailedTokenThrottle()
    delays = [throttle.delay_s() for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    now[0] += http_guard.FAILED_TOKEN_WINDOW_S + 1  # a quiet window: back to the first delay
    assert throttle.delay_s() == 0.05
    throttle._held = http_guard.FAILED_TOKEN_HELD  # a flood: no more answers held (no descriptors kept)
    assert throttle.delay_s() == 0.0


def test_a_guessable_token_is_refused_naming_where_it_came_from(tmp_path: Path) -> None:
    for module in ("launch.train_service", "launch.train_worker"):
        args = ["--api-server-url", "http://127.0.0.1:9", "--identifier", "x"] if "worker" in module else []
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=dict(env(), NEXRL_TRAIN_SERVICE_TOKEN="x"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert (
            "error: the bearer token in $NEXRL_TRAIN_SERVICE_TOKEN (--token-env) has 1 characters, fewer than 16"
            in proc.stderr
        )
