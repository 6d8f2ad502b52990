"""The actor's loss on one micro-batch: the policy-gradient surrogate, an entropy bonus, a KL penalty.

Each term is a small object that returns ``(loss, metrics)`` for a micro-batch; ``ActorLoss`` adds
the terms up in that order and merges their metrics. The metrics are detached scalar tensors,
summed over micro-batches by the trainer (their names are ``trainer.loss_sums.LossSums``'s fields),
so the trainer's loop only runs the model, calls the loss and steps the optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nexrl_hpc.algorithm.core_algos import PolicyLoss, aggregate, kl_penalty, policy_loss

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as the loss sees it: the policy's log-probs and entropy at every response
    position ([B, T]), the batch's tensors, the mini-batch-wide normaliser, and the frozen
    reference's log-probs (None without a KL term)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    tensors: Mapping[str, torch.Tensor]
    normalizer: float | None
    ref_log_prob: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]


@dataclass(frozen=True)
class PolicyGradientTerm:
    """``actor.policy_loss`` (PPO-clip or GSPO) against the old log-probs, weighted by the
    importance weights when the batch has them (off-policy correction)."""

    surrogate: PolicyLoss
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None
    log_ratio_clamp: float | None
    agg_mode: str

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, Metrics]:
        loss, stats = self.surrogate(
            x.log_prob,
            x.tensors["old_log_probs"],
            x.tensors["advantages"],
            x.mask,
            self.clip_low,
            self.clip_high,
            self.agg_mode,
            x.normalizer,
            token_weights=x.tensors.get("is_weights"),
            clip_ratio_c=self.clip_ratio_c,
            log_ratio_clamp=self.log_ratio_clamp,
        )
        metrics = {
            "pg_loss": loss.detach(),
            "clipfrac": stats["clipfrac_sum"],
            "clipfrac_lower": stats["clipfrac_lower_sum"],
            "clipfrac_upper": stats["clipfrac_upper_sum"],
            "clipfrac_dual": stats["clipfrac_dual_sum"],
            "ppo_kl": stats["ppo_kl_sum"],
            "tokens": stats["tokens"],
        }
        return loss, metrics


@dataclass(frozen=True)
class EntropyBonus:
    """``-coeff * entropy`` (aggregated like the surrogate): higher entropy, lower loss. The entropy
    is measured whatever ``coeff`` is; with 0 it adds nothing to the loss."""

    coeff: float
    agg_mode: str

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor | None, Metrics]:
        entropy_agg = aggregate(x.entropy, x.mask, self.agg_mode, x.normalizer)
        metrics = {
            "entropy_loss": entropy_agg.detach(),
            "entropy": (x.entropy.detach() * x.mask).sum(),  # summed over tokens, for the per-token mean
        }
        return (-self.coeff * entropy_agg if self.coeff > 0 else None), metrics


@dataclass(frozen=True)
class KLPenalty:
    """``coeff * KL(pi || pi_ref)`` per token (``algorithm.kl_loss_type``), aggregated like the
    surrogate; nothing without the reference's log-probs."""

    coeff: float
    kind: str
    agg_mode: str

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor | None, Metrics]:
        if x.ref_log_prob is None:
            return None, {"kl_loss": torch.zeros(())}
        kl = aggregate(kl_penalty(x.log_prob, x.ref_log_prob, self.kind), x.mask, self.agg_mode, x.normalizer)
        return self.coeff * kl, {"kl_loss": kl.detach()}


@dataclass(frozen=True)
class ActorLoss:
    """pg + entropy bonus + KL penalty on one micro-batch; ``(loss, metrics)``."""

    policy_gradient: PolicyGradientTerm
    entropy_bonus: EntropyBonus
    kl_penalty: KLPenalty

    @classmethod
    def from_config(cls, actor: Mapping[str, Any], algorithm: Mapping[str, Any]) -> ActorLoss:
        """From ``service.train_service.actor`` and the ``algorithm`` keys the trainer gets."""
        agg = actor["loss_agg_mode"]
        return cls(
            PolicyGradientTerm(
                policy_loss(actor["policy_loss"]),
                actor["clip_ratio_low"],
                actor["clip_ratio_high"],
                actor["clip_ratio_c"],
                actor["log_ratio_clamp"],
                agg,
            ),
            EntropyBonus(actor["entropy_coeff"], agg),
            KLPenalty(algorithm["kl_loss_coef"], algorithm["kl_loss_type"], agg),
        )

    @property
    def entropy_needs_grad(self) -> bool:
        """Only a bonus trains on the entropy; otherwise its graph would cost memory for nothing."""
        return self.entropy_bonus.coeff > 0

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = self.policy_gradient(x)
        for term in (self.entropy_bonus, self.kl_penalty):
            term_loss, term_metrics = term(x)
            if term_loss is not None:
                loss = loss + term_loss
            metrics.update(term_metrics)
        return loss, metrics
