"""Issue 21, row 9: a vLLM server the run starts answers its maintenance endpoints to the run only.

Against real vLLM (CPU build) this is ``test_vllm.py::test_maintenance_endpoints_refuse_an_outsider``,
on the server the vLLM tests share (vLLM's start-up is the slow part). Here: the same middleware in
front of a stand-in app, and the launch wiring that puts it in front of vLLM's routes.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from nexrl_hpc.inference import vllm_guard
from nexrl_hpc.inference.vllm_server import GUARD_MODULE, VLLMServer
from tests.conftest import REPO, compose_config


def _app(monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, list[str]]:
    monkeypatch.setenv("VLLM_API_KEY", "run-key")
    called: list[str] = []
    app = FastAPI()

    @app.post("/collective_rpc")
    async def collective_rpc() -> dict[str, Any]:
        called.append("collective_rpc")
        return {"results": [None]}

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        called.append("pause")
        return {}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {}

    app.add_middleware(vllm_guard.RequireKey)  # what vLLM's --middleware does with a class
    return TestClient(app), called


def test_dev_mode_endpoints_need_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    client, called = _app(monkeypatch)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "run-key"}):
        assert client.post("/collective_rpc", headers=headers).status_code == 401
        assert client.post("/pause", headers=headers).status_code == 401
    assert called == []
    assert client.get("/health").status_code == 200
    assert client.post("/pause", headers={"Authorization": "Bearer run-key"}).status_code == 200
    assert called == ["pause"]


def test_no_key_no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        vllm_guard.RequireKey(FastAPI())


def test_the_server_is_started_behind_the_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_config(
        ["service.inference_service.backend=vllm", "service.inference_service.base_url=http://unused"]
    )
    vcfg = dict(cfg["service"]["inference_service"]["vllm"], python="/bin/true")  # launches, then exits
    server = VLLMServer("/models/none", vcfg, str(tmp_path), "policy")  # type: ignore[arg-type]
    server.launch()
    try:
        guard_dir = server._guard_dir
        assert guard_dir is not None
        assert stat.S_IMODE(os.stat(guard_dir).st_mode) == 0o700
        copied = Path(guard_dir, f"{GUARD_MODULE}.py").read_text()
        assert copied == Path(vllm_guard.__file__).read_text()
        cmd = server.command(8000)
        assert cmd[cmd.index("--middleware") + 1] == f"{GUARD_MODULE}.RequireKey"
    finally:
        server.stop()
    assert not os.path.exists(guard_dir)  # removed with the server


def test_the_server_gets_the_keep_alive_bound_and_the_hard_descriptor_limit(tmp_path: Path) -> None:
    """What vLLM lets the run bound: idle keep-alive connections end after the pre-auth timeout,
    and the server (the supervisor's command) starts with its soft nofile at the hard limit."""
    cfg = compose_config(
        ["service.inference_service.backend=vllm", "service.inference_service.base_url=http://unused"]
    )
    timeout_s = cfg["runtime"]["rpc"]["preauth_timeout_s"]
    server = VLLMServer(
        "/m", cfg["service"]["inference_service"]["vllm"], str(tmp_path), "p", keep_alive_s=timeout_s
    )
    assert server.environment({}, "/g")["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == str(int(timeout_s)) == "10"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    show = "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "nexrl_hpc.inference.supervise",
                str(os.getpid()),
                "--",
                sys.executable,
                "-c",
                show,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(hard), str(hard)]
