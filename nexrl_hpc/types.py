"""Core data types shared by every module: model tags, trajectories, batches, process roles and the
statuses modules answer each other with.

``Trajectory`` and ``BatchMetadata`` are TypedDicts: at run time they are plain dicts, which is what
crosses the wire (the codec sees dicts, lists and numbers, never these classes).
"""

from __future__ import annotations

import copy
from collections.abc import Sized
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, cast

if TYPE_CHECKING:
    import torch  # imported where tensors are handled: the config's checks use these types without it

from nexrl_hpc.config.enums import StrEnum

ModelTag = str
"""Identifies one model (policy, teacher, ...) inside a run."""


class PutStatus(StrEnum):
    """What a destination answers to ``put_trajectory`` (and a rollout step returns). A member equals
    its string, so rollout steps written against the strings keep working."""

    SUCCESS = "success"  # accepted
    FAIL = "fail"  # refused (the store is full or closed): the sample is dropped
    RE_ROLLOUT = "re-rollout"  # weights of its model are syncing: the task goes back to its loader


class RolloutServiceStatus(StrEnum):
    """Whether a rollout may start now (``check_rollout_service_status``)."""

    CONTINUE = "continue"
    BLOCK = "block"  # sync mode: the model's weights are being synced


class TaskFields(TypedDict, total=False):
    """What the data loader puts on a task: a dataset row (its own columns too) plus where it came from."""

    prompt: str
    uid: str  # the row's stable id
    epoch: int
    sample_index: int  # which of the row's rollout_repeat_n repeats
    group_id: str  # "<uid>@<epoch>": one GRPO group (the pool's default key)


class RolloutFields(TypedDict):
    """What every rollout worker adds to the task: the engine's token ids and logprobs, the loss mask,
    the weight version. Per-token lists are aligned with ``response_ids``."""

    model_tag: ModelTag
    response: str  # the response text (for reading and reward parsing; never re-tokenised)
    finish_reason: str | None
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_log_probs: list[float]  # the server's logprob of each response token
    loss_mask: list[int]  # 1: a model token that trains; 0: environment / tool text
    weight_version: int | None  # the policy version that sampled it (the oldest one, for several turns)


class Trajectory(TaskFields, RolloutFields, total=False):
    """One rollout: the task's fields, the rollout's, and its scores.

    A trajectory starts as a copy of its task (``BaseRolloutWorker.make_trajectory``,
    ``AgentRolloutWorker.episode_to_trajectory``), so the dataset row's own columns (an answer, a
    reference, ...) ride along under their own names; only the fields the framework reads are
    declared here.
    """

    reward: float
    scores: dict[str, float]  # reward and the other per-trajectory numbers averaged as metrics
    # multi-turn (agent) rollouts: why the episode ended, per-turn rewards, returns and spans
    termination_reason: str | None
    step_rewards: list[float]
    step_returns: list[float]
    token_rewards: list[float]
    step_spans: list[list[int]]  # [start, end) of turn k's completion in response_ids
    rollout_times: list[float]  # wall clock: [started, generated, scored] (the step-time breakdown)
    reward_error: str | None  # the reward call failed: the run's first reward error (function, traceback)


class BatchMetadata(TypedDict, total=False):
    """What a ``Batch`` carries besides its columns."""

    batch_size: int  # rows in every entry of ``values``
    model_tag: ModelTag
    metrics: dict[str, float]  # the algorithm's metrics of this batch (train/...)
    global_token_num: int  # attention-mask tokens of the whole batch
    # per row, for tracing and exactly-once bookkeeping (train batches)
    uid: list[str]
    epoch: list[int]
    task_keys: list[str]  # data.loader.task_key of each row
    # the pool's dynamic sampling since the previous batch: zero-variance groups dropped (and
    # replaced), and kept after all (the refill cap was reached)
    filtered_groups: int
    filtered_groups_kept: int
    # wall-clock intervals when the batch's trajectories were generated / scored (merged)
    rollout_intervals: dict[str, list[tuple[float, float]]]


V = TypeVar("V", bound=Sized)
"""The column type of a Batch: ``list[Any]`` for trajectory columns, ``torch.Tensor`` for training tensors."""

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
    REWARD_SERVICE = "reward_service"  # a model reward on ranks of its own (reward_model.placement=own_ranks)


@dataclass
class Batch(Generic[V]):
    """Columnar batch: every entry of ``values`` has ``metadata['batch_size']`` rows.

    The trajectory pool hands out ``Batch[list[Any]]`` (one list per trajectory field); the
    algorithm turns it into the ``Batch[torch.Tensor]`` the trainer consumes.
    """

    values: dict[str, V]
    metadata: BatchMetadata = field(default_factory=BatchMetadata)

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

    def copy(self) -> Batch[V]:
        return Batch(values=copy.deepcopy(self.values), metadata=copy.deepcopy(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        """Values and metadata in one dict; metadata keys win on a clash."""
        out: dict[str, Any] = dict(self.values)
        out.update(self.metadata)
        return out

    @staticmethod
    def from_trajectories(
        trajectories: list[Trajectory], metadata: BatchMetadata | None = None
    ) -> Batch[list[Any]]:
        """Column-stack trajectories (keys missing from some trajectories become None)."""
        keys: dict[str, None] = {}
        for traj in trajectories:
            keys.update(dict.fromkeys(traj))
        values: dict[str, list[Any]] = {k: [t.get(k) for t in trajectories] for k in keys}
        meta = metadata.copy() if metadata else BatchMetadata()
        meta["batch_size"] = len(trajectories)
        return Batch(values=values, metadata=meta)

    def to_trajectories(self: Batch[list[Any]]) -> list[Trajectory]:
        """The rows of a trajectory batch (``from_trajectories`` inverted; missing fields come back None)."""
        n = len(self)
        return [cast(Trajectory, {k: v[i] for k, v in self.values.items()}) for i in range(n)]

    @staticmethod
    def remove_redundant_left_padding(
        data: Batch[torch.Tensor],
        pad_token_id: int,
        fields: list[str],
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch[torch.Tensor]:
        """Drop leading columns that are padding in every row of ``anchor_field``."""
        return Batch._strip_padding(data, pad_token_id, fields, anchor_field, max_strip_threshold, left=True)

    @staticmethod
    def remove_redundant_right_padding(
        data: Batch[torch.Tensor],
        pad_token_id: int,
        fields: list[str],
        anchor_field: str = "input_ids",
        max_strip_threshold: int | None = None,
    ) -> Batch[torch.Tensor]:
        """Drop trailing columns that are padding in every row of ``anchor_field``."""
        return Batch._strip_padding(data, pad_token_id, fields, anchor_field, max_strip_threshold, left=False)

    @staticmethod
    def _strip_padding(
        data: Batch[torch.Tensor],
        pad_token_id: int,
        fields: list[str],
        anchor_field: str,
        max_strip: int | None,
        left: bool,
    ) -> Batch[torch.Tensor]:
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
        return Batch(values=values, metadata=data.metadata.copy())
