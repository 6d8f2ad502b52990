"""The wheel as a user installs it: built from a clean copy, installed non-editable, run from elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def _clean_copy(dest: Path) -> Path:
    """The files git tracks (what a fresh clone has), without build leftovers of this checkout."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for rel in filter(None, (t.decode() for t in tracked)):
        if os.path.isfile(REPO / rel):  # a file deleted in the working tree is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def test_wheel_runs_from_another_directory(tmp_path: Path) -> None:
    src = _clean_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    # no PYTHONPATH and not the checkout as cwd: pip would take the checkout for an installed nexrl_hpc
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(wheels)],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("nexrl_hpc-*.whl")

    # the configs ship with the package, identical to the source tree
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(
        n.removeprefix("nexrl_hpc/configs/") for n in names if n.startswith("nexrl_hpc/configs/")
    )
    source = sorted(str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml"))
    assert shipped == source
    scripts = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for name in ("nexrl-train", "nexrl-status", "nexrl-join", "nexrl-train-service", "nexrl-train-worker"):
        assert f"{name} = " in scripts

    # a fresh venv: the dependencies come from this interpreter, the package only from the wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--force-reinstall",
            str(wheel),
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def installed(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        """A console script (or the python) of the venv, run from a directory with no checkout."""
        return subprocess.run(
            [str(venv / "bin" / command), *args],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    where = installed("python", "-c", "import nexrl_hpc, launch; print(nexrl_hpc.__file__, launch.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(venv)) for p in where.stdout.split()), where.stdout  # not the checkout

    run_dir = elsewhere / "D"
    train = installed("nexrl-train", f"run_dir={run_dir}", "train_worker.total_train_steps=3")
    assert train.returncode == 0, train.stderr[-3000:]
    steps = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"train/reward_mean"' in line]
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "global_step_3" / "COMPLETE").exists()
    assert f"run_dir: {run_dir}" in (run_dir / "config.yaml").read_text()

    status = installed("nexrl-status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "step             3" in status.stdout

    bad = installed("nexrl-train", f"run_dir={elsewhere / 'bad'}", "data.batch_size=0")
    assert bad.returncode == 2 and "data.batch_size" in bad.stderr
    assert not (elsewhere / "bad").exists()
