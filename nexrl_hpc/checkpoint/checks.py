"""The checkpoints' config checks: a resume from a path names the path."""

from __future__ import annotations

from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, config_value, rule_problems


def resume_problems(cfg: Mapping) -> list[ConfigProblem]:
    return rule_problems(
        lambda: (
            config_value(cfg, "resume.mode") != "from_path" or bool(config_value(cfg, "resume.resume_path"))
        ),
        "resume.resume_path",
        "resume.mode=from_path needs resume.resume_path",
    )
