"""The names a config picks algorithm pieces by: advantage estimators, policy losses, KL estimators.

They live on the config's floor so the schema can type its keys with them (the validator accepts
an enum's values) while ``nexrl_hpc.algorithm`` keys its registries by the same members: a name
added here is one the config accepts and a registry must implement.
"""

from __future__ import annotations

from nexrl_hpc.config.enums import StrEnum


class AdvantageEstimator(StrEnum):
    """``algorithm.adv_estimator``: how a sequence's advantage is made from the outcome rewards."""

    GRPO = "grpo"  # group-normalised (without std: Dr. GRPO)
    RLOO = "rloo"  # leave-one-out baseline
    REINFORCE_PP = "reinforce_pp"  # rewards whitened over the batch
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"  # group mean off, then whitened
    GAE = "gae"  # PPO: per-token GAE over a learned critic's values (algorithm=ppo)


class PolicyLossName(StrEnum):
    """``service.train_service.actor.policy_loss``: the clipped surrogate's form."""

    VANILLA = "vanilla"  # token-level PPO-clip
    GSPO = "gspo"  # GSPO's sequence-level ratio


class KLEstimator(StrEnum):
    """``algorithm.kl_loss_type``: the per-token estimate of KL(pi || pi_ref)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"  # = k3
