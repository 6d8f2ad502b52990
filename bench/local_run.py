"""One run of the real controller for a benchmark: compose, validate, run, read the steps.

``run_local`` runs it in this process (local mode); ``run_mpi`` under ``mpirun`` (launch_mode=mpi,
each role on its own rank: the rollout side no longer shares the trainer's Python process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

from nexrl_hpc.assembly import validate_config  # noqa: E402
from nexrl_hpc.config import register_resolvers  # noqa: E402
from nexrl_hpc.controller import NexRLController  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# what a throughput benchmark leaves out: validation, checkpoints, loggers, resuming
QUIET = [
    "train_worker.save_freq=0",
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
    "resume.mode=disable",
]


def _compose(run_dir: str, overrides: list[str]) -> dict[str, Any]:
    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="bench"):
        return validate_config(compose("rl_train", overrides=[f"run_dir={run_dir}", *overrides, *QUIET]))


def _training_rows(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "train/reward_mean" in line]


def run_local(prefix: str, overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config, metrics rows of the training steps) of a run in a fresh temp run dir."""
    run_dir = tempfile.mkdtemp(prefix=prefix)
    cfg = _compose(run_dir, overrides)
    NexRLController(cfg).run()
    return cfg, _training_rows(run_dir)


def run_mpi(prefix: str, overrides: list[str], ranks: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``run_local`` under ``mpirun -n ranks`` (the config is validated here first)."""
    if shutil.which("mpirun") is None:
        raise SystemExit("mpirun not found: bash scripts/install.sh --dev installs MPICH")
    run_dir = tempfile.mkdtemp(prefix=prefix)
    overrides = ["launch_mode=mpi", *overrides]
    cfg = _compose(run_dir, overrides)
    repo = os.path.dirname(CONFIG_DIR)
    cmd = ["mpirun", "-n", str(ranks), sys.executable, "-m", "launch.train"]
    cmd += [f"run_dir={run_dir}", *overrides, *QUIET]
    out_path = os.path.join(run_dir, "mpirun.out")
    with open(out_path, "w") as out:
        proc = subprocess.run(cmd, cwd=repo, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        with open(out_path) as f:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    return cfg, _training_rows(run_dir)
