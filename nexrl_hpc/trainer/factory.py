"""Which TrainBackend a run gets: chosen by ``service.train_service.backend`` (the policy) and
``service.train_service.teacher_service.backend`` (on-policy distillation's teacher).

Kept apart from the interface (``service``) because it imports the implementations, which import
the interface.
"""

from __future__ import annotations

import os
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.trainer.backend import TrainBackend


def create_train_service_client(
    config: RLTrainConfig,
    base_model_dir: str,
    trainer_address: str | None = None,
    job_key: bytes | None = None,
    critic_address: str | None = None,
) -> TrainBackend:
    """``local``: the policy trainer in this process (local mode) or the MPI job's trainer ranks (mpi mode:
    ``trainer_address`` is their rank 0); ``direct-zmq``: a standalone service at ``url``. PPO
    (``adv_estimator=gae``): with its critic, in this process or the job's critic ranks
    (``critic_address``)."""
    ts = config["service"]["train_service"]
    if ts["backend"] == "noop":
        from nexrl_hpc.trainer.noop import NoopTrainService

        return NoopTrainService()
    client = _client(
        config,
        "service.train_service",
        ts["backend"],
        ts["url"],
        ts["identifier"],
        base_model_dir,
        trainer_address,
        job_key,
    )
    if config["algorithm"]["adv_estimator"] == "gae":  # PPO: the critic beside the actor
        from nexrl_hpc.trainer.critic import ValueTrainer
        from nexrl_hpc.trainer.ppo_backend import PPOBackend

        model_dir = ts["critic"]["model_path"] or base_model_dir
        critic: TrainBackend | None
        if ts["critic"]["head_on_policy"]:  # the value head on the policy: no critic of its own
            critic = None
        elif critic_address is None:  # in this process
            critic = ValueTrainer(model_dir)
        else:  # the MPI job's critic ranks
            assert job_key is not None
            critic = group_client(config, critic_address, job_key, model_dir)
        return PPOBackend.from_config(config, client, critic)
    return client


def create_teacher_client(
    config: RLTrainConfig, teacher_address: str | None = None, job_key: bytes | None = None
) -> TrainBackend | None:
    """On-policy distillation's teacher (None without ``algorithm.teacher_model_path``): in this process,
    the MPI job's teacher ranks (``teacher_address`` is their rank 0), or a standalone service's worker
    group under its own identifier."""
    path = config["algorithm"]["teacher_model_path"]
    if path is None:
        return None
    teacher = config["service"]["train_service"]["teacher_service"]
    return _client(
        config,
        "service.train_service.teacher_service",
        teacher["backend"],
        teacher["url"],
        teacher["identifier"],
        path,
        teacher_address,
        job_key,
    )


def _client(
    config: RLTrainConfig,
    service_key: str,
    backend: str,
    url: str | None,
    identifier: str,
    model_dir: str,
    address: str | None,
    job_key: bytes | None,
) -> TrainBackend:
    if backend == "local" and address is None:
        from nexrl_hpc.trainer.policy_trainer import PolicyTrainer

        return PolicyTrainer(model_dir)
    from nexrl_hpc.trainer.group_client import ApiServerControl, Control
    from nexrl_hpc.trainer.protocol import key_from_token

    ts = config["service"]["train_service"]
    if backend == "local":
        assert address is not None and job_key is not None
        return group_client(config, address, job_key, model_dir)
    if backend == "direct-zmq":
        token = os.environ.get(ts["token_env"], "")
        if not token:
            raise ValueError(
                f"{service_key}.backend=direct-zmq: the bearer token is read from the environment "
                f"variable {ts['token_env']!r} (service.train_service.token_env), which is not set"
            )
        assert url is not None  # the config checks require it for direct-zmq
        api = ApiServerControl(url, token, identifier, ts["heartbeat_timeout_s"])
        control: Control
        info = api.wait_ready(ts["connect_timeout_s"])
        address, key, control = (
            info["endpoints"]["0"],
            key_from_token(token, identifier, info["session"]),
            api,
        )
    else:
        raise ValueError(f"{service_key}.backend={backend!r} is not available")
    return _group_client(config, address, key, control, model_dir)


def group_client(config: RLTrainConfig, address: str, job_key: bytes, model_dir: str) -> TrainBackend:
    """The client of one of the MPI job's own trainer groups (its rank 0 at ``address``)."""
    from nexrl_hpc.trainer.group_client import DirectControl

    return _group_client(config, address, job_key, DirectControl(), model_dir)


def _group_client(
    config: RLTrainConfig, address: str, key: bytes, control: Any, model_dir: str
) -> TrainBackend:
    from nexrl_hpc.rpc.preauth import WireLimits
    from nexrl_hpc.trainer.group_client import TrainGroupClient

    ts = config["service"]["train_service"]
    return TrainGroupClient(
        address,
        key,
        control,
        recv_timeout_ms=ts["config"]["zmq_recv_timeout_ms"],
        total_timeout_ms=ts["config"]["zmq_total_timeout_ms"],
        max_message_bytes=config["runtime"]["rpc"]["max_message_mb"] << 20,
        limits=WireLimits.from_config(config["runtime"]["rpc"]),
        model_path=model_dir,
    )
