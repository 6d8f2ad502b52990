"""TrainBatchPool: processed batches waiting for the train worker, one FIFO queue per model tag."""

from __future__ import annotations

import threading
import time
from collections import deque

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import long_poll
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.types import DEFAULT_MODEL_TAG, Batch, ModelTag


class TrainBatchPool(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        self._max_queue_size = config["train_batch_pool"]["max_queue_size"]
        self._queues: dict[ModelTag, deque[Batch]] = {}
        self._lock = threading.Condition()

    def put_batch(self, batch: Batch) -> bool:
        """Queue ``batch`` for its model (metadata ``model_tag``); False when that queue is full."""
        tag = batch.metadata.get("model_tag") or DEFAULT_MODEL_TAG
        with self._lock:
            queue = self._queues.setdefault(tag, deque())
            if len(queue) >= self._max_queue_size:
                return False
            queue.append(batch)
            self._lock.notify_all()
            return True

    @long_poll
    def get_batch(self, model: ModelTag | None = DEFAULT_MODEL_TAG, wait_s: float = 0.0) -> Batch | None:
        """The oldest batch of ``model`` (any model if None); waits up to ``wait_s`` for one (long poll)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                tags = [model] if model is not None else list(self._queues)
                for tag in tags:
                    queue = self._queues.get(tag)
                    if queue:
                        return queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)

    def is_empty(self) -> bool:
        with self._lock:
            return all(not q for q in self._queues.values())

    def size(self, model: ModelTag | None = None) -> int:
        with self._lock:
            if model is not None:
                return len(self._queues.get(model, ()))
            return sum(len(q) for q in self._queues.values())
