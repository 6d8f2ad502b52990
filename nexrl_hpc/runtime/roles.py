"""How each role's module is built from the config — the same code on every launch mode and rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.types import NexRLRole


@dataclass
class RunContext:
    """Facts decided once at start-up (rank 0) that every module builder needs."""

    run_dir: str
    base_model_dir: str
    train_files: list[str]
    validation_files: list[str]
    pad_token_id: int


def role_counts(config: RLTrainConfig) -> dict[NexRLRole, int]:
    return {
        NexRLRole.DATA_LOADER: 1,
        NexRLRole.VALIDATE_DATALOADER: 1,
        NexRLRole.TRAJECTORY_POOL: 1,
        NexRLRole.ALGORITHM_PROCESSOR: 1,
        NexRLRole.TRAIN_BATCH_POOL: 1,
        NexRLRole.TRAIN_WORKER: config["train_worker"]["num_workers"],
        NexRLRole.WEIGHT_SYNC_CONTROLLER: 1,
        NexRLRole.VALIDATOR: 1,
        NexRLRole.ROLLOUT_WORKER: config["rollout_worker"]["num_workers"],
    }


def build_module(role: NexRLRole, config: RLTrainConfig, ctx: RunContext) -> Any:
    if role == NexRLRole.DATA_LOADER:
        from nexrl_hpc.data.loader import JsonlDataLoader

        return JsonlDataLoader(config["data"], is_validate=False, data_files=ctx.train_files)
    if role == NexRLRole.VALIDATE_DATALOADER:
        from nexrl_hpc.data.loader import JsonlDataLoader

        return JsonlDataLoader(config["validate"]["data"], is_validate=True, data_files=ctx.validation_files)
    if role == NexRLRole.TRAJECTORY_POOL:
        from nexrl_hpc.pool.trajectory_pool import TrajectoryPool

        return TrajectoryPool(config)
    if role == NexRLRole.ALGORITHM_PROCESSOR:
        from nexrl_hpc.algorithm.grpo import GRPOProcessor

        return GRPOProcessor(config, pad_token_id=ctx.pad_token_id)
    if role == NexRLRole.TRAIN_BATCH_POOL:
        from nexrl_hpc.pool.train_batch_pool import TrainBatchPool

        return TrainBatchPool(config)
    if role == NexRLRole.TRAIN_WORKER:
        from nexrl_hpc.train.service import create_train_service_client
        from nexrl_hpc.train.worker import TrainWorker

        return TrainWorker(config, create_train_service_client(config, ctx.base_model_dir))
    if role == NexRLRole.WEIGHT_SYNC_CONTROLLER:
        from nexrl_hpc.weight_sync.controller import WeightSyncController
        from nexrl_hpc.weight_sync.transport import create_weight_transport

        service = config["service"]["inference_service"]
        return WeightSyncController(
            config, create_weight_transport(service["backend"], service["request_timeout_s"])
        )
    if role == NexRLRole.VALIDATOR:
        from nexrl_hpc.validate.validator import Validator

        return Validator(config)
    if role == NexRLRole.ROLLOUT_WORKER:
        from nexrl_hpc.rollout.factory import create_rollout_worker

        return create_rollout_worker(config)
    raise ValueError(f"unknown role {role}")
