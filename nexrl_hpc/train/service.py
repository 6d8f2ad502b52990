"""TrainServiceClient: how the train worker (and tests) drive a training backend (seed 002's methods).

Batches go in as ``{"batch": {name: tensor}, "meta_info": {...}}``; ``compute_log_prob`` returns
``{"batch": {"old_log_probs": tensor}}`` and ``update_actor`` ``{"meta_info": {"metrics": {...}}}``.
Backends are chosen by ``service.train_service.backend`` through ``create_train_service_client``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig


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


def create_train_service_client(
    config: RLTrainConfig,
    base_model_dir: str,
    trainer_address: str | None = None,
    job_key: bytes | None = None,
) -> TrainServiceClient:
    """``local``: the engine in this process (local mode) or the MPI job's trainer ranks (mpi mode:
    ``trainer_address`` is their rank 0); ``direct-zmq``: a standalone service at ``url``."""
    ts = config["service"]["train_service"]
    backend = ts["backend"]
    if backend == "noop":
        from nexrl_hpc.train.noop import NoopTrainService

        return NoopTrainService()
    if backend == "local" and trainer_address is None:
        from nexrl_hpc.train.local_engine import LocalTrainEngine

        return LocalTrainEngine(base_model_dir)
    from nexrl_hpc.train.group_client import ApiServerControl, Control, DirectControl, TrainGroupClient
    from nexrl_hpc.train.protocol import key_from_token

    control: Control
    if backend == "local":
        assert job_key is not None
        address, key, control = trainer_address, job_key, DirectControl()
    elif backend == "direct-zmq":
        token = os.environ.get(ts["token_env"], "")
        if not token:
            raise ValueError(
                f"service.train_service.backend=direct-zmq: the bearer token is read from the environment "
                f"variable {ts['token_env']!r} (service.train_service.token_env), which is not set"
            )
        api = ApiServerControl(ts["url"], token, ts["identifier"], ts["heartbeat_timeout_s"])
        info = api.wait_ready(ts["connect_timeout_s"])
        address, key, control = info["endpoints"]["0"], key_from_token(token, ts["identifier"]), api
    else:
        raise ValueError(f"service.train_service.backend={backend!r} is not available")
    return TrainGroupClient(
        address,
        key,
        control,
        recv_timeout_ms=ts["config"]["zmq_recv_timeout_ms"],
        total_timeout_ms=ts["config"]["zmq_total_timeout_ms"],
        max_message_bytes=config["runtime"]["rpc"]["max_message_mb"] << 20,
        model_path=base_model_dir,
    )
