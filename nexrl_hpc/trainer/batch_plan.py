"""How a training batch is split over a trainer group's ranks (``plan_batch``).

Every mini-batch (for ``compute_log_prob`` the whole batch is one) is cut into contiguous per-rank
slices; a rank's shard is its slices one after another. The plan, the same for every rank, holds
what a rank cannot see from its shard: each mini-batch's rows per rank, its global loss
normaliser, the number of forward/backward passes (equal on all ranks so that the collectives line
up), each rank's micro-batches as bins of rows, and whether they share prompts
(``actor.share_prompt``; ``auto`` plans both layouts and keeps the one estimated cheaper). Rank 0
of a trainer group calls this and scatters.
"""

from __future__ import annotations

from typing import Any

import torch

from nexrl_hpc.config.train_service_schema import ActorConfig
from nexrl_hpc.trainer.batch_contract import REQUIRED_KEYS, check_training_batch
from nexrl_hpc.trainer.packing import (
    attention_kind,
    forward_costs,
    hf_config,
    plan_cost,
    plan_micro_batches,
    plan_shared_prompt_micro_batches,
    prompt_keys_and_lengths,
    shared_prompt_width,
)
from nexrl_hpc.trainer.parallel import dp_slices
from nexrl_hpc.trainer.sequence_parallel import ATTENTION_PREFIX

Layout = list[list[list[list[list[int]]]]]  # per mini-batch, per rank: its micro-batches (bins of rows)


