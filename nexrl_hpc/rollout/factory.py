"""Rollout worker class for ``rollout_worker.type``."""

from __future__ import annotations

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.rollout.base import BaseRolloutWorker


def rollout_worker_class(config: RLTrainConfig) -> type[BaseRolloutWorker]:
    kind = config["rollout_worker"]["type"]
    if kind == "single_turn":
        from nexrl_hpc.rollout.single_turn import SingleTurnRolloutWorker

        return SingleTurnRolloutWorker
    if kind == "simple":
        from nexrl_hpc.rollout.simple import SimpleRolloutWorker

        return SimpleRolloutWorker
    if kind == "agent":
        from nexrl_hpc.rollout.agent import AgentRolloutWorker

        return AgentRolloutWorker
    if kind == "verifiers":
        from nexrl_hpc.rollout.verifiers import VerifiersRolloutWorker

        return VerifiersRolloutWorker
    if kind == "openenv":
        from nexrl_hpc.rollout.openenv import OpenEnvRolloutWorker

        return OpenEnvRolloutWorker
    raise ValueError(f"rollout_worker.type={kind!r} is not a known worker")
