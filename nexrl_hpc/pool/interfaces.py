"""What the other modules call on the pools: the seams between the pools and their peers.

Peers hold module references (the pool itself in local mode, a handle to it on another rank) and
call them through ``execute``; typed as these Protocols, mypy checks every call, and the
controller's wiring checks the concrete pools (and the validator, a trajectory destination too)
against them. Imports only lower floors (types).
"""

from __future__ import annotations

from typing import Protocol

from nexrl_hpc.types import DEFAULT_MODEL_TAG, Batch, ModelTag, PutStatus, Trajectory


class TrajectoryDestination(Protocol):
    """Where a rollout worker puts its trajectories: the trajectory pool, or the validator."""

    def put_trajectory(self, trajectory: Trajectory) -> PutStatus: ...

    def put_trajectories(self, trajectories: list[Trajectory]) -> list[PutStatus]: ...


class TrajectoryPoolRef(TrajectoryDestination, Protocol):
    """The trajectory pool: filled by rollout workers, drained by the algorithm processor, opened
    again by the rollout scheduler when it releases the next batch."""

    def get_batch_any(self, batch_size: int | None = None, wait_s: float = 0.0) -> Batch | None: ...

    def accept_trajectories(self, model_tag: ModelTag) -> None: ...


class TrainBatchPoolRef(Protocol):
    """The train batch pool: filled by the algorithm processor, drained by the train worker."""

    def put_batch(self, batch: Batch) -> bool: ...

    def get_batch(self, model: ModelTag | None = DEFAULT_MODEL_TAG, wait_s: float = 0.0) -> Batch | None: ...
