"""A hostile neighbour against the local inference server's port: idle and slowloris connections
without the key are closed within the configured deadline (those over the cap at once), the
server's descriptors and memory stay bounded, and the run's own requests and weight reloads go on.

A real server process (``LocalInferenceServer``, the tiny model) and real sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.inference.server import LISTEN_BACKLOG
from nexrl_hpc.rpc.preauth import FD_RESERVE, HARD_CAP_FACTOR
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT
from nexrl_hpc.tracking.run_status import read_status
from tests.conftest import REPO, compose_config, last_trained_step
from tests.test_hostile_wire import still_open

pytestmark = pytest.mark.e2e
PREAUTH_TIMEOUT_S = 8
MAX_CONNECTIONS = 64
IDLE, SLOWLORIS = 600, 600  # 1,200 connections, as the probe that exhausted a soft nofile of 1024
LOW_SOFT_NOFILE = 256  # the server starts under this and must raise it for its cap
ACCEPT_LAG_S = 15  # the deadline counts from the server's accept, which lags a flood on a loaded machine


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def fds(pid: int) -> int:
    """Descriptors ``pid`` holds now (connections still in the kernel's accept queue are not its)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


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
    # raised as the ranks raise theirs: the cap (both factors), a burst of accepts, room for files
    limit = soft_nofile(pid)
    assert limit >= HARD_CAP_FACTOR * MAX_CONNECTIONS + LISTEN_BACKLOG + FD_RESERVE > LOW_SOFT_NOFILE
    body = {"model": "policy", "prompt": [1, 5, 6], "max_tokens": 2}
    for _ in range(10):
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
    before, fds_before = rss(pid), fds(pid)
    stop, answered, failed = threading.Event(), [0], []

    def keep_asking() -> None:  # the run's rollouts, through one keep-alive client as the run's
        with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
            while not stop.is_set():
                try:
                    try:
                        resp = client.post("/v1/completions", json=body)
                    except httpx.TransportError:  # a pooled connection the cap closed as it was
                        resp = client.post("/v1/completions", json=body)  # reused: again, as the run's client
                    assert resp.status_code == 200, resp.text
                    answered[0] += 1
                except Exception as exc:
                    failed.append(repr(exc))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    most_fds = fds(pid)
    try:
        for i in range(IDLE + SLOWLORIS):
            if i % 100 == 0:
                most_fds = max(most_fds, fds(pid))
            s = socket.create_connection((host, int(port)))
            if i % 2:  # a request head that never ends: a byte at a time
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                slow.append(s)
            else:
                idle.append(s)
            s.setblocking(False)
        flooded = time.monotonic()
        deadline = flooded + PREAUTH_TIMEOUT_S + ACCEPT_LAG_S
        while still_open(idle + slow) and time.monotonic() < deadline:
            most_fds = max(most_fds, fds(pid))
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(b"X")
            time.sleep(0.5)
        left = still_open(idle + slow), time.monotonic() - flooded
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
    assert left[0] == 0, f"{left[0]} connections still open {left[1]:.1f}s after the flood"
    # descriptors: never near the (raised) limit, and back where they were
    assert most_fds < limit - FD_RESERVE, (most_fds, limit)
    assert fds(pid) <= fds_before + 4, (fds(pid), fds_before)
    assert reload.status_code == 200 and reload.json()["weight_version"] == 7, reload.text
    assert not failed and answered[0] > 0, (answered, failed[:3])
    assert rss(pid) - before <= 64 << 20
    log = Path(server.log_path).read_text()
    assert "inference server: over 64 connections waiting for a request" in log


# more steps than the test lets it train: the run is stopped at a checkpoint once it has trained on
# after the flood was closed, so its length never races the flood's deadline
RUN_STEPS = 100_000
STEPS_AFTER_FLOOD = 5
SERVER_UP = re.compile(r"local inference server up at http://(\S+):(\d+) \(pid (\d+)\)")


def server_lives(pid: int) -> bool:
    """``pid`` runs (a process that died and is not yet reaped by the run is a zombie: ``Z``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(run: subprocess.Popen, run_dir: Path) -> str:
    """What the run and its server said, once the server died under the flood (the run is stopped)."""
    if run.poll() is None:
        run.terminate()
    out = run.communicate(timeout=120)[0] or ""
    server_log = run_dir / "logs" / "inference_service.log"
    tail = server_log.read_text()[-4000:] if server_log.exists() else "(no server log)"
    return f"the run's server died under the flood; run rc {run.returncode}:\n{out[-4000:]}\n--- server log:\n{tail}"


def flood(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections without the key: every other one idle, the rest a request head that never ends."""
    socks = []
    for i in range(n):
        s = socket.create_connection((host, port))
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        socks.append(s)
    return socks


def test_a_run_trains_on_through_1200_connections_on_its_inference_port(tmp_path: Path) -> None:
    """The probe that failed a run: 1,200 idle and slowloris connections to the run's own server
    while it trains. They are closed within the deadline, the run trains on through its server, and
    stops at a checkpoint on the preemption signal (rc 3) as any run does."""
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        f"train_worker.total_train_steps={RUN_STEPS}",
        f"runtime.rpc.preauth_timeout_s={PREAUTH_TIMEOUT_S}",
        "validate.validate_before_train=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
    ]
    run = subprocess.Popen(
        [sys.executable, "-m", "launch.train", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 300
        found = None
        while found is None:
            assert run.poll() is None and time.monotonic() < deadline, "the run's server did not come up"
            log = run_dir / "train.log"
            found = SERVER_UP.search(log.read_text()) if log.exists() else None
            time.sleep(0.2)
        host, port, pid = found[1], int(found[2]), int(found[3])
        before = rss(pid)
        t0 = time.monotonic()
        socks = flood(host, port, IDLE + SLOWLORIS)
        flooded = time.monotonic()
        while still_open(socks) and time.monotonic() < flooded + PREAUTH_TIMEOUT_S + ACCEPT_LAG_S:
            time.sleep(0.5)
        left, closed_after = still_open(socks), time.monotonic() - t0
        assert server_lives(pid), gone(run, run_dir)
        grown = rss(pid) - before
        at_close = last_trained_step(run_dir)
        deadline = time.monotonic() + 300
        while last_trained_step(run_dir) < at_close + STEPS_AFTER_FLOOD:  # rollouts through the same server
            assert run.poll() is None and time.monotonic() < deadline, (
                "the run stopped training after the flood"
            )
            time.sleep(0.2)
        run.send_signal(signal.SIGUSR2)  # the preemption signal: checkpoint and stop
        out, _ = run.communicate(timeout=300)
    finally:
        for s in socks:
            s.close()
        if run.poll() is None:
            run.kill()
    assert left == 0, f"{left} connections open after {closed_after:.1f}s"
    assert grown <= 64 << 20, grown
    assert run.returncode == PREEMPTED_EXIT, out[-3000:]
    status = read_status(str(run_dir))
    assert status is not None and status["state"] == "preempted", status
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    assert steps == list(range(1, max(steps) + 1)) and max(steps) >= at_close + STEPS_AFTER_FLOOD
