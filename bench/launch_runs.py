"""One ``python -m launch.train`` run as a user starts it, timed, with its metrics (for the task benches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_train_run(
    overrides: Sequence[str],
    name: str,
    launcher: Sequence[str] = (),
    inspect_run_dir: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], float, float]:
    """Run ``launch.train`` with ``overrides`` (behind ``launcher``, e.g. ``mpirun -n 4``) in a fresh
    run dir: (its metrics.jsonl rows, the start time, wall seconds). ``inspect_run_dir`` sees the
    finished run dir, which is then removed; a failed run ends the bench naming ``name``."""
    run_dir = tempfile.mkdtemp(prefix=f"bench_{name}_")
    args = [
        *launcher,
        sys.executable,
        "-m",
        "launch.train",
        f"run_dir={run_dir}",
        "logger.backend=[]",
        "resume.mode=disable",
        *overrides,
    ]
    t0 = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if inspect_run_dir is not None:
        inspect_run_dir(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return rows, t0, wall


def independent_accuracy(run_dir: str, name: str, steps: int | None = None) -> float:
    """``scripts/independent_eval.py``'s held-out accuracy of the run's last checkpoint (plain
    transformers, greedy); a failed evaluation, or a last checkpoint that is not ``steps``'s, ends the
    bench naming ``name``."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "independent_eval.py"), run_dir],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"independent evaluation of {name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if steps is not None and not result["checkpoint"].endswith(f"global_step_{steps}"):
        raise SystemExit(f"{name}: the last checkpoint is {result['checkpoint']}, not step {steps}")
    return float(result["accuracy"])
