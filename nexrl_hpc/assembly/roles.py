"""The role registry: which class builds which role, and how each is built from the config — the
same code on every launch mode and rank. Handed to the runtimes (``runtime.roles.RoleRegistry``)
by the controller (local mode) and the rank start-up (mpi mode)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.runtime.roles import RoleRegistry, RunContext
from nexrl_hpc.types import NexRLRole

if TYPE_CHECKING:
    from nexrl_hpc.trainer.trainer_rank import TrainerRank


def role_class(role: NexRLRole, config: RLTrainConfig) -> type:
    """The class a role is built from (also what a remote handle mirrors)."""
    if role in (NexRLRole.DATA_LOADER, NexRLRole.VALIDATE_DATALOADER):
        from nexrl_hpc.data.loader import DatasetLoader

        return DatasetLoader
    if role == NexRLRole.TRAJECTORY_POOL:
        from nexrl_hpc.pool.trajectory_pool import TrajectoryPool

        return TrajectoryPool
    if role == NexRLRole.ALGORITHM_PROCESSOR:
        from nexrl_hpc.algorithm.advantage_processor import AdvantageProcessor

        return AdvantageProcessor
    if role == NexRLRole.TRAIN_BATCH_POOL:
        from nexrl_hpc.pool.train_batch_pool import TrainBatchPool

        return TrainBatchPool
    if role == NexRLRole.TRAIN_WORKER:
        from nexrl_hpc.trainer.worker import TrainWorker

        return TrainWorker
    if role == NexRLRole.WEIGHT_SYNC_CONTROLLER:
        from nexrl_hpc.scheduler.rollout_scheduler import RolloutScheduler

        return RolloutScheduler
    if role == NexRLRole.VALIDATOR:
        from nexrl_hpc.validate.validator import Validator

        return Validator
    if role == NexRLRole.INFERENCE_SERVICE:
        from nexrl_hpc.inference.service import InferenceService

        return InferenceService
    if role == NexRLRole.ROLLOUT_WORKER:
        from nexrl_hpc.rollout.factory import rollout_worker_class

        return rollout_worker_class(config)
    if role == NexRLRole.REWARD_SERVICE:
        from nexrl_hpc.scoring.service import RewardService

        return RewardService
    raise ValueError(f"unknown role {role}")


def build_module(
    role: NexRLRole,
    config: RLTrainConfig,
    ctx: RunContext,
    trainer_group: tuple[str, bytes] | None = None,
    teacher_group: tuple[str, bytes] | None = None,
    critic_group: tuple[str, bytes] | None = None,
) -> Any:
    """``trainer_group`` / ``teacher_group``: (address of rank 0, job key) when the job runs its own
    trainer (teacher) ranks."""
    cls = role_class(role, config)
    if role in (NexRLRole.DATA_LOADER, NexRLRole.VALIDATE_DATALOADER):
        from nexrl_hpc.data.rows import prompt_length_filter

        is_validate = role == NexRLRole.VALIDATE_DATALOADER
        tokenizer, max_prompt_length = prompt_length_filter(config)  # long prompts: filtered at load time
        return cls(
            config["validate"]["data"] if is_validate else config["data"],
            is_validate=is_validate,
            data_files=ctx.validation_files if is_validate else ctx.train_files,
            tokenizer=tokenizer,
            max_prompt_length=max_prompt_length,
            model_path=config["model"]["path"],
        )
    if role == NexRLRole.ALGORITHM_PROCESSOR:
        return cls(config, pad_token_id=ctx.pad_token_id)
    if role == NexRLRole.TRAIN_WORKER:
        from nexrl_hpc.trainer.factory import create_teacher_client, create_train_service_client

        address, key = trainer_group if trainer_group is not None else (None, None)
        teacher_address, teacher_key = teacher_group if teacher_group is not None else (None, None)
        critic_address = critic_group[0] if critic_group is not None else None
        return cls(
            config,
            create_train_service_client(config, ctx.base_model_dir, address, key, critic_address),
            create_teacher_client(config, teacher_address, teacher_key),
        )
    if role == NexRLRole.INFERENCE_SERVICE:
        return cls(config, ctx.base_model_dir, ctx.run_dir)
    if role == NexRLRole.REWARD_SERVICE:
        return cls(config, ctx.run_dir)
    return cls(config)


def build_trainer_rank(config: RLTrainConfig, host: str, key: bytes, group: str = "trainer") -> TrainerRank:
    """This rank's TrainerRank around a PolicyTrainer (the critic group's: PPO's value trainer;
    torch.distributed is started by then)."""
    import torch

    from nexrl_hpc.rpc.preauth import WireLimits
    from nexrl_hpc.trainer.critic import ValueTrainer
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.trainer_rank import TrainerRank

    ts = config["service"]["train_service"]
    return TrainerRank(
        ValueTrainer() if group == "critic" else PolicyTrainer(),
        torch.device(ts["device"]),
        key,
        host=host,
        max_message_bytes=config["runtime"]["rpc"]["max_message_mb"] << 20,
        idle_tick_s=ts["idle_tick_s"],
        limits=WireLimits.from_config(config["runtime"]["rpc"]),
    )


ROLES = RoleRegistry(role_class=role_class, build_module=build_module, build_trainer_rank=build_trainer_rank)
"""The registry every runtime of this package is handed."""
