"""``python -m launch.status <run_dir>``: where a run stands — Slurm state, step, reward, checkpoint.

Reads ``<run_dir>/launcher.json`` (written by launcher=slurm), ``metrics.jsonl``, ``config.yaml``
and the checkpoint folder; asks Slurm (sacct) for the job's state when the run was submitted.
Exit code 0, or 2 when the directory holds no run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def run_status(run_dir: str) -> dict[str, Any]:
    import yaml

    from nexrl_hpc.checkpoint.manager import find_latest_checkpoint
    from nexrl_hpc.tracking.experiment import read_metrics

    status: dict[str, Any] = {"run_dir": os.path.abspath(run_dir)}
    launcher = os.path.join(run_dir, "launcher.json")
    if os.path.exists(launcher):
        with open(launcher) as f:
            info = json.load(f)
        from nexrl_hpc.launcher.slurm import job_state

        status["job_id"] = info["job_id"]
        try:
            status["slurm_state"] = job_state(info["job_id"])
        except (OSError, RuntimeError, ValueError) as exc:
            status["slurm_state"] = f"unknown ({exc})"
        status["logs"] = [info["train_log"], info["stderr"][0]]
    total = None
    config_path = os.path.join(run_dir, "config.yaml")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = yaml.safe_load(f)
        total = config["train_worker"]["total_train_steps"]
        checkpoints = config["train_worker"]["checkpoint_path"]
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if "train/reward_mean" in r]
    vals = [r for r in rows if "val/accuracy" in r]
    status["step"] = steps[-1]["step"] if steps else 0
    status["total_steps"] = total
    status["reward_mean"] = steps[-1]["train/reward_mean"] if steps else None
    status["last_validation"] = (
        {"step": vals[-1]["step"], "val/accuracy": vals[-1]["val/accuracy"]} if vals else None
    )
    status["last_checkpoint"] = find_latest_checkpoint(checkpoints) if os.path.isdir(checkpoints) else None
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m launch.status <run_dir>", file=sys.stderr)
        return 2
    run_dir = args[0]
    if not os.path.isdir(run_dir) or not (
        os.path.exists(os.path.join(run_dir, "launcher.json"))
        or os.path.exists(os.path.join(run_dir, "config.yaml"))
    ):
        print(f"error: {run_dir} holds no run (no launcher.json or config.yaml)", file=sys.stderr)
        return 2
    status = run_status(run_dir)
    width = max(len(k) for k in status)
    for key, value in status.items():
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
