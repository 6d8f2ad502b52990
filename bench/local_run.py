"""One local-mode run of the real controller for a benchmark: compose, validate, run, read the steps."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

from nexrl_hpc.config import register_resolvers, validate_config  # noqa: E402
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


def run_local(prefix: str, overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config, metrics rows of the training steps) of a run in a fresh temp run dir."""
    register_resolvers()
    run_dir = tempfile.mkdtemp(prefix=prefix)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="bench"):
        cfg = validate_config(compose("rl_train", overrides=[f"run_dir={run_dir}", *overrides, *QUIET]))
    NexRLController(cfg).run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return cfg, [json.loads(line) for line in f if "train/reward_mean" in line]
