"""Pure tensor functions of the RL objective: advantages, KL estimators, the clipped policy loss."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nexrl_hpc.config.algorithm_names import AdvantageEstimator, KLEstimator, PolicyLossName

KL_ESTIMATORS = tuple(kind.value for kind in KLEstimator)


def group_index(keys: list) -> torch.Tensor:
    """Map each row's group key to a dense index 0..G-1 (first-seen order)."""
    seen: dict = {}
    return torch.tensor([seen.setdefault(k, len(seen)) for k in keys], dtype=torch.long)


def equal_reward_groups(rewards: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per group, whether every reward in it is exactly the same (bool [G]; a group of one too).

    An exact test, as the pool's dynamic sampling makes it: the mean of 16 x 0.7 is not 0.7 in
    fp32, so ``r - mean`` would hand every sample of such a group a spurious advantage."""
    rewards = rewards.to(torch.float32)
    highest = torch.full((n_groups,), -torch.inf).scatter_reduce(0, groups, rewards, "amax")
    lowest = torch.full((n_groups,), torch.inf).scatter_reduce(0, groups, rewards, "amin")
    return highest == lowest


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Outcome advantage per sequence: (r - mean_group) / (std_group + eps), std unbiased.

    With ``norm_by_std=False`` only the group mean is subtracted (Dr. GRPO). A group whose rewards
    are all exactly equal (a group of one included) gets advantage 0 and std 0, and counts in
    ``zero_std_group_frac``.
    """
    rewards = rewards.to(torch.float32)
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    counts = torch.zeros(n_groups).index_add_(0, groups, torch.ones_like(rewards))
    sums = torch.zeros(n_groups).index_add_(0, groups, rewards)
    means = sums / counts
    flat = equal_reward_groups(rewards, groups, n_groups)
    centered = torch.where(flat[groups], torch.zeros_like(rewards), rewards - means[groups])
    sq = torch.zeros(n_groups).index_add_(0, groups, centered**2)
    std = torch.where(flat, torch.zeros_like(counts), (sq / (counts - 1).clamp(min=1)).sqrt())
    if norm_by_std:
        adv = centered / (std[groups] + epsilon)
    else:
        adv = centered
    stats = {
        "zero_std_group_frac": float(flat.float().mean()) if n_groups else 0.0,
        "group_reward_std_mean": float(std.mean()) if n_groups else 0.0,
    }
    return adv, stats


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE leave-one-out: r_i minus the mean reward of the group's other samples,
    i.e. n/(n-1) (r_i - mean_group). A group of one has no baseline, and a group whose rewards are
    all exactly equal no signal: advantage 0, counted in ``zero_std_group_frac``."""
    rewards = rewards.to(torch.float32)
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    counts = torch.zeros(n_groups).index_add_(0, groups, torch.ones_like(rewards))
    sums = torch.zeros(n_groups).index_add_(0, groups, rewards)
    n = counts[groups]
    others_mean = (sums[groups] - rewards) / (n - 1).clamp(min=1)
    flat = equal_reward_groups(rewards, groups, n_groups)
    adv = torch.where(flat[groups], torch.zeros_like(rewards), rewards - others_mean)
    return adv, {"zero_std_group_frac": float(flat.float().mean()) if n_groups else 0.0}


def batch_whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Per-sequence values standardised over the batch's response tokens (each sequence weighs
    by its length, as REINFORCE++ whitens token-level returns). Values that are all exactly equal
    (over the rows with tokens) whiten to 0, not to the rounding error of their mean."""
    weights = mask.to(torch.float32).sum(-1)
    counted = values[weights > 0]
    if counted.numel() == 0 or bool((counted == counted[0]).all()):
        return torch.zeros_like(values)
    total = weights.sum().clamp(min=1.0)
    mean = (values * weights).sum() / total
    var = ((values - mean).square() * weights).sum() / (total - 1).clamp(min=1.0)
    return (values - mean) / (var.sqrt() + epsilon)


AdvantageFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, dict[str, float]]
]
"""(rewards [B], groups [B], response mask [B, T], norm_by_std, epsilon) -> (advantage [B], stats)."""


