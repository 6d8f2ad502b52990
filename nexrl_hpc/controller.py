"""NexRLController: builds every module from the config, runs them, watches them, stops them.

``run`` (seed 000): prepare the run dir, model and data -> start the inference service -> build
modules -> init the trainer -> load the initial or resumed checkpoint and publish its weights ->
optional validation -> start the loops -> monitor (validation on weight-sync request, finish,
exceptions by policy, liveness) -> stop everything, even on failure.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time
from typing import Any

import numpy as np
import torch
import yaml

from nexrl_hpc.checkpoint.manager import (
    STATE_FILE,
    find_latest_checkpoint,
    is_complete,
    read_state_h5,
    restore_rng_state,
)
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.core.execute import execute
from nexrl_hpc.data.prepare import prepare_datasets
from nexrl_hpc.models.tiny import load_tokenizer, materialize_base_model
from nexrl_hpc.runtime.local import LocalResourceManager
from nexrl_hpc.runtime.roles import RunContext
from nexrl_hpc.tracking.experiment import ExperimentLogger, read_metrics
from nexrl_hpc.types import DEFAULT_MODEL_TAG, ModelTag, NexRLRole

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run stopped because of an error (policy ``stop_on_error`` / ``stop_on_critical`` or a dead module)."""


class NexRLController:
    def __init__(self, config: RLTrainConfig):
        self.config = config
        self.run_dir = os.path.abspath(config["run_dir"])
        self._monitor = config["runtime_monitor"]
        self._policy = self._monitor["exception_handling"]["policy"]
        self._poll_s = self._monitor["poll_interval_s"]
        self._seen_errors = 0
        self._last_health_check = 0.0
        self._inference_server: Any = None
        self.activity_tracker: ActivityTracker | None = None
        self.experiment_logger: ExperimentLogger | None = None
        self.resources: LocalResourceManager | None = None
        self.last_validation: dict[str, float] | None = None
        self.resumed_from: str | None = None

    # --- public ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Train to the end; raise ``RunFailed`` (with the reason) if the run cannot go on."""
        try:
            self._setup()
            self._train()
        except RunFailed:
            raise
        except Exception as exc:
            logger.exception("run failed")
            raise RunFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._stop()

    # --- set-up ---------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.config
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dict(cfg), f, sort_keys=False)
        random.seed(cfg["seed"])
        np.random.seed(cfg["seed"] % (2**32))
        torch.manual_seed(cfg["seed"])

        self.resumed_from = self._find_resume_checkpoint()
        resume_state = (
            read_state_h5(os.path.join(self.resumed_from, STATE_FILE)) if self.resumed_from else None
        )
        resume_step = resume_state["global_step"] if resume_state else None

        base_model_dir = materialize_base_model(cfg["model"], os.path.join(self.run_dir, "base_model"))
        self._launch_inference_service(base_model_dir)
        train_files, val_files = prepare_datasets(cfg, self.run_dir)
        tokenizer = load_tokenizer(base_model_dir)
        ctx = RunContext(self.run_dir, base_model_dir, train_files, val_files, int(tokenizer.pad_token_id))

        self.experiment_logger = ExperimentLogger(cfg, self.run_dir, resume_step)
        self.activity_tracker = ActivityTracker(cfg, experiment_logger=self.experiment_logger)
        self.resources = LocalResourceManager(cfg, ctx)
        self.resources.create_all_actors()
        self._wire_modules()

        execute(self.train_worker.initialize_workers)
        if resume_state is not None:
            assert self.resumed_from is not None
            self._load_resume_checkpoint(self.resumed_from, resume_state)
        else:
            self._load_initial_checkpoint()
        self._tune_gc()

    def _tune_gc(self) -> None:
        runtime = self.config["runtime"]
        if len(runtime["gc_thresholds"]) == 3:
            gc.set_threshold(*runtime["gc_thresholds"])
        if runtime["gc_freeze_after_setup"]:
            gc.collect()
            gc.freeze()

    def _wire_modules(self) -> None:
        assert self.resources is not None and self.activity_tracker is not None
        proxy = ActivityTrackerProxy(self.activity_tracker)
        for module in self.resources.all_modules():
            module.set_activity_tracker(proxy)
        for role in NexRLRole:
            for module in self.resources.get_actor_wrapper(role):
                self.activity_tracker.register_module(
                    module.get_module_name(), module, is_rollout_worker=role == NexRLRole.ROLLOUT_WORKER
                )
        self.weight_sync_controller.set_module_references(self.dataloader, self.trajectory_pool)
        self.trajectory_pool.set_module_references(self.dataloader, self.weight_sync_controller)
        self.algorithm_processor.set_module_references(self.trajectory_pool, self.train_batch_pool)
        self.train_worker.set_module_references(
            self.train_batch_pool, self.weight_sync_controller, self.dataloader
        )
        self.validator.set_module_references(self.validate_dataloader)
        for worker in self.rollout_workers:
            worker.set_module_references(
                self.trajectory_pool,
                self.dataloader,
                self.weight_sync_controller,
                self.validate_dataloader,
                self.validator,
            )

    def _launch_inference_service(self, base_model_dir: str) -> None:
        service = self.config["service"]["inference_service"]
        self._inference_url = service["base_url"]
        self._inference_key = service["api_key"]
        if service["backend"] == "local" and not service["base_url"]:
            from nexrl_hpc.inference.local_server import LocalInferenceServer

            train = self.config["service"]["train_service"]
            self._inference_server = LocalInferenceServer(
                base_model_dir,
                service["local"],
                os.path.join(self.run_dir, "logs"),
                service["model"],
                device=train["device"],
                dtype=train["dtype"],
                attn_implementation=self.config["model"]["attn_implementation"],
            )
            self._inference_server.launch()

    def _connect_inference_service(self) -> None:
        if self._inference_server is not None:
            self._inference_url = self._inference_server.wait_ready()
            self._inference_key = self._inference_server.api_key
        execute(self.weight_sync_controller.set_inference_endpoint, self._inference_url, self._inference_key)
        for worker in self.rollout_workers:
            execute(worker.set_inference_endpoint, self._inference_url, self._inference_key)

    # --- checkpoints ----------------------------------------------------------------------------
    def _find_resume_checkpoint(self) -> str | None:
        resume = self.config["resume"]
        if resume["mode"] == "disable":
            return None
        if resume["mode"] == "from_path":
            path = os.path.abspath(resume["resume_path"] or "")
            if not is_complete(path):
                raise RunFailed(
                    f"resume.resume_path={path!r} is not a complete checkpoint (no COMPLETE marker)"
                )
            return path
        latest = self._find_latest_checkpoint(self.config["train_worker"]["checkpoint_path"])
        if latest:
            logger.info("resuming from %s", latest)
        return latest

    def _find_latest_checkpoint(self, checkpoint_folder: str) -> str | None:
        return find_latest_checkpoint(checkpoint_folder)

    def _load_initial_checkpoint(self) -> None:
        """Fresh start: publish version 0 (the initial weights) to the inference service."""
        execute(self.train_worker.export_weights, 0)
        self._connect_inference_service()
        execute(self.weight_sync_controller.sync_weight_to_rollout_service, self._model_tag)

    def _load_resume_checkpoint(self, path: str, state: dict[str, Any]) -> None:
        step = state["global_step"]
        execute(self.train_worker.load_checkpoint, path)
        execute(self.train_worker.set_train_step, step)
        execute(self.dataloader.load_state_dict, state["dataloader"])
        restore_rng_state(state["rng"])
        for tag, version in state["weight_version"].items():
            execute(self.weight_sync_controller.set_versions, tag, int(version))
        assert self.activity_tracker is not None
        self.activity_tracker.set_training_step(step)
        execute(self.train_worker.export_weights, step)
        self._connect_inference_service()
        execute(self.weight_sync_controller.sync_weight_to_rollout_service, self._model_tag)
        logger.info("resumed at step %d from %s", step, path)

    # --- training -------------------------------------------------------------------------------
    def _train(self) -> None:
        for worker in self.rollout_workers:
            execute(worker.run)
        step = execute(self.train_worker.get_train_step)
        if self._validation_needed_at_start(step):
            self._run_validate(self._model_tag)
        execute(self.weight_sync_controller.start, self._model_tag)
        execute(self.algorithm_processor.run)
        execute(self.train_worker.run)
        while True:
            time.sleep(self._poll_s)
            if execute(self.weight_sync_controller.is_waiting_for_validation):
                tag = execute(self.weight_sync_controller.waiting_validation_model_tag)
                self._run_validate(tag or self._model_tag)
            self._check_module_exceptions()
            self._check_health()
            if self._check_finish():
                break
        logger.info("training finished at step %d", execute(self.train_worker.get_train_step))

    def _validation_needed_at_start(self, step: int) -> bool:
        validate = self.config["validate"]
        freq = self.config["weight"]["validate_freq"]
        due = (step == 0 and validate["validate_before_train"]) or (
            step > 0 and freq > 0 and step % freq == 0
        )
        if not due or self.experiment_logger is None:
            return due
        logged = any(
            r.get("step") == step and any(k.startswith("val/") for k in r)
            for r in read_metrics(self.experiment_logger.metrics_path)
        )
        return not logged

    def _run_validate(self, model_tag: ModelTag) -> None:
        self._start_validate(model_tag)
        self._wait_until(lambda: execute(self.validator.is_complete))
        self._end_validate(model_tag)

    def _wait_until(self, condition: Any) -> None:
        while not condition():
            time.sleep(self._poll_s)
            self._check_module_exceptions()
            self._check_health()

    def _start_validate(self, model_tag: ModelTag) -> None:
        execute(self.validator.clear)
        execute(self.validate_dataloader.reset)
        for worker in self.rollout_workers:
            execute(worker.begin_validate)

    def _end_validate(self, model_tag: ModelTag) -> None:
        for worker in self.rollout_workers:
            execute(worker.end_validate)
        step = execute(
            self.weight_sync_controller.get_validation_version
        )  # the version measured, not the trainer's
        self.last_validation = execute(self.validator.compute_and_log_metrics, step)
        logger.info(
            "validation at step %d: %s", step, {k: round(v, 4) for k, v in self.last_validation.items()}
        )
        execute(self.validator.clear)
        execute(self.weight_sync_controller.end_validate, model_tag)

    def _check_finish(self) -> bool:
        if execute(self.weight_sync_controller.is_waiting_for_validation):
            return False
        if execute(self.train_worker.is_done):
            return True
        assert self.activity_tracker is not None
        data_done = (
            execute(self.dataloader.is_finished)
            and execute(self.trajectory_pool.is_empty)
            and execute(self.train_batch_pool.is_empty)
            and self.activity_tracker.is_quiescent()
        )
        if data_done:
            logger.info(
                "data exhausted (data.max_epochs reached) at step %d",
                execute(self.train_worker.get_train_step),
            )
        return data_done

    def _check_module_exceptions(self) -> bool:
        """Apply ``runtime_monitor.exception_handling.policy`` to errors reported since the last check."""
        assert self.activity_tracker is not None
        if not self._monitor["exception_handling"]["enabled"]:
            return True
        new, self._seen_errors = self.activity_tracker.error_reporter.errors_since(self._seen_errors)
        errors = [e for e in new if e.severity == ErrorSeverity.ERROR]
        if self._policy == "stop_on_critical":
            errors = [e for e in errors if e.is_critical]
        elif self._policy == "continue":
            errors = []
        if errors:
            first = errors[0]
            raise RunFailed(
                f"{first.module_name} [{first.work_context}]: {first.message} (policy {self._policy})"
            )
        return True

    def _check_health(self) -> None:
        health = self._monitor["health_check"]
        if not health["enabled"] or time.monotonic() - self._last_health_check < health["check_interval"]:
            return
        self._last_health_check = time.monotonic()
        if self._inference_server is not None and not self._inference_server.is_alive():
            raise RunFailed(
                f"the local inference server ({self._inference_url}, pid {self._inference_server.process.pid}) exited; "
                f"see {self._inference_server.log_path}"
            )
        assert self.activity_tracker is not None
        dead = self.activity_tracker.dead_modules(health["timeout"])
        if dead:
            raise RunFailed(f"module(s) not alive: {', '.join(dead)}")

    # --- shutdown -------------------------------------------------------------------------------
    def _stop(self) -> None:
        timeout = self._monitor["stop_timeout_s"]
        if self.resources is not None:
            for worker in self.rollout_workers:
                self._quietly(worker.stop)
            self._quietly(self.algorithm_processor.stop)
            self._quietly(self.train_worker.stop)
            if self.activity_tracker is not None and not self.activity_tracker.wait_quiescent(timeout):
                logger.warning("still busy at stop: %s", self.activity_tracker.get_running_status_summary())
        if self._inference_server is not None:
            self._quietly(self._inference_server.stop)
        if self.experiment_logger is not None:
            self._quietly(self.experiment_logger.close)

    @staticmethod
    def _quietly(fn: Any) -> None:
        try:
            fn()
        except Exception:
            logger.exception("error during shutdown")

    # --- module handles -------------------------------------------------------------------------
    def _one(self, role: NexRLRole) -> Any:
        assert self.resources is not None
        return self.resources.get_one(role)

    @property
    def _model_tag(self) -> ModelTag:
        return self.config["service"]["train_service"]["model_tag"] or DEFAULT_MODEL_TAG

    @property
    def dataloader(self) -> Any:
        return self._one(NexRLRole.DATA_LOADER)

    @property
    def validate_dataloader(self) -> Any:
        return self._one(NexRLRole.VALIDATE_DATALOADER)

    @property
    def trajectory_pool(self) -> Any:
        return self._one(NexRLRole.TRAJECTORY_POOL)

    @property
    def algorithm_processor(self) -> Any:
        return self._one(NexRLRole.ALGORITHM_PROCESSOR)

    @property
    def train_batch_pool(self) -> Any:
        return self._one(NexRLRole.TRAIN_BATCH_POOL)

    @property
    def train_worker(self) -> Any:
        return self._one(NexRLRole.TRAIN_WORKER)

    @property
    def weight_sync_controller(self) -> Any:
        return self._one(NexRLRole.WEIGHT_SYNC_CONTROLLER)

    @property
    def validator(self) -> Any:
        return self._one(NexRLRole.VALIDATOR)

    @property
    def rollout_workers(self) -> list[Any]:
        assert self.resources is not None
        return self.resources.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)
