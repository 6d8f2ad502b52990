"""The checkpoints' config checks: a resume from a path names the path; a resume whose trainer
layout cannot load the checkpoint's optimizer state names the key that changed."""

from __future__ import annotations

import os
from collections.abc import Mapping

from nexrl_hpc.checkpoint.manager import find_latest_checkpoint, is_complete
from nexrl_hpc.checkpoint.reshard import LiveLayout, layout_problem, rank_file, saved_layout
from nexrl_hpc.config.validate import ConfigProblem, config_value, rule_problems


def resume_problems(cfg: Mapping) -> list[ConfigProblem]:
    return rule_problems(
        lambda: (
            config_value(cfg, "resume.mode") != "from_path" or bool(config_value(cfg, "resume.resume_path"))
        ),
        "resume.resume_path",
        "resume.mode=from_path needs resume.resume_path",
    )


def resume_layout_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The checkpoint this run would resume from holds optimizer state its trainer layout cannot
    load (another engine or world size where no resharding exists): refused before the queue
    wait, naming the key that changed and the file (``reshard.layout_problem``)."""
    try:
        checkpoint = _checkpoint_to_check(cfg)
        if checkpoint is None:
            return []
        saved = saved_layout(checkpoint)
        ts = config_value(cfg, "service.train_service")
        live = LiveLayout(
            str(ts["engine"]),
            int(ts["world_size"]),
            int(ts["deepspeed"]["zero_stage"]) if ts["engine"] == "deepspeed" else None,
        )
    except (KeyError, TypeError, ValueError):
        return []  # a missing or mistyped key is the schema's to name; an unreadable file the run's
    problem = layout_problem(saved, live) if saved is not None else None
    if problem is None:
        return []
    key, why = problem
    return [ConfigProblem(key, f"{rank_file(checkpoint, 0)}: {why}")]


def _checkpoint_to_check(cfg: Mapping) -> str | None:
    """The checkpoint a resume would read, as far as pre-flight can tell without reading any
    weights: ``resume.resume_path`` (from_path) or the newest complete one (auto)."""
    mode = config_value(cfg, "resume.mode")
    if mode == "from_path":
        path = config_value(cfg, "resume.resume_path")
        return os.path.abspath(path) if path and is_complete(os.path.abspath(path)) else None
    if mode != "auto":
        return None
    return find_latest_checkpoint(str(config_value(cfg, "train_worker.checkpoint_path")))
