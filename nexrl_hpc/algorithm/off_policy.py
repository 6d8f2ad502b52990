"""Off-policy bookkeeping of asynchronous RL: version gaps, the staleness bound, importance weights.

A trajectory sampled with weight version ``v`` and trained at step ``s`` (which updates version
``s - 1``) is ``s - 1 - v`` versions stale. Pure functions over a processed batch, so the trainer's
step reads top to bottom.
"""

from __future__ import annotations

from typing import Any

import torch

from nexrl_hpc.types import Batch


def staleness(batch: Batch, step: int) -> torch.Tensor:
    """Version gap of every row trained at ``step`` (rows without a version count as fresh)."""
    versions = batch.values.get("weight_version")
    if not isinstance(versions, torch.Tensor) or versions.numel() == 0:
        return torch.zeros(len(batch), dtype=torch.long)
    gap = (step - 1) - versions.to(torch.long)
    return torch.where(versions < 0, torch.zeros_like(gap), gap)


def staleness_metrics(gap: torch.Tensor) -> dict[str, float]:
    """Mean, max and a histogram (trajectories per gap) of one step's batch."""
    if gap.numel() == 0:
        return {}
    metrics = {"train/staleness_mean": float(gap.float().mean()), "train/staleness_max": float(gap.max())}
    values, counts = torch.unique(gap, return_counts=True)
    for v, c in zip(values.tolist(), counts.tolist()):
        metrics[f"train/staleness_hist/{v}"] = float(c)
    return metrics


def select_rows(batch: Batch, keep: torch.Tensor) -> Batch:
    """The rows of a processed batch where ``keep`` is true (tensors, per-row metadata, token count)."""
    index = keep.nonzero().flatten()
    n = len(batch)
    values = {
        k: (
            v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
        )
        for k, v in batch.values.items()
    }
    metadata: dict[str, Any] = dict(batch.metadata)
    rows = index.tolist()
    for key in ("uid", "epoch", "task_keys"):
        if isinstance(metadata.get(key), list) and len(metadata[key]) == n:
            metadata[key] = [metadata[key][i] for i in rows]
    metadata["batch_size"] = len(rows)
    if "attention_mask" in values:
        metadata["global_token_num"] = int(values["attention_mask"].sum())
    return Batch(values=values, metadata=metadata)


def importance_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token pi_prox / pi_behaviour (truncated at ``cap``), zero off the mask, and its statistics.

    Decoupled PPO and truncated IS both weight the clipped surrogate (taken against the proximal
    policy) by this ratio: it corrects for tokens sampled by an older or numerically different engine.
    """
    m = mask.to(torch.float32)
    raw = (proximal - behaviour).clamp(max=20.0).exp() * m
    weights = raw.clamp(max=cap) if cap is not None else raw
    tokens = m.sum().clamp(min=1.0)
    on = m.bool()
    stats = {
        "train/is_weight_mean": float(raw.sum() / tokens),
        "train/is_weight_max": float(raw[on].max()) if on.any() else 0.0,
        "train/is_weight_min": float(raw[on].min()) if on.any() else 0.0,
        "train/is_weight_truncated_frac": float(((raw > cap) & on).sum() / tokens)
        if cap is not None
        else 0.0,
    }
    return weights * m, stats
