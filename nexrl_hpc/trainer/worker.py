"""TrainWorker: takes processed batches, trains through a TrainBackend, exports, checkpoints, notifies.

One training step: (optionally) recompute old log-probs -> (on-policy distillation) the teacher's
log-probs of the sampled tokens become per-token advantages -> ``update_actor`` and the export of
the new weights to ``sync_weight_path/version_<step>`` (one ``start_update_actor``) -> one
metrics line -> checkpoint every ``save_freq`` steps and at the last step -> the trainer's
log-probs of the weight-verification canary (a verified sync, weight_sync/verify.py: taken before
anything trains past this step, so before a batch sent ahead) -> tell the weight sync controller. A backend that queues updates (a trainer group on ranks of its own) gets the next
step's batch while it trains this one, in the async modes (``_send_ahead``).

In the async modes the announcement (the inference service's reload, the next batch's release)
runs on the announcement thread while the next step trains (announce.py: versions published in
order, a failed publication fails the next step); a checkpoint, and the worker before it reports
itself done, wait for the announcement in flight.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexrl_hpc.algorithm.distillation import use_teacher_log_probs
from nexrl_hpc.algorithm.off_policy import StalenessBound, use_recomputed_log_probs
from nexrl_hpc.checkpoint.manager import CheckpointManager, capture_rng_state
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.core.execute import execute, execute_async, quick
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.models.run_tokenizer import load_run_tokenizer
from nexrl_hpc.tracking.rollout_dump import dump_rollouts
from nexrl_hpc.tracking.samples import decode_samples, write_samples
from nexrl_hpc.tracking.timing import StepTimeline
from nexrl_hpc.trainer.announce import VersionAnnouncer
from nexrl_hpc.trainer.backend import TrainBackend, UpdateInFlight
from nexrl_hpc.trainer.batch_contract import REQUIRED_KEYS
from nexrl_hpc.trainer.lora import resolved_actor
from nexrl_hpc.types import Batch
from nexrl_hpc.weight_sync.publisher import sync_weight_dir
from nexrl_hpc.weight_sync.transport import reload_needs_tied_head, run_uses_broadcast
from nexrl_hpc.weight_sync.verify import CanaryReference, trainer_canary_log_probs, verify_due

if TYPE_CHECKING:
    from nexrl_hpc.data.interfaces import DataLoaderRef
    from nexrl_hpc.pool.interfaces import TrainBatchPoolRef
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef

logger = logging.getLogger(__name__)


class TrainWorker(NexRLModule):
    def __init__(self, config: RLTrainConfig, client: TrainBackend, teacher: TrainBackend | None = None):
        """``teacher``: on-policy distillation's frozen teacher (``compute_log_prob`` only), or None."""
        super().__init__()
        tw = config["train_worker"]
        self._config = config
        self._client = client
        self._teacher = teacher
        self._opd = config["algorithm"]["opd"]
        self._total_steps = tw["total_train_steps"]
        self._save_freq = tw["save_freq"]
        self._long_poll_s = tw["long_poll_s"]
        self._ahead_poll_s = tw["send_ahead_poll_s"]
        self._sync_path = config["weight"]["sync_weight_path"]
        # weights reach the engines by broadcast: nothing exported, the scheduler asks for them (a
        # LoRA adapter never: it is exported)
        self._broadcast = run_uses_broadcast(config)
        self._model_tag = config["service"]["train_service"]["model_tag"]
        algo = config["algorithm"]
        self._recompute = algo["recompute_old_log_prob"]
        self._correction = algo["off_policy_correction"]
        self._is_cap = algo["is_cap"]
        weight = config["weight"]
        self._async = weight["sync_mode"] != "sync"
        # the next batch may go to the trainer while it trains the current one (see _send_ahead)
        # (not with broadcast: the next update would change the weights before they are sent)
        self._send_ahead_enabled = (
            self._async
            and not self._recompute
            and teacher is None
            and client.queues_updates
            and not self._broadcast
        )
        self._staleness = StalenessBound.from_config(weight)
        self._dump_rollouts = config["logger"]["dump_rollouts"]
        self._samples_per_step = config["logger"]["samples_per_step"]
        self._sample_tokenizer: Any = None  # the run's tokenizer, loaded at the first samples
        self._run_dir = config["run_dir"]
        keep = 1 if tw["remove_previous_ckpt"] else tw["max_ckpt_to_keep"]
        self._checkpoints = CheckpointManager(tw["checkpoint_path"], keep)
        self._train_step = 0
        self._stop_requested = False  # preemption: the next step to finish is this session's last
        self._stopped_early = False
        self._in_step = False
        # each exported version to the scheduler; the async modes in the background (announce.py)
        self._announcer = VersionAnnouncer(self._notify, self._async, lambda: f"{self._module_name}-announce")
        self._canary: list[list[int]] = []  # weight verification's prompts (set_canary)
        self._timeline = StepTimeline()  # the step-time breakdown (tracking/timing.py)
        # module references: the module itself in local mode, a handle with its methods elsewhere
        self._train_batch_pool: TrainBatchPoolRef | None = None
        self._scheduler: RolloutSchedulerRef | None = None
        self._dataloader: DataLoaderRef | None = None

    # --- setup ----------------------------------------------------------------------------------
    def set_module_references(
        self,
        train_batch_pool: TrainBatchPoolRef,
        weight_sync_controller: RolloutSchedulerRef,
        dataloader: DataLoaderRef | None = None,
    ) -> None:
        self._train_batch_pool = train_batch_pool
        self._scheduler = weight_sync_controller
        self._dataloader = dataloader

    def train_service_config(self) -> dict[str, Any]:
        """What the train service workers need (the training service's ``initialize_worker`` payload)."""
        return train_service_config(self._config)

    def teacher_service_config(self) -> dict[str, Any]:
        """The teacher's ``initialize_worker`` payload: the student's settings, its own engine, no KL reference."""
        teacher = self._config["service"]["train_service"]["teacher_service"]
        config = self.train_service_config()
        config["engine"] = teacher["engine"]
        config["sequence_parallel_size"] = 1  # the student's setting: the teacher's ranks score whole rows
        config["value_head"] = None  # a frozen scorer
        config["algorithm"] = dict(config["algorithm"], kl_loss_coef=0.0)
        return config

    def initialize_workers(self) -> None:
        ts = self._config["service"]["train_service"]
        self._client.initialize_worker(self.train_service_config(), role="actor", world_size=ts["world_size"])
        self._client.init_model()
        if self._teacher is not None:
            teacher = ts["teacher_service"]
            self._teacher.initialize_worker(
                self.teacher_service_config(), role="teacher", world_size=teacher["world_size"]
            )
            self._teacher.init_model()

    @quick
    def get_train_step(self) -> int:
        return self._train_step

    def set_train_step(self, step: int) -> None:
        self._train_step = step

    @quick
    def is_done(self) -> bool:
        """All planned steps (or, preempted, this session's last step) trained, saved and handed on."""
        return (self._train_step >= self._total_steps or self._stopped_early) and not self._in_step

    @quick
    def stop_after_current_step(self) -> None:
        """Preemption: the step in flight (or the next one, whose batch is already being rolled out
        in sync mode) is the last: it is checkpointed and its weight update is not announced, so no
        rollout for a later step starts and the saved data position is exact."""
        self._stop_requested = True  # read once per step: before the announcement, or the next step

    # --- weights / checkpoints used by the controller -------------------------------------------
    def set_canary(self, prompts: list[list[int]]) -> None:
        """The canary every verified sync is scored on (weight_sync/verify.py)."""
        self._canary = [list(p) for p in prompts]

    def canary_due(self, version: int) -> bool:
        return bool(self._canary) and verify_due(self._config, version)

    def canary_reference(self, version: int) -> CanaryReference | None:
        """The trainer's canary log-probs with the weights it holds now, taken as ``version``'s
        (None when that sync is not verified). Asked before anything trains past ``version``."""
        if not self.canary_due(version):
            return None
        return trainer_canary_log_probs(self._client, self._canary, version)

    def export_weights(self, version: int) -> str:
        """Version ``version`` written for the engines to reload ("" with broadcast: nothing written)."""
        if self._broadcast:
            return ""
        path = sync_weight_dir(self._sync_path, version)
        self._client.export_weights(path)
        return path

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The trainer's current weights to the sync's group (the weight publisher asks, the engines listen)."""
        return self._client.broadcast_weights(spec)

    def load_checkpoint(self, path: str) -> None:
        self._client.load_checkpoint(path, load_optimizer=True)

    def save_checkpoint(self) -> str:
        step = self._train_step
        state = {
            "global_step": step,
            "weight_version": {self._model_tag: step},
            "dataloader": execute(self._dataloader.state_dict) if self._dataloader is not None else {},
            "rng": capture_rng_state(),
        }
        t0 = time.monotonic()
        path = self._checkpoints.save(step, lambda d: self._client.save_checkpoint(d, step), state)
        logger.info("saved checkpoint %s in %.2fs", path, time.monotonic() - t0)
        return path

    # --- loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        self._timeline.start()
        self._start_thread(self._loop)

    def stop(self) -> None:
        self._stop_thread(timeout=self._config["train_worker"]["stop_timeout_s"])

    def _loop(self) -> None:
        while not self.stopped and self._train_step < self._total_steps and not self._stopped_early:
            batch = self._get_batch(wait_s=self._long_poll_s)
            if batch is None:
                continue
            assert self._activity_tracker is not None
            self._timeline.end_wait()
            self._in_step = True
            try:
                with self._activity_tracker.track(self._module_name, "train_step"):
                    started = self._start_step(batch, self._train_step + 1)
                    while started is not None:  # a step, and each sent behind it while it trained
                        ahead = self._send_ahead(started)
                        self._finish_step(started, ahead is not None)
                        started = ahead
                    if self._train_step >= self._total_steps or self._stopped_early:
                        self._announcer.wait()
            finally:
                self._in_step = False
                self._timeline.begin_wait()

    def _get_batch(self, wait_s: float = 0.0) -> Batch | None:
        assert self._train_batch_pool is not None
        return execute(self._train_batch_pool.get_batch, self._model_tag, wait_s)

    def _release_tasks(self, keys: list[str]) -> None:
        if self._dataloader is not None and keys:
            execute(self._dataloader.release_items, keys)

    def _start_step(self, batch: Batch, step: int) -> _StartedStep | None:
        """Step ``step`` up to its update being sent: staleness bound, (recomputed) old log-probs,
        (the teacher's advantages); None when the batch was dropped (no step trained)."""
        t0 = time.monotonic()
        consumed = list(batch.metadata.get("task_keys", []))  # trained or dropped below
        kept, stale_metrics = self._staleness.apply(batch, step)
        assert self._scheduler is not None
        if kept is None:
            self._release_tasks(consumed)
            execute(self._scheduler.trainer_dropped_batch, self._model_tag)
            logger.warning(
                "a batch of %d trajectories was over the staleness bound (%d) and dropped: no step trained",
                len(batch),
                self._staleness.bound,
            )
            return None
        batch = kept
        tensors = dict(batch.values)
        tensors["old_log_probs"] = tensors["behaviour_log_probs"]
        metrics: dict[str, Any] = dict(batch.metadata.get("metrics", {}))
        metrics.update(stale_metrics)
        metrics["train/sent_ahead"] = 0.0  # 1: sent while the trainer trained the step before
        if self._recompute:
            recomputed = self._client.compute_log_prob({"batch": tensors, "meta_info": {}})["batch"][
                "old_log_probs"
            ]
            metrics.update(use_recomputed_log_probs(tensors, recomputed, self._correction, self._is_cap))
        t_teacher = time.monotonic()
        if self._teacher is not None:
            scored = {k: tensors[k] for k in REQUIRED_KEYS}  # the sequences only: nothing else crosses
            teacher_log_probs = self._teacher.compute_log_prob({"batch": scored, "meta_info": {}})["batch"][
                "old_log_probs"
            ]
            metrics.update(use_teacher_log_probs(tensors, teacher_log_probs, self._opd))
        t1 = time.monotonic()
        self._timeline.add("timing/old_log_prob_s", t_teacher - t0)
        self._timeline.add("timing/teacher_log_prob_s", t1 - t_teacher)
        if self._broadcast:  # the previous version is sent before this update changes the weights
            self._announcer.wait()
        update = self._client.start_update_actor(
            {"batch": tensors, "meta_info": {"global_token_num": batch.metadata.get("global_token_num")}},
            "" if self._broadcast else sync_weight_dir(self._sync_path, step),
        )
        # sending (a backend that does not queue: the whole update and export, split at the finish)
        sent_s = time.monotonic() - t1
        self._timeline.add("timing/update_s", sent_s)
        return _StartedStep(
            batch, step, consumed, metrics, update, 0.0 if self._client.queues_updates else sent_s
        )

    def _send_ahead(self, current: _StartedStep) -> _StartedStep | None:
        """The next batch to the trainer group behind ``current`` (which it is training): the group
        starts it the moment ``current`` and its export are done, instead of idling while this
        thread finishes ``current``'s step. Only where nothing between the two steps needs the
        trainer: async modes, no recomputed log-probs or teacher (they need the new weights' answer
        first), no checkpoint or last step, no stop requested — and a batch that comes before the
        trainer has answered ``current`` (looked for every ``train_worker.send_ahead_poll_s``)."""
        step = current.step
        checkpoint = self._save_freq > 0 and step % self._save_freq == 0
        if (
            not self._send_ahead_enabled
            or self.stopped
            or checkpoint
            or step + 1 > self._total_steps
            or self._stop_requested
        ):
            return None
        t0 = time.monotonic()
        batch = None
        while batch is None and not current.update.done():  # it usually lands while this one trains
            batch = self._get_batch(wait_s=self._ahead_poll_s)
        self._timeline.add("timing/update_s", time.monotonic() - t0)  # waiting while the trainer trains
        if batch is None:
            return None
        if self.canary_due(step):  # scored on this step's weights: queued before the next update
            t1 = time.monotonic()
            current.canary = self.canary_reference(step)
            self._timeline.add("timing/weight_sync_s", time.monotonic() - t1)
        ahead = self._start_step(batch, step + 1)
        if ahead is not None:
            ahead.metrics["train/sent_ahead"] = 1.0
        return ahead

    def _finish_step(self, started: _StartedStep, ahead: bool) -> None:
        """Wait for the update (and its export), then the step's line, checkpoint and announcement.
        ``ahead``: the next step's batch is already with the trainer."""
        assert self._activity_tracker is not None and self._scheduler is not None
        batch, metrics = started.batch, started.metrics
        # answered while the update finishes: the validations the trainer's waits may overlap
        validations = execute_async(self._scheduler.validation_intervals, self._timeline.wall_since())
        t1 = time.monotonic()
        result = started.update.result()
        actor = result["meta_info"]["metrics"]
        waited = time.monotonic() - t1
        # the export ran within this wait (or, a backend that does not queue, within the send)
        export_s = min(float(result["meta_info"].get("export_s") or 0.0), waited + started.exported_in_send_s)
        self._train_step = step = started.step
        self._activity_tracker.set_training_step(step)
        if actor.get("actor/nan_skipped"):
            self._activity_tracker.report_error(
                self._module_name,
                "update_actor",
                f"step {step}: non-finite loss or gradient, {actor['actor/nan_skipped']} optimizer step(s) skipped",
                ErrorSeverity.WARNING,
            )
        if self._dump_rollouts:
            dump_rollouts(self._run_dir, step, batch)
        if self._samples_per_step:
            self._write_samples(step, batch)
        metrics.update(actor)
        metrics.update(throughput(metrics, batch))  # per second of timing/step_s: set at the line
        metrics["train/loss"] = actor["actor/loss"]
        metrics["train/grad_norm"] = actor["actor/grad_norm"]
        metrics.setdefault("train/logprob_mismatch_max", actor.get("actor/logprob_mismatch_max"))
        metrics["train/nan_skipped"] = actor["actor/nan_skipped"]
        self._release_tasks(started.consumed)  # before the checkpoint: a resume does not hand them out again
        if self._dataloader is not None:
            metrics["data/skipped_rows"] = execute(self._dataloader.get_skipped_rows)
            metrics["data/filtered_long_prompts"] = execute(self._dataloader.get_filtered_long_prompts)
        timeline = self._timeline
        timeline.add("timing/update_s", waited - export_s)
        timeline.add("timing/export_s", export_s)
        timing = timeline.line(_intervals(validations), batch.metadata.get("rollout_intervals") or {})
        metrics.update(timing)
        per_s = 1.0 / max(timing["timing/step_s"], 1e-9)
        for key in ("perf/generated_tokens", "perf/trained_tokens", "perf/trajectories"):
            metrics[f"{key}_per_s"] = metrics[key] * per_s
        # the step's line is written before its checkpoint commits: a resume from this checkpoint
        # keeps the line, a resume from an older one truncates it and redoes the step
        self._activity_tracker.experiment_logger_post("all", data=metrics, step=step)
        # a stop request read here ends the session at this step (at the next one when that one is
        # already with the trainer: this step's checkpoint would hold its weights); later, at the next
        early = self._stop_requested and step < self._total_steps and not ahead
        if (self._save_freq > 0 and step % self._save_freq == 0) or step == self._total_steps or early:
            self._announcer.wait()  # the checkpoint sees no release of a batch half done
            t4 = time.monotonic()
            self.save_checkpoint()
            timeline.add("timing/checkpoint_s", time.monotonic() - t4)
        if early:
            logger.info("stopping after step %d (preemption): checkpoint saved", step)
            self._stopped_early = True
        else:
            t5, wall = time.monotonic(), time.time()
            canary = started.canary if started.canary is not None else self.canary_reference(step)
            self._announcer.announce(step, canary)
            timeline.waited("timing/weight_sync_s", time.monotonic() - t5, (wall, time.time()))

    def _write_samples(self, step: int, batch: Batch) -> None:
        """``samples/step_<step>.jsonl`` and the loggers: a few rows decoded (tracking/samples.py)."""
        assert self._activity_tracker is not None
        if self._sample_tokenizer is None:
            self._sample_tokenizer = load_run_tokenizer(self._config["model"])
        rows = decode_samples(batch, step, self._sample_tokenizer, self._samples_per_step)
        write_samples(self._run_dir, step, rows)
        self._activity_tracker.experiment_logger_samples(step, rows)

    def _notify(self, step: int, canary: CanaryReference | None) -> None:
        """The announcement itself (with the trainer's canary log-probs when the sync is verified)."""
        assert self._scheduler is not None
        notify = self._scheduler.train_worker_notify_weight_update
        if canary is None:
            execute(notify, self._module_name, self._model_tag, step)
        else:
            execute(notify, self._module_name, self._model_tag, step, canary)


@dataclass
class _StartedStep:
    """A step whose update has been sent to the trainer (its number is its weights' version)."""

    batch: Batch
    step: int
    consumed: list[str]  # the batch's task keys, released once the step is done
    metrics: dict[str, Any]
    update: UpdateInFlight
    exported_in_send_s: float  # a backend that does not queue: the send's seconds (update + export)
    canary: CanaryReference | None = None  # taken before the next step was sent behind this one


def train_service_config(config: RLTrainConfig) -> dict[str, Any]:
    """What the train service workers need (the training service's ``initialize_worker`` payload)."""
    ts, backend = config["service"]["train_service"], config["service"]["inference_service"]["backend"]
    actor = resolved_actor(ts["actor"], config["model"], backend)  # lora.modules_to_save: auto
    value_head = value_head_config(config)
    if value_head is not None and actor["share_prompt"] == "auto":  # the value head reads padded rows
        actor = {**actor, "share_prompt": False}
    return {
        "actor": actor,
        "value_head": value_head,
        "algorithm": {k: config["algorithm"][k] for k in ("kl_loss_coef", "kl_loss_type")},
        "engine": ts["engine"],
        "sequence_parallel_size": ts["sequence_parallel_size"],
        "fsdp": ts["fsdp"],
        "deepspeed": ts["deepspeed"],
        "device": ts["device"],
        "dtype": ts["dtype"],
        "dist_backend": ts["dist_backend"],
        "num_threads": ts["num_threads"],
        "export_max_shard_mb": ts["export_max_shard_mb"],
        "logprob_chunk_tokens": ts["logprob_chunk_tokens"],
        "logit_temperature": config["rollout_worker"]["temperature"] or 1.0,  # greedy: raw logits
        "export_tied_head": reload_needs_tied_head(config["service"]["inference_service"]["backend"]),
        "attn_implementation": config["model"]["attn_implementation"],
        "gradient_checkpointing": config["model"]["gradient_checkpointing"],
        "total_training_steps": config["train_worker"]["total_train_steps"],
    }


def value_head_config(config: RLTrainConfig) -> dict[str, Any] | None:
    """PPO's value head on the policy (``critic.head_on_policy``): its loss settings; else None."""
    critic = config["service"]["train_service"]["critic"]
    if config["algorithm"]["adv_estimator"] != "gae" or not critic["head_on_policy"]:
        return None
    return {"vf_coef": critic["vf_coef"], "cliprange_value": critic["cliprange_value"]}


def throughput(metrics: dict[str, Any], batch: Batch) -> dict[str, float]:
    """What the step moved: tokens generated (the processor counted them), tokens trained, trajectories."""
    return {
        "perf/generated_tokens": float(metrics.get("perf/generated_tokens", 0.0)),
        "perf/trained_tokens": float(batch.metadata.get("global_token_num") or 0),
        "perf/trajectories": float(len(batch)),
    }


def _intervals(future: Future) -> list[tuple[float, float]]:
    """The validation intervals asked for at the step's start (none if the question failed: a
    breakdown is not worth failing a step for)."""
    try:
        return list(future.result(timeout=5.0))
    except Exception as exc:
        logger.warning("validation intervals for the step-time breakdown: %s", exc)
        return []
