"""TrainBackend: the interface every training backend implements (the policy trainer, the trainer
group's client, the no-op trainer); the train worker (and tests) drive training through it.

Batches go in as ``{"batch": {name: tensor}, "meta_info": {...}}``; ``compute_log_prob`` returns
``{"batch": {"old_log_probs": tensor}}`` and ``update_actor`` ``{"meta_info": {"metrics": {...}}}``.
Backends are chosen by ``service.train_service.backend`` through ``factory.create_train_service_client``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any


class UpdateInFlight(ABC):
    """An ``update_actor`` handed to the backend; ``result`` waits for it and its export."""

    @abstractmethod
    def result(self) -> dict[str, Any]:
        """``update_actor``'s answer; ``meta_info["export_s"]``: the export's seconds (within the wait)."""

    @abstractmethod
    def done(self) -> bool:
        """The answer is in (``result`` returns without waiting)."""


class _DoneUpdate(UpdateInFlight):
    def __init__(self, answer: dict[str, Any]):
        self._answer = answer

    def done(self) -> bool:
        return True

    def result(self) -> dict[str, Any]:
        return self._answer


class TrainBackend(ABC):
    queues_updates = False  # True: start_update_actor returns before the update is done (see there)

    @abstractmethod
    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        """Send the final training config to the workers."""

    @abstractmethod
    def init_model(self) -> None:
        """Load the model and build the optimizer."""

    @abstractmethod
    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Log-probs of ``responses`` under the current weights."""

    @abstractmethod
    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One training step (PPO epochs x mini-batches) on ``batch``; returns metrics."""

    def start_update_actor(self, batch: dict[str, Any], export_path: str) -> UpdateInFlight:
        """``update_actor``, then ``export_weights(export_path)`` of the weights it made. A backend
        that ``queues_updates`` returns at once and takes the next call's batch behind this one
        (the trainer starts it when this one is exported); this one does both before returning."""
        answer = self.update_actor(batch)
        started = time.monotonic()
        if export_path:  # empty: weight.transport=broadcast, nothing written
            self.export_weights(export_path)
        answer.setdefault("meta_info", {})["export_s"] = time.monotonic() - started
        return _DoneUpdate(answer)

    @abstractmethod
    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        """HF-layout model under ``local_path/model``, optimizer state under ``local_path/optimizer``."""

    @abstractmethod
    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        """Restore what ``save_checkpoint`` wrote."""

    @abstractmethod
    def export_weights(self, path: str) -> None:
        """Write the current weights as an HF-layout directory (what inference servers reload)."""

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Send the current weights to the broadcast group ``spec`` (``weight_sync/wire.py``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot broadcast its weights")

    def health(self) -> bool:
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
