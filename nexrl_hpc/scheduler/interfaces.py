"""What the other modules call on the rollout scheduler: the seam between it and its peers.

Peers hold it as a module reference (the scheduler itself in local mode, a handle to it on another
rank) and call it through ``execute``; typed as this Protocol, mypy checks every call, and the
controller's wiring checks ``RolloutScheduler`` against it. Imports only lower floors (types).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from nexrl_hpc.types import DEFAULT_MODEL_TAG, ModelTag, RolloutServiceStatus

if TYPE_CHECKING:
    from nexrl_hpc.weight_sync.verify import CanaryReference


class RolloutSchedulerRef(Protocol):
    # --- rollout workers and inference clients: may a rollout start, which weights serve ---------
    def check_rollout_service_status(
        self, model_tag: ModelTag = DEFAULT_MODEL_TAG
    ) -> RolloutServiceStatus: ...

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int: ...

    # --- the trajectory pool: a batch is complete, a filtered group's tasks need replacing --------
    def on_batch_ready(self, model_tag: ModelTag) -> bool: ...

    def replace_filtered_tasks(self, count: int) -> None: ...

    # --- the train worker: new weights exported, a batch dropped, validation time ----------------
    def train_worker_notify_weight_update(
        self,
        worker_name: str,
        model_tag: ModelTag,
        version: int | None = None,
        canary: CanaryReference | None = None,
    ) -> None: ...

    def trainer_dropped_batch(self, model_tag: ModelTag) -> None: ...

    def validation_intervals(self, since: float) -> list[tuple[float, float]]: ...
