"""The algorithm processor: a batch of trajectories -> the training batch, with its advantages.

Every estimator of ``algorithm.adv_estimator`` (``core_algos.ADVANTAGE_ESTIMATORS``: GRPO, RLOO,
REINFORCE++, ...) or the per-turn returns of multi-turn rollouts, DAPO's overlong shaping, the batch's
metrics; each sequence's advantage is broadcast over its trained tokens.

Samples whose reward returned None (``reward/skipped``: TRL's "skip this sample") are left out of
the advantage's statistics and train nothing. A batch whose reward calls failed for more than
``rollout_worker.max_reward_error_frac`` of its samples stops the run (``RewardErrorRateExceeded``,
with the first failure's traceback): a reward that cannot score is a broken run, not a zero reward."""

from __future__ import annotations

from typing import Any

import torch

from nexrl_hpc.algorithm.base import BaseAlgorithmProcessor
from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.algorithm.core_algos import group_index, outcome_advantages, stepwise_grpo_advantages
from nexrl_hpc.algorithm.gae import last_token_rewards
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.data.loader import task_key
from nexrl_hpc.rewards.loader import SKIPPED
from nexrl_hpc.rewards.runner import ERRORS
from nexrl_hpc.tracking.timing import rollout_intervals
from nexrl_hpc.types import Batch


class RewardErrorRateExceeded(RuntimeError):
    """Too many of a training batch's reward calls failed: the run stops with the first error."""