def _grpo(
    rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    return grpo_advantages(rewards, groups, norm_by_std, epsilon)


def _rloo(
    rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    return rloo_advantages(rewards, groups)


def _reinforce_pp(
    rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    adv = batch_whiten(rewards.to(torch.float32), mask, epsilon)
    # no group baseline: a group is signal-free only when the whole batch is (everything whitens to 0)
    return adv, {"zero_std_group_frac": float(bool((adv == 0).all()))}


def _reinforce_pp_baseline(
    rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    centered, stats = grpo_advantages(rewards, groups, False, epsilon)
    whitened = batch_whiten(centered, mask, epsilon)
    # a group whose rewards are all equal has no signal: it stays at 0 rather than taking the batch
    # mean's shift (verl's whitening moves it to -mean/std)
    flat = equal_reward_groups(rewards, groups, int(groups.max()) + 1 if groups.numel() else 0)
    return torch.where(flat[groups], torch.zeros_like(whitened), whitened), stats


def _gae_from_the_critic(
    rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, epsilon: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """GAE's outcome part: no sequence advantage. The processor puts each reward on its response's
    last token; the trainer side (``trainer.ppo_backend``) makes the per-token advantages from them
    and the critic's values (``algorithm.gae.gae_advantages``)."""
    return torch.zeros(rewards.shape, dtype=torch.float32), {"zero_std_group_frac": 0.0}


ADVANTAGE_ESTIMATORS: dict[AdvantageEstimator, AdvantageFn] = {
    AdvantageEstimator.GRPO: _grpo,  # group-normalised; without std: Dr. GRPO
    AdvantageEstimator.RLOO: _rloo,  # leave-one-out
    AdvantageEstimator.REINFORCE_PP: _reinforce_pp,  # rewards whitened over the batch, no group baseline
    AdvantageEstimator.REINFORCE_PP_BASELINE: _reinforce_pp_baseline,  # group mean off, then whitened
    AdvantageEstimator.GAE: _gae_from_the_critic,  # per token, from the critic's values (trainer side)
}
ADV_ESTIMATORS = tuple(estimator.value for estimator in AdvantageEstimator)


def outcome_advantages(
    estimator: str,
    rewards: torch.Tensor,
    groups: torch.Tensor,
    mask: torch.Tensor,
    norm_by_std: bool,
    epsilon: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per sequence from its outcome reward, by ``algorithm.adv_estimator`` (a key of
    ``ADVANTAGE_ESTIMATORS``)."""
    try:
        advantage_fn = ADVANTAGE_ESTIMATORS[AdvantageEstimator(estimator)]
    except ValueError:
        raise ValueError(
            f"unknown algorithm.adv_estimator {estimator!r}; expected one of {ADV_ESTIMATORS}"
        ) from None
    return advantage_fn(rewards, groups, mask, norm_by_std, epsilon)


def stepwise_grpo_advantages(
    step_returns: list[list[float]],
    step_spans: list[list[list[int]]],
    groups: torch.Tensor,
    response_len: int,
    norm_by_std: bool,
    epsilon: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages [B, T] for multi-turn trajectories: turn k's tokens
    (``step_spans[i][k] = [start, end)`` in the response) get turn k's return normalised like
    ``grpo_advantages`` over the turn-k returns of the group's episodes that reached turn k.

    Why: one outcome advantage for every turn credits a good call with a bad answer's luck and
    the other way round; per-turn returns (with the workflow's gamma) separate them.
    """
    adv = torch.zeros((len(step_returns), response_len), dtype=torch.float32)
    zero_std: list[float] = []
    turns = max((len(r) for r in step_returns), default=0)
    for k in range(turns):
        rows = [i for i, r in enumerate(step_returns) if len(r) > k]
        turn_adv, stats = grpo_advantages(
            torch.tensor([float(step_returns[i][k]) for i in rows]),
            group_index([int(groups[i]) for i in rows]),
            norm_by_std,
            epsilon,
        )
        zero_std.append(stats["zero_std_group_frac"])
        for i, a in zip(rows, turn_adv.tolist()):
            start, end = step_spans[i][k]
            adv[i, start:end] = a
    return adv, {"zero_std_group_frac": sum(zero_std) / len(zero_std) if zero_std else 0.0}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = log_prob - ref_log_prob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # k3 = r - 1 - log r with r = pi_ref / pi; clamped as the low-variance form is in practice
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return (neg.exp() - 1.0 - neg).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")


def aggregate(
    token_values: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float | None = None
) -> torch.Tensor:
    """Reduce [B, T] token values to a scalar.

    token-mean: sum over all masked tokens / ``normalizer`` (the token count of the whole mini-batch
    when gradients are accumulated over micro-batches, so every token weighs the same).
    seq-mean-token-sum / seq-mean-token-mean: per-sequence sum or mean, then mean over sequences
    (``normalizer`` = number of sequences in the mini-batch).
    seq-mean-token-sum-norm (Dr. GRPO): per-sequence sums over sequences x a constant token budget
    (``normalizer``; without one, the padded width), so a long response's tokens weigh no less.
    """
    mask = mask.to(token_values.dtype)
    if mode == "token-mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
        return (token_values * mask).sum() / denom
    per_seq = (token_values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums over a constant, not each length
        if normalizer is None:  # the trainer passes sequences x actor.loss_norm_tokens
            return per_seq.sum() / float(per_seq.numel() * token_values.shape[-1])
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    denom = normalizer if normalizer is not None else float(per_seq.numel())
    return per_seq.sum() / denom


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg_mode: str,
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip surrogate: -min(r A, clip(r, 1-lo, 1+hi) A), aggregated by ``agg_mode``.

    ``token_weights`` (constant per token, e.g. importance weights pi_prox / pi_behaviour of
    decoupled PPO or truncated IS) scale each token's surrogate.

    Safety rails (None: off). ``log_ratio_clamp`` bounds log r before ``exp``, so an extreme ratio
    is clipped instead of overflowing to an inf loss / NaN gradient that skips the whole step.
    ``clip_ratio_c`` (dual-clip, > 1): for A < 0 the token loss is at most -A * c, since the plain
    PPO objective is unbounded there when r is large (stale behaviour log-probs in async modes).
    The stats count clipped tokens per side (lower: r < 1-lo with A < 0; upper: r > 1+hi with
    A > 0; their sum is ``clipfrac_sum``) and the dual-clipped ones.
    """
    log_ratio = log_prob - old_log_prob
    raw_log_ratio = log_ratio
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual_bound = None
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, dual_bound), token_loss)
    if token_weights is not None:
        token_loss = token_loss * token_weights
    loss = aggregate(token_loss, mask, agg_mode, normalizer)
    with torch.no_grad():
        m = mask.to(torch.float32)
        ppo_clipped = (clipped > unclipped).float() * m
        if dual_bound is not None:
            dual = ((advantages < 0) & (dual_bound < torch.maximum(unclipped, clipped))).float() * m
        else:
            dual = torch.zeros_like(m)
        stats = {
            "clipfrac_sum": ppo_clipped.sum(),
            "clipfrac_lower_sum": (ppo_clipped * (ratio < 1.0).float()).sum(),
            "clipfrac_upper_sum": (ppo_clipped * (ratio > 1.0).float()).sum(),
            "clipfrac_dual_sum": dual.sum(),
            "ppo_kl_sum": (-raw_log_ratio * m).sum(),
            "tokens": m.sum(),
        }
    return loss, stats


def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg_mode: str,
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the PPO-clip surrogate on a sequence-level ratio.

    s_i = exp(mean_t log(pi / pi_old)) over sequence i's masked tokens: one ratio per sequence, so a
    sequence is clipped (or not) as a whole and the update follows the unit the reward scores. Each
    token carries s_i's value with its own gradient (s_i,t = sg[s_i] * pi_t / sg[pi_t]), which is
    the gradient of s_i spread over the sequence's tokens. ``clip_ratio_c`` and ``token_weights``
    act as in ``ppo_clip_loss``; ``log_ratio_clamp`` bounds the sequence's mean log-ratio.
    """
    m = mask.to(log_prob.dtype)
    token_log_ratio = (log_prob - old_log_prob) * m
    seq_log_ratio = token_log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)
    if log_ratio_clamp is not None:
        seq_log_ratio = seq_log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    loss, stats = ppo_clip_loss(
        log_ratio,
        torch.zeros_like(log_ratio),
        advantages,
        mask,
        clip_low,
        clip_high,
        agg_mode,
        normalizer,
        token_weights=token_weights,
        clip_ratio_c=clip_ratio_c,
        log_ratio_clamp=None,
    )
    with torch.no_grad():  # the policy's own drift, per token (ppo_clip_loss saw the sequence's)
        stats["ppo_kl_sum"] = (-(log_prob - old_log_prob) * mask.to(torch.float32)).sum()
    return loss, stats


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[PolicyLossName, PolicyLoss] = {
    PolicyLossName.VANILLA: ppo_clip_loss,
    PolicyLossName.GSPO: gspo_loss,
}


def policy_loss(name: str) -> PolicyLoss:
    """The policy loss of ``service.train_service.actor.policy_loss``."""
    try:
        return POLICY_LOSSES[PolicyLossName(name)]
    except ValueError:
        raise ValueError(
            f"unknown actor.policy_loss {name!r}; expected one of {sorted(n.value for n in PolicyLossName)}"
        ) from None
