"""The run's log is its user's alone from its creation (Hydra opens it before ``runtime.umask`` is
set), and a worker group's size is bounded (an unbounded one cost minutes and hundreds of MiB)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nexrl_hpc.runtime.run_files import RUN_LOG, PrivateFileHandler, restrict_run_files
from nexrl_hpc.trainer.api_server import MAX_GROUP_WORLD_SIZE, create_app
from tests.conftest import run_train, wire_limits
from tests.test_mpi import FAST

TOKEN = "t0ken-t0ken-t0ken-t0ken-t0ken-t0ken"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _config(run_dir: Path, umask: str | None) -> dict[str, Any]:
    return {"run_dir": str(run_dir), "runtime": {"umask": umask}}


@pytest.mark.parametrize(("umask", "expected"), [("077", 0o600), ("027", 0o640), (None, 0o644)])
def test_the_run_log_is_created_0600_then_given_the_runs_mode(
    tmp_path: Path, umask: str | None, expected: int
) -> None:
    previous = os.umask(0o022)  # what a login shell usually has
    try:
        handler = PrivateFileHandler(str(tmp_path / RUN_LOG))
        logging.getLogger("test.run_log").addHandler(handler)
        logging.getLogger("test.run_log").warning("a line")
        assert _mode(tmp_path / RUN_LOG) == 0o600  # before the umask applies: private
        restrict_run_files(_config(tmp_path, umask))
        assert _mode(tmp_path / RUN_LOG) == expected
        handler.close()
        logging.getLogger("test.run_log").removeHandler(handler)
        assert (tmp_path / RUN_LOG).read_text() == "a line\n"
    finally:
        os.umask(previous)


@pytest.mark.e2e
def test_hydras_train_log_is_private_under_a_permissive_umask(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "service.inference_service.backend=fake", "data.batch_size=4"]
    previous = os.umask(0o022)  # inherited by the run
    try:
        done = run_train([*args, "train_worker.total_train_steps=1", *FAST], timeout=600)
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training finished at step 1" in (run_dir / RUN_LOG).read_text()
    assert _mode(run_dir / RUN_LOG) == 0o600


def test_a_worker_group_of_more_ranks_than_the_cap_is_refused_naming_the_field() -> None:
    client = TestClient(create_app(TOKEN, 5.0, 5.0, 1 << 20, wire_limits()))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for size in (10**6, MAX_GROUP_WORLD_SIZE + 1, 0, -3):
        r = client.post(
            "/register_worker_group", json={"identifier": "g", "world_size": size}, headers=headers
        )
        assert r.status_code == 422, (size, r.text)
        assert r.json()["detail"] == (
            f"register_worker_group: world_size={size} is outside 1..{MAX_GROUP_WORLD_SIZE}"
        )
    assert client.get("/health", headers=headers).json()["groups"] == []
    r = client.post(
        "/register_worker_group",
        json={"identifier": "g", "world_size": MAX_GROUP_WORLD_SIZE},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    assert client.get("/health", headers=headers).json()["groups"] == ["g"]
