"""RolloutScheduler: the one owner of admission — when rollouts may start, and when they are held.

It is the only writer of the data loader's dispatch budget (how many fresh tasks may go out) and
the only place that answers "may a rollout run now" (``check_rollout_service_status``, asked by
the rollout workers before they fetch and by the LLM clients before they send). It paces the run
by ``weight.sync_mode``, gates validation, wakes the controller, and calls the weight publisher
(weight_sync/publisher.py: a data mover) when the trainer announces a version. The placement
role that builds it keeps its name, ``weight_sync_controller``.

The run's loops (each its own thread or process; "scheduler" is this module):

| loop | consumes | produces | waits for | unblocked by |
| --- | --- | --- | --- | --- |
| rollout workers | tasks from the data loader (fresh ones while the dispatch budget lasts, returned ones always) | trajectories into the trajectory pool; "re-rollout" answers put the task back | a task (the loader's long poll); "continue" from the scheduler | the scheduler opening budget (start, a new version, a dropped batch, a filtered group's refill); a task coming back; the end of a reload |
| trajectory pool | trajectories | ready batches for the algorithm processor; "batch ready" to the scheduler | — (it answers puts) | sync mode: refuses trajectories from "batch ready" until the scheduler's next release |
| algorithm processor + train batch pool | ready batches | train batches (advantages, ...) | a ready batch (the pool's long poll); room in the train batch pool | the trajectory pool, the train worker taking a batch |
| train worker | train batches | a weight version exported; its announcement (``train_worker_notify_weight_update``); a dropped batch (``trainer_dropped_batch``) | a train batch (long poll); sync mode: its announcement returning | the algorithm processor; the scheduler finishing the publication |
| weight publication (the scheduler, on the announcing thread) | an exported version | every engine serving it (the publisher); ``rollout_version`` bumped; the next batch(es) released | a pending validation to end | the controller's ``end_validate`` |
| validation (the controller) | validation tasks (the validation loader) | ``val/`` metrics of the version it measures | a due validation (``wait_for_progress``), the validator's completion | the scheduler (a new version that is due), the rollout workers |

Pacing: every trajectory records the weight version that produced it; fresh tasks go out one
training batch (``trajectory_pool.batch_size`` tasks) at a time.

- ``sync`` (the default): one batch per policy version. When the batch is complete the pool sends
  stragglers back ("re-rollout"), the trainer updates and exports, the inference service reloads
  (``sync_weight_to_rollout_service``; clients hold new requests meanwhile), the version is bumped
  and the next batch is released — beside a due validation, which measures the same version on the
  same engines.
- ``fully-async``: no request is held for a reload (the local engine swaps weights between two
  forward batches; vLLM pauses itself briefly) and batches are handed out ahead of the trainer:
  batch b goes out once the trainer holds version b - 1 - staleness_threshold. Generation overlaps
  training; the pool is the back-pressure. The trainer does not wait for a publication either: it
  trains the next step while its announcement runs (TrainWorker).
- ``batch-async``: as fully-async, counted from the version the engines *serve*: a rollout waits
  while train_version + 1 - rollout_version > staleness_threshold and resumes when the sync lands.

In every mode a due validation measures its version while the next batch is rolled out with it:
the next version is published only after the validation. The trainer drops (or keeps) trajectories
over the bound, see TrainWorker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute, long_poll, quick
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.types import DEFAULT_MODEL_TAG, ModelTag, RolloutServiceStatus
from nexrl_hpc.weight_sync.publisher import WeightPublisher, sync_weight_dir
from nexrl_hpc.weight_sync.sync_metrics import export_bytes, sync_metrics
from nexrl_hpc.weight_sync.verify import CanaryReference, WeightVerifier

if TYPE_CHECKING:
    from nexrl_hpc.data.interfaces import DataLoaderRef
    from nexrl_hpc.inference.interfaces import InferenceServiceRef
    from nexrl_hpc.pool.interfaces import TrajectoryPoolRef
    from nexrl_hpc.weight_sync.interfaces import WeightSourceRef


class RolloutScheduler(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        weight = config["weight"]
        self._mode = weight["sync_mode"]
        self._threshold = weight["staleness_threshold"]
        self._validate_freq = weight["validate_freq"]
        self._validate_at_end = config["validate"]["validate_at_end"]
        self._total_steps = config["train_worker"]["total_train_steps"]
        self._batch_items = config["trajectory_pool"]["batch_size"]
        self._publisher = WeightPublisher(weight, config["launch_mode"])
        self._verifier = WeightVerifier(config)  # each engine computes with the published weights
        self._lock = threading.RLock()
        self._progress = threading.Condition(self._lock)
        self._events = 0  # bumped on every new version and validation request (see wait_for_progress)
        self._train_version: dict[ModelTag, int] = {}
        self._rollout_version: dict[ModelTag, int] = {}
        self._syncing: set[ModelTag] = set()
        self._released_for: dict[ModelTag, int] = {}  # the version whose training batch has been released
        self._batches_out: dict[ModelTag, int] = {}  # async modes: batches handed out since the start
        self._waiting_validation: ModelTag | None = None
        self._validation_version = 0
        self._validations: deque[list[float]] = deque(maxlen=64)  # [requested, ended] (wall clock)
        # module references: the module itself in local mode, a handle with its methods elsewhere
        self._dataloader: DataLoaderRef | None = None
        self._trajectory_pool: TrajectoryPoolRef | None = None

    def set_module_references(self, dataloader: DataLoaderRef, trajectory_pool: TrajectoryPoolRef) -> None:
        self._dataloader = dataloader
        self._trajectory_pool = trajectory_pool
        self._set_budget(0)  # nothing goes out before start()

    def set_inference_services(self, services: Sequence[InferenceServiceRef]) -> None:
        """The inference services that must serve every new version (all rollout ranks' engines)."""
        self._publisher.set_inference_services(services)
        self._verifier.set_inference_services(services)

    def set_weight_source(self, source: WeightSourceRef) -> None:
        """The train worker: with weight.transport=broadcast it sends each version to the engines."""
        self._publisher.set_weight_source(source)

    # --- the dispatch budget: written here only ---------------------------------------------------
    def _set_budget(self, items: int) -> None:
        assert self._dataloader is not None
        execute(self._dataloader.set_dispatch_budget, items)

    def _add_budget(self, items: int) -> None:
        assert self._dataloader is not None
        execute(self._dataloader.add_dispatch_budget, items)

    # --- versions -------------------------------------------------------------------------------
    def set_versions(self, model_tag: ModelTag, version: int) -> None:
        """Resume: the trainer holds weights of ``version``."""
        with self._lock:
            self._train_version[model_tag] = version
            self._validation_version = version
            self._bump()

    @quick
    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._lock:
            return self._rollout_version.get(model_tag, 0)

    @quick
    def get_train_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._lock:
            return self._train_version.get(model_tag, 0)

    # --- admission ------------------------------------------------------------------------------
    def start(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        """Release the first batch of rollouts (after the initial sync / pre-training validation)."""
        self._release_rollouts(model_tag)

    @quick
    def check_rollout_service_status(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> RolloutServiceStatus:
        """BLOCK while the engines reload in sync mode (workers fetch nothing, clients hold requests)."""
        with self._lock:
            if self._mode == "sync" and model_tag in self._syncing:
                return RolloutServiceStatus.BLOCK
            return RolloutServiceStatus.CONTINUE

    @quick
    def on_batch_ready(self, model_tag: ModelTag) -> bool:
        """The pool holds a complete batch of ``model_tag``: whether it refuses further trajectories
        of it (sync mode: stragglers go back as "re-rollout") until the next release."""
        return self._mode == "sync"

    def replace_filtered_tasks(self, count: int) -> None:
        """The pool dropped groups that teach nothing (dynamic sampling): as many fresh tasks go out."""
        self._add_budget(count)

    def trainer_dropped_batch(self, model_tag: ModelTag) -> None:
        """Async modes: a whole batch was over the staleness bound; hand out one batch more in its
        place (otherwise the last steps of the run would wait for data that never comes)."""
        if self._mode != "sync":
            self._add_budget(self._batch_items)

    def _release_rollouts(self, model_tag: ModelTag) -> None:
        """Open the pool and hand out the training batch(es) the mode allows now."""
        if self._mode != "sync":
            self._release_async(model_tag)
            return
        with self._lock:
            version = self._train_version.get(model_tag, 0)
            if self._released_for.get(model_tag) == version:
                return
            self._released_for[model_tag] = version
            done = version >= self._total_steps
        assert self._trajectory_pool is not None
        execute(self._trajectory_pool.accept_trajectories, model_tag)
        self._set_budget(0 if done else self._batch_items)

    def _release_async(self, model_tag: ModelTag) -> None:
        """Hand out every batch b with b - 1 - threshold <= the version the mode counts from."""
        with self._lock:
            if self._mode == "batch-async":
                basis = self._rollout_version.get(model_tag, 0)
            else:
                basis = self._train_version.get(model_tag, 0)
            first = model_tag not in self._batches_out
            out = self._batches_out.setdefault(model_tag, self._train_version.get(model_tag, 0))
            allowed = min(self._total_steps, basis + 1 + self._threshold)
            new = max(0, allowed - out)
            self._batches_out[model_tag] = out + new
        items = new * self._batch_items
        assert self._dataloader is not None
        if first:  # a resume hands out again the tasks that were untrained at the checkpoint: they count
            items = max(0, items - execute(self._dataloader.num_untrained))
        if items:
            self._add_budget(items)

    # --- new versions ---------------------------------------------------------------------------
    def train_worker_notify_weight_update(
        self,
        worker_name: str,
        model_tag: ModelTag,
        version: int | None = None,
        canary: CanaryReference | None = None,
    ) -> None:
        """The trainer finished a step and exported its weights; publish them (verified against
        ``canary``, the trainer's log-probs, when given), release the next batch and maybe validate.

        A pending validation measures its own version: the next one is published after it."""
        with self._progress:
            self._progress.wait_for(lambda: self._waiting_validation is None)
            new_version = version if version is not None else self._train_version.get(model_tag, 0) + 1
            self._train_version[model_tag] = new_version
        self.sync_weight_to_rollout_service(model_tag, canary)
        with self._lock:
            if self._validation_due(new_version):
                self._waiting_validation = model_tag
                self._validation_version = new_version
                self._validations.append([time.time(), float("inf")])
        self._release_rollouts(model_tag)
        with self._lock:
            self._bump()

    def sync_weight_to_rollout_service(
        self, model_tag: ModelTag, canary: CanaryReference | None = None
    ) -> None:
        """Publish the trainer's current version; clients hold new requests while the reload (and
        its verification against ``canary``) runs. A failed reload raises ``WeightSyncError``, a
        failed verification ``WeightVerificationError``: the served version stays where it was."""
        version = self.get_train_model_version(model_tag)
        with self._lock:
            self._syncing.add(model_tag)
        try:
            started = time.monotonic()
            self._publisher.publish(version)
            path = sync_weight_dir(self._publisher.sync_path, version)
            sent = self._publisher.last_sync.get("bytes")  # a broadcast's (no export to measure)
            metrics = sync_metrics(
                time.monotonic() - started, sent if sent is not None else export_bytes(path)
            )
            if canary is not None:
                # the engines this version reached: a rank joining meanwhile gets the next one
                served = self._publisher.served
                metrics["weight_sync/verify_max_abs_diff"] = self._verifier.verify(canary, served)
            if self._activity_tracker is not None:
                self._activity_tracker.experiment_logger_post("all", data=metrics, step=version)
        finally:
            with self._lock:
                self._syncing.discard(model_tag)
        with self._lock:
            self._rollout_version[model_tag] = version
        self._publisher.prune(version)

    # --- the controller's loop: progress and validation -----------------------------------------
    def _bump(self) -> None:
        self._events += 1
        self._progress.notify_all()

    @long_poll
    def wait_for_progress(self, seen: int, timeout: float) -> int:
        """Long poll for the controller loop: the event count, as soon as it differs from ``seen``
        (a new version, a validation request) or after ``timeout``."""
        with self._progress:
            self._progress.wait_for(lambda: self._events != seen, timeout)
            return self._events

    def _validation_due(self, version: int) -> bool:
        if self._validate_freq > 0 and version % self._validate_freq == 0:
            return True
        return self._validate_at_end and version == self._total_steps

    @quick
    def is_waiting_for_validation(self) -> bool:
        with self._lock:
            return self._waiting_validation is not None

    def waiting_validation_model_tag(self) -> ModelTag | None:
        with self._lock:
            return self._waiting_validation

    @quick
    def validation_intervals(self, since: float) -> list[tuple[float, float]]:
        """Wall-clock intervals from a validation's request to its end that end after ``since`` (one
        still running ends now): the trainer's step-time breakdown counts its waits in them."""
        now = time.time()
        with self._lock:
            return [(s, min(e, now)) for s, e in self._validations if e > since]

    def get_validation_version(self) -> int:
        """The weight version the pending (or last) validation measures."""
        with self._lock:
            return self._validation_version

    def end_validate(self, model_tag: ModelTag) -> None:
        with self._lock:
            if self._waiting_validation != model_tag:
                return
            self._waiting_validation = None
            if self._validations:
                self._validations[-1][1] = time.time()
            self._bump()
        self._release_rollouts(model_tag)

    # --- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "train_version": dict(self._train_version),
                "rollout_version": dict(self._rollout_version),
            }
