"""TrajectoryPool: one TrajectoryPoolInstance per model tag, each with its own store and batch rule.

The pool stores and batches; admission is the rollout scheduler's (scheduler/): the pool tells it
when a batch is complete (and, sync mode, refuses further trajectories until it reopens them) and
asks it for fresh tasks in place of the groups dynamic sampling drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nexrl_hpc.config.imports import load_object
from nexrl_hpc.config.schema import FilterGroupsConfig, RLTrainConfig, TrajectoryPoolConfig
from nexrl_hpc.core.activity import ActivityTrackerProxy
from nexrl_hpc.core.execute import execute, long_poll
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.data.loader import task_key
from nexrl_hpc.pool.stores import TrajectoryStore, create_store
from nexrl_hpc.types import DEFAULT_MODEL_TAG, Batch, BatchMetadata, ModelTag, PutStatus, Trajectory

if TYPE_CHECKING:
    from nexrl_hpc.data.interfaces import DataLoaderRef
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef

logger = logging.getLogger(__name__)

BUILTIN_READY_RULES = ("batch_size", "loaded_batch_finished")


class TrajectoryPoolInstance:
    """Trajectories of one model; refuses additions from a complete batch until the scheduler reopens it."""

    def __init__(
        self,
        model_tag: ModelTag,
        config: TrajectoryPoolConfig,
        on_ready: Callable[[], None] | None = None,
        filter_groups: FilterGroupsConfig | None = None,
    ):
        """``filter_groups`` (DAPO's dynamic sampling): a complete group whose rewards are all equal
        teaches nothing (every advantage is 0); it is dropped, its tasks count as consumed, and as
        many fresh tasks go out in its place, so the batch fills with groups that carry a signal."""
        self.model_tag = model_tag
        self._on_ready = on_ready
        self._batch_size = config["batch_size"]
        self._filtering = filter_groups is not None and filter_groups["enable"]
        self._store: TrajectoryStore = create_store(
            config["key_list"],
            config["group_size"],
            keep_group=_has_reward_spread if self._filtering else None,
        )
        # refills allowed per training batch (past them, zero-variance groups are kept); None: no limit
        self._refill_cap: int | None = None
        if filter_groups is not None and filter_groups["max_num_gen_batches"] > 0:
            self._refill_cap = (filter_groups["max_num_gen_batches"] - 1) * self._batch_size
        self._refilled = 0  # tasks handed out again for filtered groups since the last batch
        self._filtered_groups = 0  # since the last batch
        self._kept_over_cap = 0  # zero-variance groups kept since the last batch (refill cap reached)
        rule = config["check_batch_ready_function"]
        self._rule_name = rule
        self._custom_rule: Callable[..., bool] | None = (
            None if rule in BUILTIN_READY_RULES else load_object(rule)
        )
        self._lock = threading.Lock()
        self._refusing = False  # sync mode: from "batch ready" until the scheduler's next release
        self._notified_ready = False
        # module references (the module itself in local mode, a handle with its methods elsewhere)
        self._dataloader: DataLoaderRef | None = None
        self._scheduler: RolloutSchedulerRef | None = None
        self._activity_tracker: ActivityTrackerProxy | None = None
        self._seen: dict[
            int, set[str]
        ] = {}  # epoch -> sample keys accepted (a re-issued task is not trained twice)
        self.duplicates = 0

    def set_module_references(
        self,
        dataloader: DataLoaderRef | None,
        scheduler: RolloutSchedulerRef | None,
        activity_tracker: ActivityTrackerProxy | None,
    ) -> None:
        self._dataloader = dataloader
        self._scheduler = scheduler
        self._activity_tracker = activity_tracker

    def put_trajectory(self, trajectory: Trajectory) -> PutStatus:
        with self._lock:
            if self._refusing:
                return PutStatus.RE_ROLLOUT
            key = self._sample_key(trajectory)
            if key is not None:
                epoch, sample = key
                seen = self._seen.setdefault(epoch, set())
                if sample in seen:
                    self.duplicates += 1  # the task was re-issued after its first result already arrived
                    return PutStatus.SUCCESS
            result = self._store.add(trajectory)
            if key is not None and result == PutStatus.SUCCESS:
                seen.add(sample)
                for old in [e for e in self._seen if e < epoch - 1]:
                    del self._seen[old]
            filtered = self._store.pop_filtered()
            refill: list[str] = []
            for group in filtered:
                if self._refill_cap is not None and self._refilled + len(group) > self._refill_cap:
                    self._store.release_group(group)  # no more refills for this batch: train on it
                    self._kept_over_cap += 1
                    continue
                self._filtered_groups += 1
                self._refilled += len(group)
                refill.extend(task_key(dict(t)) for t in group)
            ready_now = (
                self._rule_name == "batch_size"
                and not self._notified_ready
                and self._store.num_ready() >= self._batch_size
            )
            if ready_now:
                self._notified_ready = True
        if refill:
            self._refill(refill)
        if ready_now:
            self._notify_ready()
        return result

    def _refill(self, keys: list[str]) -> None:
        """Filtered groups: their tasks are consumed (never handed out again, a resume included) and
        the scheduler lets as many fresh tasks go out in their place."""
        if self._dataloader is None:
            return
        execute(self._dataloader.release_items, keys)
        if self._scheduler is not None:
            execute(self._scheduler.replace_filtered_tasks, len(keys))

    @staticmethod
    def _sample_key(trajectory: Trajectory) -> tuple[int, str] | None:
        if "uid" not in trajectory or "epoch" not in trajectory or "sample_index" not in trajectory:
            return None
        return int(trajectory["epoch"]), f"{trajectory['uid']}#{trajectory['sample_index']}"

    def _notify_ready(self) -> None:
        if self._on_ready is not None:
            self._on_ready()
        if self._scheduler is not None and execute(self._scheduler.on_batch_ready, self.model_tag):
            self.refuse_trajectories()

    def is_batch_ready(self) -> bool:
        with self._lock:
            ready = self._store.num_ready()
            pending = self._store.num_pending()
        if ready == 0:
            return False
        if self._rule_name == "batch_size":
            return ready >= self._batch_size
        if self._rule_name == "loaded_batch_finished":
            return self._loaded_batch_finished(pending)
        assert self._custom_rule is not None
        return bool(self._custom_rule(num_ready=ready, num_pending=pending, batch_size=self._batch_size))

    def _loaded_batch_finished(self, pending: int) -> bool:
        """Everything the data loader handed out for this batch has come back."""
        if pending:
            return False
        if self._dataloader is not None and execute(self._dataloader.can_return_item):
            return False
        return self._activity_tracker is None or self._activity_tracker.is_rollout_worker_quiescent()

    def get_batch(self, batch_size: int | None = None) -> Batch | None:
        if not self.is_batch_ready():
            return None
        size = batch_size or self._batch_size
        if self._rule_name == "loaded_batch_finished":
            size = max(size, self.num_ready())
        with self._lock:
            items = self._store.take(size)
            self._notified_ready = False
            metadata: BatchMetadata = {"model_tag": self.model_tag}
            if self._filtering:
                metadata["filtered_groups"] = self._filtered_groups
                metadata["filtered_groups_kept"] = self._kept_over_cap
            if items:
                self._filtered_groups = self._kept_over_cap = self._refilled = 0
        if not items:
            return None
        if self._rule_name != "batch_size":
            self._notify_ready()
        return Batch.from_trajectories(items, metadata=metadata)

    def num_ready(self) -> int:
        with self._lock:
            return self._store.num_ready()

    def is_empty(self) -> bool:
        with self._lock:
            return self._store.is_empty()

    def refuse_trajectories(self) -> None:
        with self._lock:
            self._refusing = True

    def accept_trajectories(self) -> None:
        with self._lock:
            self._refusing = False


class TrajectoryPool(NexRLModule):
    """Routes trajectories to the instance of their ``model_tag`` (default "default")."""

    def __init__(self, config: RLTrainConfig):
        super().__init__()
        self._config = config["trajectory_pool"]
        self._filter_groups = config["algorithm"]["filter_groups"]
        self._instances: dict[ModelTag, TrajectoryPoolInstance] = {}
        self._lock = threading.Lock()
        self._arrivals = threading.Condition()
        self._dataloader: DataLoaderRef | None = None
        self._scheduler: RolloutSchedulerRef | None = None

    def set_module_references(
        self, dataloader: DataLoaderRef | None, scheduler: RolloutSchedulerRef | None
    ) -> None:
        self._dataloader = dataloader
        self._scheduler = scheduler
        with self._lock:
            for instance in self._instances.values():
                instance.set_module_references(dataloader, scheduler, self._activity_tracker)

    def set_activity_tracker(self, tracker: ActivityTrackerProxy) -> None:
        super().set_activity_tracker(tracker)
        with self._lock:
            for instance in self._instances.values():
                instance.set_module_references(self._dataloader, self._scheduler, tracker)

    def _instance(self, model_tag: ModelTag) -> TrajectoryPoolInstance:
        instance = self._instances.get(model_tag)
        if instance is None:
            with self._lock:
                instance = self._instances.get(model_tag)
                if instance is None:
                    instance = TrajectoryPoolInstance(
                        model_tag,
                        self._config,
                        on_ready=self._wake_waiters,
                        filter_groups=self._filter_groups,
                    )
                    instance.set_module_references(self._dataloader, self._scheduler, self._activity_tracker)
                    self._instances[model_tag] = instance
        return instance

    def put_trajectory(self, trajectory: Trajectory) -> PutStatus:
        """SUCCESS | FAIL (the store refused it) | RE_ROLLOUT (sync mode: its model's batch is
        complete and the next one not released yet)."""
        return self._instance(trajectory.get("model_tag") or DEFAULT_MODEL_TAG).put_trajectory(trajectory)

    def _wake_waiters(self) -> None:
        with self._arrivals:
            self._arrivals.notify_all()

    def put_trajectories(self, trajectories: list[Trajectory]) -> list[PutStatus]:
        """``put_trajectory`` for many at once: one round trip when the pool is on another rank."""
        return [self.put_trajectory(t) for t in trajectories]

    def get_batch(self, batch_size: int | None = None, model_tag: ModelTag | None = None) -> Batch | None:
        if model_tag is None:
            return self.get_batch_any(batch_size)
        instance = self._instances.get(model_tag)
        return instance.get_batch(batch_size) if instance is not None else None

    @long_poll
    def get_batch_any(self, batch_size: int | None = None, wait_s: float = 0.0) -> Batch | None:
        """A ready batch of any model; with ``wait_s`` > 0 wait up to that long for one (long poll)."""
        deadline = time.monotonic() + wait_s
        while True:
            for tag in self.get_model_tags():
                batch = self._instances[tag].get_batch(batch_size)
                if batch is not None:
                    return batch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with self._arrivals:
                self._arrivals.wait(remaining)

    def is_empty(self, model_tag: ModelTag | None = None) -> bool:
        if model_tag is not None:
            instance = self._instances.get(model_tag)
            return instance is None or instance.is_empty()
        return all(instance.is_empty() for instance in list(self._instances.values()))

    def get_model_tags(self) -> list[ModelTag]:
        with self._lock:
            return list(self._instances)

    def refuse_trajectories(self, model_tag: ModelTag) -> None:
        """Answer "re-rollout" to every trajectory of ``model_tag`` until ``accept_trajectories``."""
        self._instance(model_tag).refuse_trajectories()

    def accept_trajectories(self, model_tag: ModelTag) -> None:
        """Take trajectories of ``model_tag`` again (the scheduler released its next batch)."""
        self._instance(model_tag).accept_trajectories()


def _has_reward_spread(group: list[Trajectory]) -> bool:
    """Not every reward of the group is the same (a group of one has no spread)."""
    rewards = [float(t.get("reward") or 0.0) for t in group]
    return len(rewards) > 1 and max(rewards) > min(rewards)
