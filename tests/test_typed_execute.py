"""``execute`` is typed over the method it calls: a wrong argument to a module's method is a type error.

mypy (with the project's configuration) checks a small file that calls real module methods through
``execute`` / ``execute_async`` / ``aexecute``, once as peers hold them (a Protocol of the package's
``interfaces.py``) and once as the concrete class; the wrong call is reported at its line, the same
file with the right argument passes. A remote handle (what a module reference is on another rank)
passes where the Protocol is expected.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = """\
from concurrent.futures import Future

from nexrl_hpc.core.execute import aexecute, execute, execute_async
from nexrl_hpc.pool.interfaces import TrajectoryPoolRef
from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
from nexrl_hpc.rpc.handles import RemoteModuleHandle
from nexrl_hpc.types import Batch, PutStatus, Trajectory


def through_the_protocol(pool: TrajectoryPoolRef) -> Batch | None:
    return execute(pool.get_batch_any, {batch_size}, 0.5)


def through_the_class(pool: TrajectoryPool, trajectory: Trajectory) -> Future[PutStatus]:
    return execute_async(pool.put_trajectory, {trajectory})


async def on_a_loop(pool: TrajectoryPoolRef) -> None:
    await aexecute(pool.accept_trajectories, {model_tag})


def a_remote_handle_is_a_module_reference(handle: RemoteModuleHandle) -> TrajectoryPoolRef:
    execute(handle.get_batch_any, 8, 0.5)
    return handle
"""

GOOD = {"batch_size": "8", "trajectory": "trajectory", "model_tag": '"default"'}
BAD = {"batch_size": '"eight"', "trajectory": "[trajectory]", "model_tag": "3"}
BAD_LINES = {11: "get_batch_any", 15: "put_trajectory", 19: "accept_trajectories"}


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    """The checkout's own mypy cache: the test command's static check has just filled it for the
    package (the same configuration), so only the small file is checked from scratch."""
    return ROOT / ".mypy_cache"


def run_mypy(source: str, tmp_path: Path, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "calls.py"
    path.write_text(source)
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # this checkout's package, not an installed copy
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(cache_dir), "--no-error-summary", str(path)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_right_arguments_pass(tmp_path: Path, cache_dir: Path) -> None:
    result = run_mypy(FIXTURE.format(**GOOD), tmp_path, cache_dir)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_wrong_argument_is_a_type_error_at_its_line(tmp_path: Path, cache_dir: Path) -> None:
    source = FIXTURE.format(**BAD)
    for line, method in BAD_LINES.items():
        assert method in source.splitlines()[line - 1]
    result = run_mypy(source, tmp_path, cache_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [row for row in result.stdout.splitlines() if ": error: " in row]
    reported = {int(row.split(":")[1]) for row in errors}
    assert reported == set(BAD_LINES), result.stdout
    assert all(row.endswith("[arg-type]") for row in errors), result.stdout
