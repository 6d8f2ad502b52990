"""The tasks' reward functions, kept importable under their old path (they live in nexrl_hpc.rewards)."""

from nexrl_hpc.rewards.match import exact_match, prefix_match

__all__ = ["exact_match", "prefix_match"]
