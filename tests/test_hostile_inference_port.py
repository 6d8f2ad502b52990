"""A hostile neighbour against the local inference server's port: idle and slowloris connections
without the key are closed within the configured deadline (those over the cap at once), the
server's descriptors and memory stay bounded, and the run's own requests and weight reloads go on.

A real server process (``LocalInferenceServer``, the tiny model) and real sockets.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.rpc.preauth import FD_RESERVE, HARD_CAP_FACTOR
from tests.conftest import compose_config
from tests.test_hostile_wire import still_open

pytestmark = pytest.mark.e2e
PREAUTH_TIMEOUT_S = 8
MAX_CONNECTIONS = 64
IDLE, SLOWLORIS = 600, 600  # 1,200 connections, as the probe that exhausted a soft nofile of 1024
LOW_SOFT_NOFILE = 256  # the server starts under this and must raise it for its cap


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        return next(int(line.split()[3]) for line in f if line.startswith("Max open files"))


@pytest.fixture
def server(tiny_model_dir: str, tmp_path: Path) -> Iterator[LocalInferenceServer]:
    config = compose_config(
        [
            f"runtime.rpc.preauth_timeout_s={PREAUTH_TIMEOUT_S}",
            f"runtime.rpc.preauth_max_connections={MAX_CONNECTIONS}",
            "service.inference_service.local.prewarm=false",
        ]
    )
    local = config["service"]["inference_service"]["local"]
    srv = LocalInferenceServer(
        tiny_model_dir, local, str(tmp_path / "logs"), "policy", runtime=config["runtime"]
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_NOFILE, hard))  # the server inherits it
    try:
        srv.launch()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    srv.wait_ready()
    yield srv
    srv.stop()


def test_idle_and_slowloris_connections_are_closed_and_the_run_goes_on(
    server: LocalInferenceServer, tiny_model_dir: str
) -> None:
    assert server.process is not None and server.base_url is not None
    pid, url = server.process.pid, server.base_url
    host, port = url.removeprefix("http://").rsplit(":", 1)
    auth = {"Authorization": f"Bearer {server.api_key}"}
    # raised as the ranks raise theirs: the cap (both factors) and room for files
    assert soft_nofile(pid) >= HARD_CAP_FACTOR * MAX_CONNECTIONS + FD_RESERVE > LOW_SOFT_NOFILE
    body = {"model": "policy", "prompt": [1, 5, 6], "max_tokens": 2}
    for _ in range(10):
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
    before = rss(pid)
    stop, answered, failed = threading.Event(), [0], []

    def keep_asking() -> None:  # the run's rollouts, through one keep-alive client as the run's
        with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
            while not stop.is_set():
                try:
                    resp = client.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    answered[0] += 1
                except Exception as exc:
                    failed.append(repr(exc))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    t0 = time.monotonic()
    try:
        for i in range(IDLE + SLOWLORIS):
            s = socket.create_connection((host, int(port)))
            if i % 2:  # a request head that never ends: a byte at a time
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                slow.append(s)
            else:
                idle.append(s)
            s.setblocking(False)
        capped = time.monotonic() + 5  # before the deadline: those over the cap go first
        while still_open(idle + slow) > MAX_CONNECTIONS and time.monotonic() < capped:
            time.sleep(0.2)
        assert still_open(idle + slow) <= MAX_CONNECTIONS
        deadline = t0 + PREAUTH_TIMEOUT_S + 5
        while still_open(idle + slow) and time.monotonic() < deadline:
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(b"X")
            time.sleep(0.5)
        left = still_open(idle + slow), time.monotonic() - t0
        # the weight reload the probe saw fail for descriptors: it opens the model's files
        reload = httpx.post(
            f"{url}/update_weights_from_disk",
            json={"model_path": tiny_model_dir, "weight_version": 7},
            headers=auth,
            timeout=60,
        )
    finally:
        stop.set()
        asker.join(60)
        for s in idle + slow:
            s.close()
    assert left[0] == 0, f"{left[0]} connections still open after {left[1]:.1f}s"
    assert reload.status_code == 200 and reload.json()["weight_version"] == 7, reload.text
    assert not failed and answered[0] > 0, (answered, failed[:3])
    assert rss(pid) - before <= 64 << 20
    log = Path(server.log_path).read_text()
    assert "inference server: over 64 connections waiting for a request" in log
