"""Which TrainServiceClient a run gets: chosen by ``service.train_service.backend``.

Kept apart from the interface (``service``) because it imports the implementations, which import
the interface.
"""

from __future__ import annotations

import os

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.trainer.service import TrainServiceClient


def create_train_service_client(
    config: RLTrainConfig,
    base_model_dir: str,
    trainer_address: str | None = None,
    job_key: bytes | None = None,
) -> TrainServiceClient:
    """``local``: the policy trainer in this process (local mode) or the MPI job's trainer ranks (mpi mode:
    ``trainer_address`` is their rank 0); ``direct-zmq``: a standalone service at ``url``."""
    ts = config["service"]["train_service"]
    backend = ts["backend"]
    if backend == "noop":
        from nexrl_hpc.trainer.noop import NoopTrainService

        return NoopTrainService()
    if backend == "local" and trainer_address is None:
        from nexrl_hpc.trainer.policy_trainer import PolicyTrainer

        return PolicyTrainer(base_model_dir)
    from nexrl_hpc.trainer.group_client import ApiServerControl, Control, DirectControl, TrainGroupClient
    from nexrl_hpc.trainer.protocol import key_from_token

    address: str
    control: Control
    if backend == "local":
        assert trainer_address is not None and job_key is not None
        address, key, control = trainer_address, job_key, DirectControl()
    elif backend == "direct-zmq":
        token = os.environ.get(ts["token_env"], "")
        if not token:
            raise ValueError(
                f"service.train_service.backend=direct-zmq: the bearer token is read from the environment "
                f"variable {ts['token_env']!r} (service.train_service.token_env), which is not set"
            )
        url = ts["url"]
        assert url is not None  # the config checks require it for direct-zmq
        api = ApiServerControl(url, token, ts["identifier"], ts["heartbeat_timeout_s"])
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
