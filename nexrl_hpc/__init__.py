"""nexrl_hpc: RL post-training for language models on Slurm clusters.

``nexrl_hpc.train(overrides=[...], train_dataset=..., reward_fn=...)`` runs a training run from
Python (see ``nexrl_hpc.api``); a config that must not run raises ``nexrl_hpc.ConfigError`` (its
``problems`` name every key); ``python -m launch.train`` is the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexrl_hpc.api import TrainResult, train
    from nexrl_hpc.config.validate import ConfigError

__all__ = ["ConfigError", "TrainResult", "train"]


def __getattr__(name: str) -> Any:
    """``train``, ``TrainResult`` and ``ConfigError`` import the config stack on first use, not with
    every submodule."""
    if name in __all__:
        from nexrl_hpc import api

        return getattr(api, name)
    raise AttributeError(f"module 'nexrl_hpc' has no attribute {name!r}")