def plan_batch(
    operation: str,
    tensors: dict[str, Any],
    actor: ActorConfig,
    world: int,
    model: Any,
    sequence_parallel: int = 1,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(plan, one shard per rank) of a whole batch for ``operation`` on ``world`` ranks. With
    ``sequence_parallel`` = P > 1 the batch is planned for world / P data-parallel ranks and each
    plan entry and shard goes to the P consecutive ranks that split its sequences."""
    plan, shards = _plan_data_parallel(operation, tensors, actor, world // sequence_parallel, model)
    plan["sequence_parallel"] = sequence_parallel
    if sequence_parallel == 1:
        return plan, shards
    for key in ("counts", "micro"):  # per mini-batch, per rank
        plan[key] = [
            [entry for entry in per_rank for _ in range(sequence_parallel)] for per_rank in plan[key]
        ]
    return plan, [shard for shard in shards for _ in range(sequence_parallel)]


def data_parallel_rows(rows: torch.Tensor, counts: list[int], sequence_parallel: int) -> torch.Tensor:
    """Rows gathered from every rank (``counts`` each, rank order) without the copies the other
    ranks of each sequence-parallel group hold."""
    if sequence_parallel == 1:
        return rows
    parts = rows.split(counts)
    return torch.cat([part for r, part in enumerate(parts) if r % sequence_parallel == 0])


def _plan_data_parallel(
    operation: str, tensors: dict[str, Any], actor: ActorConfig, world: int, model: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n, bounds = _mini_batches(operation, tensors, actor)
    parts = [(m_start, m_end, dp_slices(m_end - m_start, world)) for m_start, m_end in bounds]
    planner = _MicroBatchPlanner(tensors, actor, parts)
    setting = actor["share_prompt"]
    kind = attention_kind(model)  # sequence parallelism takes no custom mask: auto never shares
    if setting == "auto" and kind != "flash_attention_2" and not kind.startswith(ATTENTION_PREFIX):
        options = {shared: planner.plan_all(shared) for shared in (True, False)}
        shared_prompts = planner.cost(True, options[True], model) < planner.cost(False, options[False], model)
        planned = options[shared_prompts]
    else:
        shared_prompts = setting is True
        planned = planner.plan_all(shared_prompts)

    counts, normalizers, passes, micro = [], [], [], []
    rows: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for (m_start, m_end, slices), per_rank in zip(parts, planned):
        counts.append([hi - lo for lo, hi in slices])
        micro.append(per_rank)  # each rank's micro-batches (bins of rows of its slice)
        passes.append(max(1, max(len(batches) for batches in per_rank)))  # every rank runs as many
        normalizers.append(_normalizer(tensors["response_mask"][m_start:m_end], m_end - m_start, actor))
        for r, (lo, hi) in enumerate(slices):
            rows[r].append((m_start + lo, m_start + hi))
    plan = {
        "operation": operation,
        "rows": n,
        "counts": counts,
        "normalizers": normalizers,
        "passes": passes,
        "micro": micro,
        "shared_prompts": shared_prompts,
    }
    return plan, _shards(tensors, rows)


def _mini_batches(
    operation: str, tensors: dict[str, Any], actor: ActorConfig
) -> tuple[int, list[tuple[int, int]]]:
    """(rows of the checked batch, each mini-batch's [start, end)); ``compute_log_prob``: one."""
    if operation == "compute_log_prob":
        n = check_training_batch(tensors, REQUIRED_KEYS)
        return n, [(0, n)]
    if operation == "update_actor":
        n = check_training_batch(tensors, REQUIRED_KEYS + ("old_log_probs", "advantages"))
        mini = min(actor["ppo_mini_batch_size"], n)
        return n, [(m, min(m + mini, n)) for m in range(0, n, mini)]
    raise ValueError(f"no batch plan for operation {operation!r}")


def _normalizer(mask: torch.Tensor, rows: int, actor: ActorConfig) -> float:
    """A mini-batch's global loss normaliser (``actor.loss_agg_mode``)."""
    agg = actor["loss_agg_mode"]
    if agg == "token-mean":
        return float(mask.sum().clamp(min=1.0))
    if agg == "seq-mean-token-sum-norm":
        return float(rows) * actor["loss_norm_tokens"]
    return float(rows)


def _shards(tensors: dict[str, Any], rows: list[list[tuple[int, int]]]) -> list[dict[str, Any]]:
    """Each rank's tensors: its slices' rows, one after another."""
    shards = []
    for rank_rows in rows:
        index = torch.cat([torch.arange(lo, hi) for lo, hi in rank_rows])
        if index.numel() == 0:  # no real rows: one stand-in row for the zero-weighted passes
            index = torch.zeros(1, dtype=torch.long)
        shards.append(
            {k: v.index_select(0, index) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        )
    return shards


class _MicroBatchPlanner:
    """Each rank's micro-batches of each mini-batch, with shared prompts or without, and their cost."""

    def __init__(
        self, tensors: dict[str, Any], actor: ActorConfig, parts: list[tuple[int, int, list[tuple[int, int]]]]
    ) -> None:
        self.tensors = tensors
        self.actor = actor
        self.parts = parts
        self.lengths = tensors["attention_mask"].sum(-1).tolist()  # real tokens per row
        self.keys, self.prompt_lengths = (
            prompt_keys_and_lengths(tensors) if actor["share_prompt"] else ([], [])
        )

    def plan_slice(self, a: int, b: int, shared: bool) -> list[list[list[int]]]:
        """The micro-batches (bins of rows) of the rows [a, b) of one rank's slice."""
        actor = self.actor
        if shared:
            return plan_shared_prompt_micro_batches(
                self.keys[a:b],
                self.prompt_lengths[a:b],
                self.lengths[a:b],
                actor["ppo_micro_batch_size"],
                actor["ppo_max_token_len_per_gpu"],
            )
        return plan_micro_batches(
            self.lengths[a:b],
            actor["ppo_micro_batch_size"],
            actor["ppo_max_token_len_per_gpu"],
            actor["packing"],
        )

    def plan_all(self, shared: bool) -> Layout:
        """Per mini-batch, per rank: its micro-batches."""
        return [[self.plan_slice(m + lo, m + hi, shared) for lo, hi in slices] for m, _, slices in self.parts]

    def cost(self, shared: bool, planned: Layout, model: Any) -> float:
        """The estimated forward cost of a layout (``trainer.packing.plan_cost``)."""
        width = int(self.tensors["input_ids"].shape[1])  # a padded row is as wide as the batch
        lengths = self.lengths

        def bin_width(rows: list[int]) -> int:
            if shared:
                return shared_prompt_width(rows, self.keys, self.prompt_lengths, lengths)
            return sum(lengths[i] for i in rows) if self.actor["packing"] else width

        widths = [
            [bin_width([m + lo + i for i in b]) for b in batch]
            for (m, _, slices), per_rank in zip(self.parts, planned)
            for (lo, _), batches in zip(slices, per_rank)
            for batch in batches
        ]
        return plan_cost(widths, *forward_costs(hf_config(model)))
