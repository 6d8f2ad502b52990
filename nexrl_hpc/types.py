"""Core data types shared by every module (seed 000, nexrl_types)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

ModelTag = str
"""Identifies one model (policy, teacher, ...) inside a run."""

Trajectory = dict[str, Any]
"""One rollout: token ids as the engine produced them, behaviour logprobs, loss mask, scores, version."""

DEFAULT_MODEL_TAG: ModelTag = "default"


class NexRLRole(Enum):
    """Roles a process can host; placement maps them to colocation groups and ranks."""

    ROLLOUT_WORKER = "rollout_worker"
    TRAIN_WORKER = "train_worker"
    ALGORITHM_PROCESSOR = "algorithm_processor"
    TRAJECTORY_POOL = "trajectory_pool"
    TRAIN_BATCH_POOL = "train_batch_pool"
    WEIGHT_SYNC_CONTROLLER = "weight_sync_controller"
    DATA_LOADER = "data_loader"
    VALIDATE_DATALOADER = "validate_dataloader"
    VALIDATOR = "validator"
    INFERENCE_SERVICE = "inference_service"  # the engine a rollout worker talks to (started on its rank)


@dataclass
class Batch:
    """Columnar batch: every entry of ``values`` has ``metadata['batch_size']`` rows."""

    values: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "batch_size" not in self.metadata:
            sizes = {len(v) for v in self.values.values()}
            if len(sizes) > 1:
                raise ValueError(
                    f"Batch values have different lengths: { {k: len(v) for k, v in self.values.items()} }"
                )
            self.metadata["batch_size"] = sizes.pop() if sizes else 0

    def __len__(self) -> int:
        return int(self.metadata["batch_size"])

    def copy(self) -> Batch:
        return Batch(values=copy.deepcopy(self.values), metadata=copy.deepcopy(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        """Values and metadata in one dict; metadata keys win on a clash."""
        out = dict(self.values)
        out.update(self.metadata)
        return out

    @staticmethod
    def from_trajectories(trajectories: list[Trajectory], metadata: dict[str, Any] | None = None) -> Batch:
        """Column-stack trajectories (keys missing from some trajectories become None)."""
        keys: dict[str, None] = {}
        for traj in trajectories:
            keys.update(dict.fromkeys(traj))
        values = {k: [t.get(k) for t in trajectories] for k in keys}
        meta = dict(metadata or {})
        meta["batch_size"] = len(trajectories)
        return Batch(values=values, metadata=meta)

    def to_trajectories(self) -> list[Trajectory]:
        n = len(self)
        return [{k: v[i] for k, v in self.values.items()} for i in range(n)]

    @staticmethod
    def remove_redundant_left_padding(
        data: Batch,
        pad_token_id: int,
        fields: list[str],
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch:
        """Drop leading columns that are padding in every row of ``anchor_field``."""
        return Batch._strip_padding(data, pad_token_id, fields, anchor_field, max_strip_threshold, left=True)

    @staticmethod
    def remove_redundant_right_padding(
        data: Batch,
        pad_token_id: int,
        fields: list[str],
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch:
        """Drop trailing columns that are padding in every row of ``anchor_field``."""
        return Batch._strip_padding(data, pad_token_id, fields, anchor_field, max_strip_threshold, left=False)

    @staticmethod
    def _strip_padding(
        data: Batch,
        pad_token_id: int,
        fields: list[str],
        anchor_field: str,
        max_strip: int | None,
        left: bool,
    ) -> Batch:
        anchor = data.values[anchor_field]
        non_pad = (anchor != pad_token_id).any(dim=0).nonzero()
        width = anchor.shape[1]
        if not len(non_pad):
            return data
        strip = int(non_pad[0]) if left else width - (int(non_pad[-1]) + 1)
        if max_strip is not None:
            strip = min(strip, max_strip)
        if strip == 0:
            return data
        values = dict(data.values)
        for name in fields:
            values[name] = values[name][:, strip:] if left else values[name][:, : width - strip]
        return Batch(values=values, metadata=dict(data.metadata))

    def to_nextrainer_batch(self) -> dict[str, Any]:
        """Seed 002's wire shape: tensors under ``batch``, the rest under ``non_tensor_batch``/``meta_info``."""
        tensors = {k: v for k, v in self.values.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in self.values.items() if not isinstance(v, torch.Tensor)}
        return {"batch": tensors, "non_tensor_batch": others, "meta_info": dict(self.metadata)}
