"""The composition of the package, on its top floor: every room's config checks gathered into one
validation (``validate_config``), and the role registry (``assembly.roles``) the runtimes are
handed. The rooms below know nothing of each other's settings or classes."""

from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig

from nexrl_hpc.assembly.checks import semantic_problems
from nexrl_hpc.config import checked_config
from nexrl_hpc.config.schema import RLTrainConfig

__all__ = ["semantic_problems", "validate_config"]


def validate_config(cfg: DictConfig | Mapping) -> RLTrainConfig:
    """Resolve and check ``cfg`` (schema, then every room's cross-field checks); raise
    ``ConfigError`` listing every problem (exit code 2)."""
    return checked_config(cfg, semantic_problems)
