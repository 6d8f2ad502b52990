"""TrainServiceClient: how the train worker (and tests) drive a training backend (the training
service's methods).

Batches go in as ``{"batch": {name: tensor}, "meta_info": {...}}``; ``compute_log_prob`` returns
``{"batch": {"old_log_probs": tensor}}`` and ``update_actor`` ``{"meta_info": {"metrics": {...}}}``.
Backends are chosen by ``service.train_service.backend`` through ``factory.create_train_service_client``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class TrainServiceClient(ABC):
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

    @abstractmethod
    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        """HF-layout model under ``local_path/model``, optimizer state under ``local_path/optimizer``."""

    @abstractmethod
    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        """Restore what ``save_checkpoint`` wrote."""

    @abstractmethod
    def export_weights(self, path: str) -> None:
        """Write the current weights as an HF-layout directory (what inference servers reload)."""

    def health(self) -> bool:
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
