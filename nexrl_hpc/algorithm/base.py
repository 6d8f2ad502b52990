"""BaseAlgorithmProcessor: pulls complete batches from the trajectory pool, fits them, queues them for training."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.types import Batch

if TYPE_CHECKING:
    import torch

    from nexrl_hpc.pool.interfaces import TrainBatchPoolRef, TrajectoryPoolRef

logger = logging.getLogger(__name__)


class BaseAlgorithmProcessor(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        self._config = config
        self._long_poll_s = config["algorithm"]["long_poll_s"]
        # module references: the module itself in local mode, a handle with its methods elsewhere
        self._trajectory_pool: TrajectoryPoolRef | None = None
        self._train_batch_pool: TrainBatchPoolRef | None = None

    def set_module_references(
        self, trajectory_pool: TrajectoryPoolRef, train_batch_pool: TrainBatchPoolRef
    ) -> None:
        self._trajectory_pool = trajectory_pool
        self._train_batch_pool = train_batch_pool

    def run(self) -> None:
        self._start_thread(self._loop)

    def stop(self) -> None:
        self._stop_thread(timeout=self._config["algorithm"]["stop_timeout_s"])

    def _loop(self) -> None:
        while not self.stopped:
            batch = self._get_batch(wait_s=self._long_poll_s)
            if batch is None:
                continue
            assert self._activity_tracker is not None
            with self._activity_tracker.track(self._module_name, "fit"):
                self._fit(batch)

    def _fit(self, batch: Batch[list[Any]]) -> None:
        raise NotImplementedError

    def _get_batch(self, batch_size: int | None = None, wait_s: float = 0.0) -> Batch[list[Any]] | None:
        assert self._trajectory_pool is not None
        return execute(self._trajectory_pool.get_batch_any, batch_size, wait_s)

    def _put_batch(self, batch: Batch[torch.Tensor]) -> bool:
        """Queue for training; waits (without busy spinning) while the train batch queue is full."""
        assert self._train_batch_pool is not None
        while not self.stopped:
            if execute(self._train_batch_pool.put_batch, batch):
                return True
            time.sleep(
                self._config["algorithm"]["full_queue_poll_s"]
            )  # the train batch queue is full: back-pressure
        return False
