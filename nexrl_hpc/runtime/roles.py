"""What the runtimes need to know about roles, without knowing the classes that fill them.

Which class builds which role is the composition's knowledge (``nexrl_hpc.assembly.roles``); the
runtimes are handed it as a ``RoleRegistry``, so that ``runtime/`` imports none of the modules it
places and starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.types import NexRLRole

if TYPE_CHECKING:
    from nexrl_hpc.trainer.trainer_rank import TrainerRank


@dataclass
class RunContext:
    """Facts decided once at start-up (rank 0) that every module builder needs."""

    run_dir: str
    base_model_dir: str
    train_files: list[str]
    validation_files: list[str]
    pad_token_id: int


class RoleClass(Protocol):
    def __call__(self, role: NexRLRole, config: RLTrainConfig) -> type:
        """The class a role is built from (also what a remote handle mirrors)."""
        ...


class ModuleBuilder(Protocol):
    def __call__(
        self,
        role: NexRLRole,
        config: RLTrainConfig,
        ctx: RunContext,
        trainer_group: tuple[str, bytes] | None = None,
        teacher_group: tuple[str, bytes] | None = None,
        critic_group: tuple[str, bytes] | None = None,
    ) -> Any:
        """One module of ``role``; ``trainer_group`` / ``teacher_group`` / ``critic_group``: (address
        of rank 0, job key) when the job runs its own trainer (teacher, critic) ranks."""
        ...


class TrainerRankBuilder(Protocol):
    def __call__(self, config: RLTrainConfig, host: str, key: bytes, group: str = "trainer") -> TrainerRank:
        """This rank's trainer (torch.distributed already started over its group ``group``); rank 0
        binds on ``host`` the socket the train worker sends batches to."""
        ...


@dataclass(frozen=True)
class RoleRegistry:
    """The builders a runtime is handed: the class of a role, a module of a role, a trainer rank."""

    role_class: RoleClass
    build_module: ModuleBuilder
    build_trainer_rank: TrainerRankBuilder


def local_role_counts(config: RLTrainConfig) -> dict[NexRLRole, int]:
    """Instances per role in local mode (mpi: the placement decides)."""
    return {
        NexRLRole.DATA_LOADER: 1,
        NexRLRole.VALIDATE_DATALOADER: 1,
        NexRLRole.TRAJECTORY_POOL: 1,
        NexRLRole.ALGORITHM_PROCESSOR: 1,
        NexRLRole.TRAIN_BATCH_POOL: 1,
        NexRLRole.TRAIN_WORKER: config["train_worker"]["num_workers"],
        NexRLRole.WEIGHT_SYNC_CONTROLLER: 1,
        NexRLRole.VALIDATOR: 1,
        NexRLRole.INFERENCE_SERVICE: 1,
        NexRLRole.ROLLOUT_WORKER: config["rollout_worker"]["num_workers"],
        # reward_model.placement=own_ranks: one in-process service (the judge's server started by it)
        NexRLRole.REWARD_SERVICE: int(
            config["reward_model"]["type"] is not None and config["reward_model"]["placement"] == "own_ranks"
        ),
    }
