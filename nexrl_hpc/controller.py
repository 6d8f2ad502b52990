"""NexRLController: builds every module from the config, runs them, watches them, stops them.

``run``: prepare the run dir, model and data -> build the modules through the runtime
(local objects, or handles to modules on other MPI ranks: the controller cannot tell) -> start the
inference services -> init the trainer -> load the initial or resumed checkpoint and publish its
weights -> optional validation -> start the loops -> monitor (validation on weight-sync request,
finish, exceptions by policy, dead ranks and modules: ``run_health``) -> stop everything, even on
failure. Module references are typed as their modules' classes: in mpi mode they are remote handles
mirroring those classes, called the same way through ``execute``.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from nexrl_hpc.assembly.reward_services import start_reward_services
from nexrl_hpc.assembly.roles import ROLES
from nexrl_hpc.assembly.stopping import quietly, stop_all
from nexrl_hpc.checkpoint.manager import (
    STATE_FILE,
    checkpoint_to_resume,
    read_state_h5,
    restore_rng_state,
)
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker
from nexrl_hpc.core.execute import execute
from nexrl_hpc.membership import RolloutMembership
from nexrl_hpc.models.tiny import load_tokenizer, materialize_base_model
from nexrl_hpc.run_health import RunFailed, RunHealth
from nexrl_hpc.runtime.gc_tuning import settle_after_setup
from nexrl_hpc.runtime.local import LocalRuntime
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT, TERMINATED_EXIT, PreemptionWatch, Terminated
from nexrl_hpc.runtime.protocol import Runtime
from nexrl_hpc.runtime.roles import RunContext
from nexrl_hpc.runtime.run_files import restrict_run_files
from nexrl_hpc.runtime.run_lock import run_alone
from nexrl_hpc.tasks.prepare import prepare_datasets
from nexrl_hpc.tracking.experiment import ExperimentLogger
from nexrl_hpc.tracking.plots import read_metrics
from nexrl_hpc.tracking.run_status import RunStatus
from nexrl_hpc.types import DEFAULT_MODEL_TAG, ModelTag, NexRLRole
from nexrl_hpc.weight_sync.verify import canary_prompts, verification_applies

if TYPE_CHECKING:
    from nexrl_hpc.algorithm.base import BaseAlgorithmProcessor
    from nexrl_hpc.data.loader import DatasetLoader
    from nexrl_hpc.inference.service import InferenceService
    from nexrl_hpc.pool.train_batch_pool import TrainBatchPool
    from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
    from nexrl_hpc.rollout.base import BaseRolloutWorker
    from nexrl_hpc.scheduler.rollout_scheduler import RolloutScheduler
    from nexrl_hpc.trainer.worker import TrainWorker
    from nexrl_hpc.validate.validator import Validator


logger = logging.getLogger(__name__)


class NexRLController:
    def __init__(self, config: RLTrainConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.run_dir = os.path.abspath(config["run_dir"])
        self.runtime: Runtime = runtime if runtime is not None else LocalRuntime(config, ROLES)
        self._monitor = config["runtime_monitor"]
        self._poll_s = self._monitor["poll_interval_s"]
        self._modules_built = False
        self._rollout_workers: list[BaseRolloutWorker] = []
        self._inference_services: list[InferenceService] = []
        self._reward_services: list[Any] = []  # reward_model.placement=own_ranks
        self._members = RolloutMembership(self)  # who generates rollouts: lost, joined, left
        self.activity_tracker: ActivityTracker | None = None
        self._health: RunHealth | None = None  # built with the activity tracker
        self.experiment_logger: ExperimentLogger | None = None
        self.last_validation: dict[str, float] | None = None
        self.resumed_from: str | None = None
        self.preempted = False
        self._saved_for_resume = False  # preempted and this session's last checkpoint is complete
        self._last_step = 0
        self._preemption = PreemptionWatch(config["preemption"])
        self.exit_reason = ""
        self._exit_code: int | None = None  # set when the code is not the reason's (interrupted: 130)
        self.status = RunStatus(self.run_dir)  # <run_dir>/status.json: running, then how the run ended

    # --- public ---------------------------------------------------------------------------------
    def final_validation(self) -> dict[str, float]:
        """This session's last validation, or (a resumed run that had nothing left to do) the last
        one the run logged."""
        if self.last_validation:
            return self.last_validation
        if self.experiment_logger is None:
            return {}
        rows = [
            r
            for r in read_metrics(self.experiment_logger.metrics_path)
            if any(k.startswith("val/") for k in r)
        ]
        return {k: v for k, v in rows[-1].items() if k.startswith("val/")} if rows else {}

    def run(self) -> None:
        """Train to the end (or, preempted, to a checkpoint: ``preempted``); raise ``RunFailed``
        (with the reason) if the run cannot go on."""
        try:
            self.status.started()
            if threading.current_thread() is threading.main_thread():
                self._preemption.install()
            self._setup()
            self._train()
        except RunFailed as exc:
            self.exit_reason = str(exc)
            raise
        except Exception as exc:
            logger.exception("run failed")
            self.exit_reason = f"{type(exc).__name__}: {exc}"
            raise RunFailed(self.exit_reason) from exc
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM outside Slurm (Terminated)
            terminated = isinstance(exc, Terminated)
            self.exit_reason = "terminated (SIGTERM)" if terminated else "interrupted (SIGINT)"
            self._exit_code = TERMINATED_EXIT if terminated else 130
            raise
        except BaseException as exc:  # SystemExit and the like: status.json still says how it ended
            self.exit_reason = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._stop()
            self._preemption.uninstall()

    # --- set-up ---------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.config
        restrict_run_files(cfg)  # runtime.umask: also for runs started from Python (nexrl_hpc.train)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dict(cfg), f, sort_keys=False)
        random.seed(cfg["seed"])
        np.random.seed(cfg["seed"] % (2**32))
        torch.manual_seed(cfg["seed"])

        try:
            self.resumed_from = checkpoint_to_resume(cfg["resume"], cfg["train_worker"]["checkpoint_path"])
        except ValueError as exc:  # resume.resume_path is not a checkpoint to trust
            raise RunFailed(str(exc)) from exc
        resume_state = (
            read_state_h5(os.path.join(self.resumed_from, STATE_FILE)) if self.resumed_from else None
        )
        resume_step = resume_state["global_step"] if resume_state else None

        base_model_dir = materialize_base_model(cfg["model"], os.path.join(self.run_dir, "base_model"))
        train_files, val_files = prepare_datasets(cfg, self.run_dir)
        tokenizer = load_tokenizer(base_model_dir)
        ctx = RunContext(self.run_dir, base_model_dir, train_files, val_files, int(tokenizer.pad_token_id))

        self.experiment_logger = ExperimentLogger(cfg, self.run_dir, resume_step)
        self.activity_tracker = ActivityTracker(cfg, experiment_logger=self.experiment_logger)
        self._health = RunHealth(
            self._monitor, self.runtime, self.activity_tracker, self._members.continue_without
        )
        self.runtime.create_all_actors(ctx, self.activity_tracker)
        self._modules_built = True
        self._rollout_workers = list(self.runtime.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER))
        self._inference_services = list(self.runtime.get_actor_wrapper(NexRLRole.INFERENCE_SERVICE))
        for service in self._inference_services:  # servers start while the trainer loads its model
            execute(service.launch)
        self._wire_modules()
        self._reward_services = start_reward_services(self.runtime, self._rollout_workers)

        execute(self.train_worker.initialize_workers)
        if verification_applies(cfg):  # every verified sync scores these (weight_sync/verify.py)
            execute(self.train_worker.set_canary, canary_prompts(cfg, tokenizer, val_files, train_files))
        if resume_state is not None:  # the trainer's side first: it overlaps the servers' start-up
            assert self.resumed_from is not None
            self._load_resume_checkpoint(self.resumed_from, resume_state)
        else:
            execute(self.train_worker.export_weights, 0)  # version 0: the initial weights
        for service in self._inference_services:
            execute(service.wait_ready)
            # kept now: when a server dies its rank may not answer any more
            self._health.server_descriptions[execute(service.get_module_name)] = execute(service.describe)
        canary = execute(self.train_worker.canary_reference, execute(self.train_worker.get_train_step))
        execute(self.scheduler.sync_weight_to_rollout_service, self._model_tag, canary)
        if resume_state is not None:
            logger.info("resumed at step %d from %s", resume_step, self.resumed_from)
        settle_after_setup(cfg["runtime"])

    def _wire_modules(self) -> None:
        assert self.activity_tracker is not None and self._health is not None
        for name, role, handle in self.runtime.modules():
            self._health.module_roles[name] = role
            self.activity_tracker.register_module(
                name, handle, is_rollout_worker=role == NexRLRole.ROLLOUT_WORKER
            )
        scheduler = self.scheduler
        execute(scheduler.set_module_references, self.dataloader, self.trajectory_pool)
        execute(scheduler.set_inference_services, self._inference_services)
        execute(scheduler.set_weight_source, self.train_worker)
        execute(self.trajectory_pool.set_module_references, self.dataloader, scheduler)
        execute(self.algorithm_processor.set_module_references, self.trajectory_pool, self.train_batch_pool)
        execute(self.train_worker.set_module_references, self.train_batch_pool, scheduler, self.dataloader)
        execute(self.validator.set_module_references, self.validate_dataloader)
        for i, worker in enumerate(self._rollout_workers):
            execute(
                worker.set_module_references,
                self.trajectory_pool,
                self.dataloader,
                scheduler,
                self.validate_dataloader,
                self.validator,
            )
            # placement puts a worker and its service on one rank with the same instance index
            execute(worker.set_inference_service, self._inference_services[i % len(self._inference_services)])

    # --- checkpoints ----------------------------------------------------------------------------
    def _load_resume_checkpoint(self, path: str, state: dict[str, Any]) -> None:
        """The trainer, the data position, the RNG and the versions as checkpointed, and the step's
        weights exported (published once the servers are up)."""
        step = state["global_step"]
        execute(self.train_worker.load_checkpoint, path)
        execute(self.train_worker.set_train_step, step)
        execute(self.dataloader.load_state_dict, state["dataloader"])
        restore_rng_state(state["rng"])
        for tag, version in state["weight_version"].items():
            execute(self.scheduler.set_versions, tag, int(version))
        assert self.activity_tracker is not None
        self.activity_tracker.set_training_step(step)
        execute(self.train_worker.export_weights, step)

    # --- training -------------------------------------------------------------------------------
    def _train(self) -> None:
        for worker in self._rollout_workers:
            execute(worker.run)
        step = execute(self.train_worker.get_train_step)
        if self._validation_needed_at_start(step):
            self._run_validate(self._model_tag)
        execute(self.scheduler.start, self._model_tag)
        execute(self.algorithm_processor.run)
        execute(self.train_worker.run)
        seen = -1
        while True:  # wakes at once on a new version or validation request, else every poll interval
            seen = execute(self.scheduler.wait_for_progress, seen, self._poll_s)
            if execute(self.scheduler.is_waiting_for_validation):
                tag = execute(self.scheduler.waiting_validation_model_tag)
                self._run_validate(tag or self._model_tag)
            self._check_run()
            self._check_preemption()
            if self._check_finish():
                break
        step = self._last_step = execute(self.train_worker.get_train_step)
        if self.preempted:
            logger.warning(
                "stopped at step %d (%s): checkpoint saved, the run resumes from it",
                step,
                self._preemption.reason,
            )
            self._saved_for_resume = True
            reason = f"{self._preemption.reason}: checkpoint saved at step {step}"
            quietly(lambda: self.status.ended(PREEMPTED_EXIT, reason))  # before the requeue ends us
            self._preemption.requeue()  # the checkpoint is complete: requeue now, then leave at once
        else:
            logger.info("training finished at step %d", step)

    @property
    def exit_code(self) -> int:
        """How an interrupted run exits: 130 (SIGINT) or TERMINATED_EXIT (SIGTERM outside Slurm)."""
        return self._exit_code or 130

    @property
    def preemption_reason(self) -> str:
        return self._preemption.reason

    def current_step(self) -> int:
        return self._last_step

    def requeue(self) -> bool:
        return self._preemption.requeue()

    def _check_preemption(self) -> None:
        """The allocation is ending: finish the step in flight, checkpoint it, stop (then requeue)."""
        if self.preempted or not self._preemption.requested():
            return
        self.preempted = True
        logger.warning(
            "%s: finishing the step in flight, saving a checkpoint, stopping", self._preemption.reason
        )
        execute(self.train_worker.stop_after_current_step)

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
        while not execute(self.validator.wait_complete, self._poll_s):
            self._check_run()
        self._end_validate(model_tag)

    def _start_validate(self, model_tag: ModelTag) -> None:
        execute(self.validator.clear)
        execute(self.validate_dataloader.reset)
        for worker in self._rollout_workers:
            execute(worker.begin_validate)
        execute(self.dataloader.wake_waiters)  # workers waiting for training tasks look again

    def _end_validate(self, model_tag: ModelTag) -> None:
        for worker in self._rollout_workers:
            execute(worker.end_validate)
        execute(self.validate_dataloader.wake_waiters)
        step = execute(self.scheduler.get_validation_version)  # the version measured
        self.last_validation = execute(self.validator.compute_and_log_metrics, step)
        logger.info(
            "validation at step %d: %s", step, {k: round(v, 4) for k, v in self.last_validation.items()}
        )
        if self.experiment_logger is not None:
            self.experiment_logger.refresh_plots()
        execute(self.validator.clear)
        execute(self.scheduler.end_validate, model_tag)

    def _check_finish(self) -> bool:
        if execute(self.scheduler.is_waiting_for_validation):
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

    def _check_run(self) -> None:
        """Errors by policy, dead ranks, dead modules: raises ``RunFailed`` if the run cannot go on."""
        assert self._health is not None
        self._health.check_module_exceptions()
        self._members.take_departures()  # joined ranks that said they leave (runtime.elastic)
        self._health.check_health()
        self._members.poll()  # rollout ranks that joined

    # --- shutdown -------------------------------------------------------------------------------
    def _stop(self) -> None:
        """Stop producers before consumers, all within one ``stop_timeout_s`` budget: an exit never
        hangs. A preempted run whose checkpoint is complete leaves at once instead."""
        self._preemption.stopping()
        if self._saved_for_resume and not self.exit_reason:
            self._leave_for_resume()
            return
        if self.experiment_logger is not None:  # drawn while the modules stop
            self.experiment_logger.refresh_plots(final=True)
        deadline = time.monotonic() + self._monitor["stop_timeout_s"]
        if self._modules_built:
            stop_all(self._rollout_workers, deadline)
            stop_all([self.algorithm_processor], deadline)
            stop_all([self.train_worker], deadline)
            tracker = self.activity_tracker
            if tracker is not None and not tracker.wait_quiescent(max(0.0, deadline - time.monotonic())):
                logger.warning("still busy at stop: %s", tracker.get_running_status_summary())
            stop_all(self._inference_services, deadline)
            stop_all(self._reward_services, deadline)
        if self.experiment_logger is not None:
            quietly(self.experiment_logger.close)
        quietly(self.runtime.abort_startup)
        # a preempted run's ranks exit with PREEMPTED_EXIT: at once, without the interpreter's
        # teardown (seconds of garbage collection that Slurm's requeue would wait for)
        code = self._exit_code or (1 if self.exit_reason else PREEMPTED_EXIT if self.preempted else 0)
        reason = self.exit_reason or ("preempted: checkpoint saved" if self.preempted else "run finished")
        quietly(lambda: self.status.ended(code, reason))
        quietly(lambda: self.runtime.shutdown(reason, code))

    def _leave_for_resume(self) -> None:
        """Preempted, checkpoint complete: no orderly stop. Slurm starts the requeued job only once
        every process of this one is gone (an orderly stop waits for loops to finish their long
        polls and endpoints to close), and nothing still running holds what the resume needs: tasks in
        flight are in the checkpoint's state.h5. Every module aborts (server processes killed),
        metrics are flushed, and every rank leaves."""
        quietly(lambda: self.runtime.abort("preempted: checkpoint saved", PREEMPTED_EXIT))
        if self.experiment_logger is not None:
            quietly(lambda: self.experiment_logger.close(leaving=True))  # type: ignore[union-attr]

    # --- module handles -------------------------------------------------------------------------
    def _one(self, role: NexRLRole) -> Any:
        return self.runtime.get_one(role)

    @property
    def _model_tag(self) -> ModelTag:
        return self.config["service"]["train_service"]["model_tag"] or DEFAULT_MODEL_TAG

    @property
    def dataloader(self) -> DatasetLoader:
        return self._one(NexRLRole.DATA_LOADER)

    @property
    def validate_dataloader(self) -> DatasetLoader:
        return self._one(NexRLRole.VALIDATE_DATALOADER)

    @property
    def trajectory_pool(self) -> TrajectoryPool:
        return self._one(NexRLRole.TRAJECTORY_POOL)

    @property
    def algorithm_processor(self) -> BaseAlgorithmProcessor:
        return self._one(NexRLRole.ALGORITHM_PROCESSOR)

    @property
    def train_batch_pool(self) -> TrainBatchPool:
        return self._one(NexRLRole.TRAIN_BATCH_POOL)

    @property
    def train_worker(self) -> TrainWorker:
        return self._one(NexRLRole.TRAIN_WORKER)

    @property
    def scheduler(self) -> RolloutScheduler:
        """The rollout scheduler (placement role ``weight_sync_controller``)."""
        return self._one(NexRLRole.WEIGHT_SYNC_CONTROLLER)

    @property
    def validator(self) -> Validator:
        return self._one(NexRLRole.VALIDATOR)

    @property
    def rollout_workers(self) -> list[BaseRolloutWorker]:
        return self._rollout_workers


def run_controller(config: RLTrainConfig, runtime: Runtime | None = None) -> int:
    """Run the controller (rank 0 in mpi mode) and say how it ended; the process exit code. The run
    dir is this run's alone while it runs: another live run holding it is exit 2 (``run_alone``)."""
    return run_alone(config["run_dir"], lambda: _run_holding_the_run_dir(config, runtime))


def _run_holding_the_run_dir(config: RLTrainConfig, runtime: Runtime | None) -> int:
    controller = NexRLController(config, runtime)
    try:
        controller.run()
    except RunFailed as exc:
        logger.error("run failed: %s", exc)
        print(f"error: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(controller.exit_reason or "interrupted", file=sys.stderr)
        return controller.exit_code
    if controller.preempted:
        step = controller.current_step()
        requeued = controller.requeue()
        where = "the job is requeued and resumes there" if requeued else "run the same command to resume"
        print(f"stopped at step {step} ({controller.preemption_reason}): checkpoint saved; {where}")
        return PREEMPTED_EXIT
    summary = controller.final_validation()
    print(f"run dir: {controller.run_dir}")
    if summary:
        print("last validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(summary.items())))
    return 0
