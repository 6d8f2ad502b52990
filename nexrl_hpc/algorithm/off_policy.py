"""Off-policy bookkeeping of asynchronous RL: version gaps, the staleness bound, importance weights.

A trajectory sampled with weight version ``v`` and trained at step ``s`` (which updates version
``s - 1``) is ``s - 1 - v`` versions stale. Functions over a processed batch (and the staleness
bound, which keeps the run's drop counts), so the trainer's step calls each in a line or two.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import torch

from nexrl_hpc.config.schema import WeightConfig
from nexrl_hpc.types import Batch

T = TypeVar("T")


def staleness(batch: Batch[torch.Tensor], step: int) -> torch.Tensor:
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


def rows_of_groups(batch: Batch[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Every row that shares a group (``group_index``, set by the processor) with a row in ``rows``;
    without group indices, ``rows`` itself."""
    groups = batch.values.get("group_index")
    if not isinstance(groups, torch.Tensor) or groups.numel() != rows.numel():
        return rows
    return torch.isin(groups, groups[rows])


def select_rows(batch: Batch[torch.Tensor], keep: torch.Tensor) -> Batch[torch.Tensor]:
    """The rows of a processed batch where ``keep`` is true (tensors, per-row metadata, token count)."""
    index = keep.nonzero().flatten()
    n = len(batch)
    values = {
        k: (
            v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
        )
        for k, v in batch.values.items()
    }
    metadata = batch.metadata.copy()
    rows = index.tolist()
    if "uid" in metadata:
        metadata["uid"] = _per_row(metadata["uid"], rows, n)
    if "epoch" in metadata:
        metadata["epoch"] = _per_row(metadata["epoch"], rows, n)
    if "task_keys" in metadata:
        metadata["task_keys"] = _per_row(metadata["task_keys"], rows, n)
    metadata["batch_size"] = len(rows)
    if "attention_mask" in values:
        metadata["global_token_num"] = int(values["attention_mask"].sum())
    return Batch(values=values, metadata=metadata)


def _per_row(column: list[T], rows: list[int], n: int) -> list[T]:
    """``column``'s entries at ``rows`` when it has one per row (``n``), else ``column`` itself."""
    if isinstance(column, list) and len(column) == n:
        return [column[i] for i in rows]
    return column


def importance_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None,
    over_cap: Literal["truncate", "mask"] = "truncate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token pi_prox / pi_behaviour, zero off the mask, and its statistics.

    Decoupled PPO and truncated IS both weight the clipped surrogate (taken against the proximal
    policy) by this ratio: it corrects for tokens sampled by an older or numerically different engine.
    They differ above ``cap``: truncated IS (``over_cap="truncate"``) keeps such a token at weight
    ``cap``; decoupled PPO (``"mask"``, as AReaL does) drops it from the loss (weight 0) — a token the
    behaviour policy found that much less likely than the proximal one is not trusted at all.
    """
    m = mask.to(torch.float32)
    raw = (proximal - behaviour).clamp(max=20.0).exp() * m
    if cap is None:
        weights = raw
    elif over_cap == "truncate":
        weights = raw.clamp(max=cap)
    else:
        weights = torch.where(raw > cap, torch.zeros_like(raw), raw)
    tokens = m.sum().clamp(min=1.0)
    on = m.bool()
    stats = {
        "train/is_weight_mean": float(raw.sum() / tokens),
        "train/is_weight_max": float(raw[on].max()) if on.any() else 0.0,
        "train/is_weight_min": float(raw[on].min()) if on.any() else 0.0,
        "train/is_weight_over_cap_frac": float(((raw > cap) & on).sum() / tokens) if cap is not None else 0.0,
    }
    return weights * m, stats


class StalenessBound:
    """``weight.staleness_threshold`` in the async modes: rows more versions old than the bound are
    dropped (``weight.stale_policy=drop``) or kept and counted (``keep``); sync mode only measures.

    A drop takes the stale row's whole group with it: the group's advantages were computed
    against each other, and the rows left of a group would no longer sum to zero."""

    def __init__(self, bound: int, drop: bool, async_mode: bool):
        self.bound = bound
        self._drop = drop
        self._async = async_mode
        self._dropped_total = 0
        self._kept_total = 0

    @classmethod
    def from_config(cls, weight: WeightConfig) -> StalenessBound:
        return cls(
            weight["staleness_threshold"], weight["stale_policy"] == "drop", weight["sync_mode"] != "sync"
        )

    def apply(
        self, batch: Batch[torch.Tensor], step: int
    ) -> tuple[Batch[torch.Tensor] | None, dict[str, float]]:
        """The rows of ``batch`` step ``step`` trains (None: every row dropped) and the step's
        staleness metrics (running totals included)."""
        gap = staleness(batch, step)
        metrics = staleness_metrics(gap)
        stale = gap > self.bound
        n_stale = int(stale.sum())
        kept: Batch[torch.Tensor] | None = batch
        if self._async and n_stale:
            if self._drop:
                drop = rows_of_groups(batch, stale)
                n_drop = int(drop.sum())
                self._dropped_total += n_drop
                kept = select_rows(batch, ~drop) if n_drop < len(batch) else None
            else:
                self._kept_total += n_stale
        metrics["train/stale_dropped_total"] = float(self._dropped_total)
        metrics["train/stale_kept_total"] = float(self._kept_total)
        metrics["train/stale_over_bound"] = float(n_stale)
        return kept, metrics


def use_recomputed_log_probs(
    tensors: dict[str, torch.Tensor],
    recomputed: torch.Tensor,
    correction: Literal["none", "decoupled", "tis"],
    is_cap: float | None,
) -> dict[str, float]:
    """The trainer's recomputed (proximal) log-probs become the batch's old log-probs; with an
    ``algorithm.off_policy_correction`` the tokens are weighted by pi_prox / pi_behaviour
    (``is_weights``). Returns the engine-vs-trainer mismatch and the weights' statistics."""
    mask = tensors["response_mask"]
    diff = (recomputed - tensors["behaviour_log_probs"]).abs() * mask
    metrics = {
        "train/logprob_mismatch_max": float(diff.max()),
        "train/logprob_mismatch_mean": float(diff.sum() / mask.sum().clamp(min=1.0)),
    }
    tensors["old_log_probs"] = recomputed
    if correction != "none":  # decoupled / truncated IS: weight by pi_prox / pi_behaviour
        weights, is_metrics = importance_weights(
            recomputed,
            tensors["behaviour_log_probs"],
            mask,
            is_cap,
            over_cap="mask" if correction == "decoupled" else "truncate",
        )
        tensors["is_weights"] = weights
        metrics.update(is_metrics)
    return metrics
