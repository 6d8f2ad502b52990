"""Running sums of one ``update_actor`` step's losses and token statistics, and its loss metrics.

Each trainer rank adds its real micro-batches (stand-in passes add nothing); the sums are then
reduced over the ranks, so the metrics are the whole batch's.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nexrl_hpc.trainer.parallel import ParallelStrategy


@dataclass
class LossSums:
    pg_loss: float = 0.0  # policy-gradient loss, summed over micro-batches
    kl_loss: float = 0.0  # KL-to-reference loss, summed over micro-batches (0 without a reference)
    entropy_loss: float = 0.0  # aggregated entropy (the bonus's term), summed over micro-batches
    clipfrac: float = 0.0  # PPO-clipped tokens (lower + upper)
    clipfrac_lower: float = 0.0  # clipped at 1 - clip_ratio_low (A < 0)
    clipfrac_upper: float = 0.0  # clipped at 1 + clip_ratio_high (A > 0)
    clipfrac_dual: float = 0.0  # bounded by the dual clip (A < 0, ratio past clip_ratio_c)
    ppo_kl: float = 0.0  # approximate KL(old || new), summed over tokens
    entropy: float = 0.0  # the policy's entropy at each response token, summed over tokens
    tokens: float = 0.0  # response tokens seen

    def add(self, other: LossSums) -> None:
        """Add one micro-batch's values."""
        for name, value in zip(fields(self), astuple(other)):
            setattr(self, name.name, getattr(self, name.name) + value)

    def all_reduced(self, par: ParallelStrategy) -> LossSums:
        """The sums over every trainer rank (one collective); the ranks of a sequence-parallel group
        each hold their rows' whole sums, counted once."""
        copies = par.sequence_parallel_size
        return LossSums(*(value / copies for value in par.all_reduce_sum(list(astuple(self)))))

    def metrics(self, optimizer_steps: int, kl_loss_coef: float, entropy_coeff: float) -> dict[str, float]:
        """Losses per optimizer step (skipped ones included); clip fractions, KL and entropy per token."""
        tokens = max(self.tokens, 1.0)
        loss = self.pg_loss + kl_loss_coef * self.kl_loss - entropy_coeff * self.entropy_loss
        return {
            "actor/pg_loss": self.pg_loss / optimizer_steps,
            "actor/kl_loss": self.kl_loss / optimizer_steps,
            "actor/entropy_loss": self.entropy_loss / optimizer_steps,
            "actor/loss": loss / optimizer_steps,
            "actor/pg_clipfrac": self.clipfrac / tokens,
            "actor/pg_clipfrac_lower": self.clipfrac_lower / tokens,
            "actor/pg_clipfrac_upper": self.clipfrac_upper / tokens,
            "actor/pg_clipfrac_dual": self.clipfrac_dual / tokens,
            "actor/ppo_kl": self.ppo_kl / tokens,
            "actor/entropy": self.entropy / tokens,
        }
