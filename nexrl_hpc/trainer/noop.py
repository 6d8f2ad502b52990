"""A train service that trains nothing (benchmarks of the data path only; never a default).

It accepts the same calls as a real backend, checks the batch shape like one, and returns at once.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nexrl_hpc.trainer.backend import TrainBackend
from nexrl_hpc.trainer.batch_contract import REQUIRED_KEYS, check_training_batch


class NoopTrainService(TrainBackend):
    def __init__(self) -> None:
        self.batches_seen = 0
        self.trajectories_seen = 0

    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        self._cfg = config_dict

    def init_model(self) -> None:
        return None

    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {
            "batch": {"old_log_probs": torch.zeros_like(batch["batch"]["responses"], dtype=torch.float32)},
            "meta_info": {},
        }

    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = check_training_batch(batch["batch"], REQUIRED_KEYS)
        self.batches_seen += 1
        self.trajectories_seen += n
        metrics = {
            "actor/loss": 0.0,
            "actor/pg_loss": 0.0,
            "actor/grad_norm": 0.0,
            "actor/nan_skipped": 0,
            "actor/lr": 0.0,
        }
        return {"meta_info": {"metrics": metrics}}

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        os.makedirs(os.path.join(local_path, "model"), exist_ok=True)

    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        return None

    def export_weights(self, path: str) -> None:
        return None

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {"bytes": 0, "buckets": 0, "seconds": 0.0}
