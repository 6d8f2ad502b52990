"""Running sums of one ``update_actor`` step's losses and token statistics, and its loss metrics.

Each trainer rank adds its real micro-batches (stand-in passes add nothing); the sums are then
reduced over the ranks, so the metrics are the whole batch's.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nexrl_hpc.trainer.parallel import ParallelStrategy


@dataclass
class LossSums:
    pg_loss: float = 0.0  # policy-gradient loss, summed over micro-batches
    kl_loss: float = 0.0  # KL-to-reference loss, summed over micro-batches (0 without a reference)
    clipfrac: float = 0.0  # clipped tokens
    ppo_kl: float = 0.0  # approximate KL(old || new), summed over tokens
    entropy: float = 0.0  # the policy's entropy at each response token, summed over tokens
    tokens: float = 0.0  # response tokens seen

    def add(
        self, pg_loss: float, kl_loss: float, clipfrac: float, ppo_kl: float, entropy: float, tokens: float
    ) -> None:
        self.pg_loss += pg_loss
        self.kl_loss += kl_loss
        self.clipfrac += clipfrac
        self.ppo_kl += ppo_kl
        self.entropy += entropy
        self.tokens += tokens

    def all_reduced(self, par: ParallelStrategy) -> LossSums:
        """The sums over every trainer rank (one collective)."""
        return LossSums(*par.all_reduce_sum(list(astuple(self))))

    def metrics(self, optimizer_steps: int, kl_loss_coef: float) -> dict[str, float]:
        """Losses per optimizer step (skipped ones included); clip fraction, KL and entropy per token."""
        tokens = max(self.tokens, 1.0)
        return {
            "actor/pg_loss": self.pg_loss / optimizer_steps,
            "actor/kl_loss": self.kl_loss / optimizer_steps,
            "actor/loss": (self.pg_loss + kl_loss_coef * self.kl_loss) / optimizer_steps,
            "actor/pg_clipfrac": self.clipfrac / tokens,
            "actor/ppo_kl": self.ppo_kl / tokens,
            "actor/entropy": self.entropy / tokens,
        }
