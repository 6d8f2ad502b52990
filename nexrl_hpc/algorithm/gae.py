"""PPO with a learned critic: GAE advantages and returns per token, and the clipped value loss.

Token-level, masked as the actor's loss is (``response_mask``): a masked token (a tool's or an
environment's, in multi-turn rollouts) has no TD error and passes the next value and the running
advantage through it, as verl's ``compute_gae_advantage_return`` does. The outcome reward sits on a
response's last token (``token_level_rewards``); the advantages are whitened over the batch's tokens.
"""

from __future__ import annotations

import torch

from nexrl_hpc.algorithm.core_algos import aggregate


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """(v - masked mean) / sqrt(unbiased masked variance + epsilon), verl's ``masked_whiten``."""
    m = mask.to(values.dtype)
    count = m.sum()
    mean = (values * m).sum() / count.clamp(min=1.0)
    var = ((values - mean).square() * m).sum() / count.clamp(min=1.0)
    if count > 1:
        var = var * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + epsilon)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each sequence's reward on its last trained token (0 elsewhere; nothing for a row
    without trained tokens)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    lengths = mask.to(torch.long).sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    if rows.numel():
        positions = torch.arange(mask.shape[1]).expand_as(mask)
        last = (positions * (mask > 0)).amax(-1)  # the last masked position (not the length - 1)
        out[rows, last[rows]] = rewards.to(torch.float32)[rows]
    return out


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages whitened over the batch's tokens, returns = raw advantages + values), [B, T].

    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}, from the last token back
    (V after the last token is 0)."""
    token_rewards, values = token_rewards.to(torch.float32), values.to(torch.float32)
    m = mask.to(torch.float32)
    next_value = torch.zeros(values.shape[0])
    running = torch.zeros(values.shape[0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        running = step * m[:, t] + (1 - m[:, t]) * running
        reversed_adv.append(running)
    raw = torch.stack(reversed_adv[::-1], dim=1) if reversed_adv else torch.zeros_like(values)
    returns = raw + values
    return masked_whiten(raw, m) * m, returns * m


def value_loss(
    predicted: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    agg_mode: str,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), aggregated by ``agg_mode``
    (``cliprange_value`` None: the unclipped squared error). Stats: the clipped tokens' count."""
    unclipped = (predicted - returns).square()
    if cliprange_value is None:
        token_loss = unclipped
        clipped_tokens = torch.zeros_like(unclipped)
    else:
        clipped_pred = old_values + (predicted - old_values).clamp(-cliprange_value, cliprange_value)
        clipped = (clipped_pred - returns).square()
        token_loss = torch.maximum(unclipped, clipped)
        clipped_tokens = (clipped > unclipped).float()
    loss = 0.5 * aggregate(token_loss, mask, agg_mode, normalizer)
    m = mask.to(torch.float32)
    with torch.no_grad():
        stats = {
            "vf_clipfrac_sum": (clipped_tokens * m).sum(),
            "vpred_sum": (predicted.detach() * m).sum(),
            "tokens": m.sum(),
        }
    return loss, stats