class AdvantageProcessor(BaseAlgorithmProcessor):
    """The ``algorithm_processor`` role (``algorithm.type=grpo``): advantages by the configured estimator."""

    def __init__(self, config: RLTrainConfig, pad_token_id: int):
        super().__init__(config)
        algo = config["algorithm"]
        self._norm_by_std = algo["norm_adv_by_std"]
        self._epsilon = algo["adv_epsilon"]
        self._per_step = algo["advantage_granularity"] == "step"
        self._estimator = algo["adv_estimator"]
        # the pool releases groups keyed on every key of key_list: the baseline groups the same way
        self._group_keys = list(config["trajectory_pool"]["key_list"] or ["group_id"])
        self._pad_token_id = pad_token_id
        self._overlong = algo["overlong"]
        self._max_response_length = config["rollout_worker"]["max_response_length"]
        self._max_reward_error_frac = config["rollout_worker"]["max_reward_error_frac"]

    def compute(self, batch: Batch[list[Any]]) -> Batch[torch.Tensor]:
        """The training batch for ``batch`` of trajectories (exposed for tests and benchmarks)."""
        check_reward_errors(batch, self._max_reward_error_frac)
        rewards = torch.tensor([float(r) for r in batch.values["reward"]], dtype=torch.float32)
        scored = ~skipped_rows(batch)
        groups = group_index(release_groups(batch, self._group_keys))
        tensors = pack_trajectories(batch, self._pad_token_id)
        mask = tensors["response_mask"]
        resp_len = mask.sum(-1)  # the model's tokens of each response, as generated
        penalty = overlong_penalty(
            resp_len,
            self._max_response_length,
            self._overlong["buffer_len"],
            self._overlong["penalty_factor"],
        )
        task_rewards, rewards = rewards, rewards - penalty
        cut_off = torch.tensor(
            [reason == "length" for reason in batch.values.get("finish_reason") or [None] * len(batch)]
        )
        if self._per_step:
            token_adv, adv_stats = stepwise_grpo_advantages(
                _column(batch, "step_returns"),
                _column(batch, "step_spans"),
                groups,
                mask.shape[1],
                self._norm_by_std,
                self._epsilon,
            )
            tensors["advantages"] = token_adv * mask
            adv = (token_adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # per-row mean, for metrics
        else:
            adv, adv_stats = self._outcome_advantages(rewards, groups, mask, scored)
            tensors["advantages"] = adv[:, None] * mask
        trains_nothing = cut_off if self._overlong["filter"] else torch.zeros_like(cut_off)
        trains_nothing = trains_nothing | ~scored  # cut-off (overlong filter) and skipped responses
        if bool(trains_nothing.any()):
            tensors["response_mask"] = mask = mask * (~trains_nothing)[:, None].to(mask.dtype)
            tensors["advantages"] = tensors["advantages"] * mask
        if self._estimator == "gae":  # PPO: the trainer side makes token advantages from these and the critic
            tensors["token_level_rewards"] = last_token_rewards(rewards, mask)
        tensors["rewards"] = task_rewards  # as scored (the advantages saw the overlong penalty too)
        tensors["group_index"] = groups  # rows whose advantages were computed together
        versions = [
            v if v is not None else -1 for v in batch.values.get("weight_version", [None] * len(batch))
        ]
        tensors["weight_version"] = torch.tensor(versions, dtype=torch.long)
        shown = task_rewards[scored] if bool(scored.any()) else task_rewards  # skipped rewards are no score
        metrics = {
            "train/reward_mean": float(shown.mean()),
            "train/reward_std": float(shown.std()) if len(shown) > 1 else 0.0,
            "train/reward_max": float(shown.max()),
            "train/reward_min": float(shown.min()),
            "train/advantage_mean": float(adv.mean()),
            "train/advantage_abs_mean": float(adv.abs().mean()),
            "train/response_length_mean": float(resp_len.float().mean()),
            "train/response_length_max": float(resp_len.max()),
            "train/response_length_min": float(resp_len.min()),
            "perf/generated_tokens": float(resp_len.sum()),
            # responses cut off by max_response_length (the engine's finish_reason "length")
            "train/response_clip_ratio": _clip_ratio(batch.values.get("finish_reason")),
            "train/num_groups": int(groups.max()) + 1,
            "train/zero_std_group_frac": adv_stats["zero_std_group_frac"],
        }
        if self._overlong["buffer_len"]:
            metrics["train/overlong_penalty_mean"] = float(penalty.mean())
        if self._overlong["filter"]:
            metrics["train/overlong_filtered"] = int(cut_off.sum())
        if "filtered_groups" in batch.metadata:  # the pool's dynamic sampling
            metrics["train/filtered_groups"] = batch.metadata["filtered_groups"]
            metrics["train/filtered_groups_kept"] = batch.metadata.get("filtered_groups_kept", 0)
        metrics.update(score_means(batch.values.get("scores"), "train/"))
        metadata = batch.metadata.copy()
        metadata["metrics"] = metrics
        metadata["global_token_num"] = int(tensors["attention_mask"].sum())
        metadata["uid"] = list(batch.values.get("uid", []))
        metadata["epoch"] = list(batch.values.get("epoch", []))
        metadata["task_keys"] = [task_key(row) for row in _task_fields(batch)]
        # when the batch was generated and scored (the trainer's step-time breakdown)
        metadata["rollout_intervals"] = rollout_intervals(batch.values.get("rollout_times") or [])
        return Batch(values=tensors, metadata=metadata)

    def _fit(self, batch: Batch[list[Any]]) -> None:
        self._put_batch(self.compute(batch))

    def _outcome_advantages(
        self, rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, scored: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The estimator's advantages over the scored rows only (skipped rows: 0, in no statistic)."""
        if bool(scored.all()):
            return outcome_advantages(
                self._estimator, rewards, groups, mask, self._norm_by_std, self._epsilon
            )
        adv = torch.zeros(rewards.shape, dtype=torch.float32)
        if not bool(scored.any()):
            return adv, {"zero_std_group_frac": 0.0}
        kept, stats = outcome_advantages(
            self._estimator,
            rewards[scored],
            group_index(groups[scored].tolist()),
            mask[scored],
            self._norm_by_std,
            self._epsilon,
        )
        adv[scored] = kept.to(torch.float32)
        return adv, stats


def skipped_rows(batch: Batch[list[Any]]) -> torch.Tensor:
    """Rows whose reward returned None (``reward/skipped``): they train nothing."""
    scores = batch.values.get("scores") or [None] * len(batch)
    return torch.tensor([bool((row or {}).get(SKIPPED)) for row in scores], dtype=torch.bool)


def check_reward_errors(batch: Batch[list[Any]], max_frac: float) -> None:
    """Raise ``RewardErrorRateExceeded`` when more than ``max_frac`` of the batch's samples have a
    failed reward call (``reward/errors``), with the first failure's traceback the worker attached."""
    scores = batch.values.get("scores") or [None] * len(batch)
    failed = sum(bool((row or {}).get(ERRORS)) for row in scores)
    if not failed or failed <= max_frac * len(batch):
        return
    first = next((e for e in batch.values.get("reward_error") or [] if e), None)
    raise RewardErrorRateExceeded(
        f"the reward function failed for {failed} of the {len(batch)} samples of a training batch "
        f"(more than rollout_worker.max_reward_error_frac={max_frac}); the first error: "
        f"{first or 'not recorded (see the reward warnings in train.log)'}"
    )


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to ``max_length - buffer_len`` tokens, then
    linear down to ``-penalty_factor`` at ``max_length`` (returned as the positive amount to subtract);
    ``buffer_len`` 0: none."""
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.to(torch.float32) - (max_length - buffer_len)).clamp(min=0.0)
    return excess / buffer_len * penalty_factor


def release_groups(batch: Batch[list[Any]], keys: list[str]) -> list[Any]:
    """Each row's group: the tuple of its ``keys`` values (hierarchical key_list: the leaf the pool
    released, not the first key's subtree). A batch without one of the keys: every row alone."""
    columns = [batch.values.get(k) for k in keys]
    present = [c for c in columns if c is not None]
    if len(present) < len(columns):
        return list(range(len(batch)))
    return list(zip(*present))


def score_means(scores: list[dict[str, float] | None] | None, prefix: str) -> dict[str, float]:
    """Each numeric ``scores`` entry (per-episode numbers a rollout worker attached: accuracy,
    turns, tool calls, termination reasons) averaged over the trajectories that carry it; the
    counts (the reward runner's ``reward/errors``, ``reward/timeouts``, the rollout worker's
    ``rollout/undecodable_tokens``) summed, unprefixed."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    for row in scores or []:
        for key, value in (row or {}).items():
            if key == "reward" or not isinstance(value, (int, float)):
                continue  # reward has its own metrics
            if key.startswith(("reward/", "rollout/")):
                totals[key] = totals.get(key, 0.0) + float(value)
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    means = {f"{prefix}{key}": sums[key] / counts[key] for key in sorted(sums)}
    return {**means, **{key: int(totals[key]) for key in sorted(totals)}}


def _clip_ratio(finish_reasons: list[str | None] | None) -> float:
    if not finish_reasons:
        return 0.0
    return sum(reason == "length" for reason in finish_reasons) / len(finish_reasons)


def _column(batch: Batch[list[Any]], name: str) -> list[Any]:
    """A per-trajectory field the step-wise advantage needs; agent rollouts carry it."""
    values = batch.values.get(name)
    if values is None or any(v is None for v in values):
        raise ValueError(
            f"algorithm.advantage_granularity=step needs {name!r} on every trajectory "
            "(rollout_worker.type=agent puts it)"
        )
    return list(values)


def _task_fields(batch: Batch[list[Any]]) -> list[dict[str, Any]]:
    """Per row, the task fields that identify it (see data.loader.task_key)."""
    columns = {k: batch.values[k] for k in ("group_id", "uid", "sample_index") if k in batch.values}
    return [{k: col[i] for k, col in columns.items() if col[i] is not None} for i in range(len(batch))]
