"""Validator: collects validation trajectories and reports the mean of each score as ``val/<score>``
(and a few of the answers: ``samples/validation_step_<N>.jsonl``, tracking/samples.py)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute, long_poll, quick
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.rewards.loader import SKIPPED
from nexrl_hpc.tracking.samples import VALIDATION, VALIDATION_SAMPLES, validation_samples, write_samples
from nexrl_hpc.types import PutStatus, Trajectory

if TYPE_CHECKING:
    from nexrl_hpc.data.interfaces import DataLoaderRef


class Validator(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        self._config = config
        self._samples_per_step = config["logger"]["samples_per_step"]
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._trajectories: list[Trajectory] = []
        self._validate_dataloader: DataLoaderRef | None = None  # the module, or a handle to it

    def set_module_references(self, validate_dataloader: DataLoaderRef) -> None:
        self._validate_dataloader = validate_dataloader

    def put_trajectory(self, trajectory: Trajectory) -> PutStatus:
        with self._lock:
            self._trajectories.append(trajectory)
            self._arrived.notify_all()
        return PutStatus.SUCCESS

    def put_trajectories(self, trajectories: list[Trajectory]) -> list[PutStatus]:
        with self._lock:
            self._trajectories.extend(trajectories)
            self._arrived.notify_all()
        return [PutStatus.SUCCESS] * len(trajectories)

    @quick
    def num_collected(self) -> int:
        with self._lock:
            return len(self._trajectories)

    def is_complete(self) -> bool:
        """Every validation task came back, or all were handed out and every worker is done with its
        share (a task whose step failed for good counts as done: it was reported)."""
        assert self._validate_dataloader is not None
        if self.num_collected() >= execute(self._validate_dataloader.total_tasks):
            return True
        return execute(self._validate_dataloader.is_finished) and not execute(
            self._validate_dataloader.outstanding
        )

    @long_poll
    def wait_complete(self, timeout: float) -> bool:
        """Long poll for the controller: ``is_complete()``, waiting up to ``timeout`` for it."""
        deadline = time.monotonic() + timeout
        while not self.is_complete():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._arrived:  # woken by every arrival; re-checked often for failed tasks
                self._arrived.wait(min(remaining, 0.02))
        return True

    def compute_metrics(self) -> dict[str, float]:
        with self._lock:
            trajectories = list(self._trajectories)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for traj in trajectories:
            scores = traj.get("scores") or {"reward": traj.get("reward", 0.0)}
            skipped = bool(scores.get(SKIPPED))  # the reward returned None: no score to average
            for key, value in scores.items():
                if skipped and key == "reward":
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    sums[key] = sums.get(key, 0.0) + float(value)
                    counts[key] = counts.get(key, 0) + 1
        metrics = {f"val/{k}": sums[k] / counts[k] for k in sums}
        metrics["val/num_samples"] = len(trajectories)
        if self._validate_dataloader is not None:  # too long prompts are left out, and counted
            metrics["val/filtered_long_prompts"] = execute(
                self._validate_dataloader.get_filtered_long_prompts
            )
        return metrics

    def compute_and_log_metrics(self, step: int | None = None) -> dict[str, float]:
        metrics = self.compute_metrics()
        if self._activity_tracker is not None:
            if step is None:
                step = self._activity_tracker.get_training_step()
            self._activity_tracker.experiment_logger_post("all", data=metrics, step=step)
            if self._samples_per_step:  # a few of the validation's answers, as the training steps'
                with self._lock:
                    rows = validation_samples(self._trajectories, step, self._samples_per_step)
                write_samples(self._config["run_dir"], step, rows, VALIDATION)
                self._activity_tracker.experiment_logger_samples(step, rows, VALIDATION_SAMPLES)
        return metrics

    def clear(self) -> None:
        with self._lock:
            self._trajectories.clear()
