"""VerifiersRolloutWorker (``rollout_worker.type=verifiers``): one verifiers episode per task.

The environment runs in verifiers' own venv (``nexrl_hpc.hub.verifiers_env``); this worker starts
its process with the engine's endpoint and key, sends each task's index with the worker's sampling
of the moment (training or greedy validation), and puts the episode into the pool as one training
sequence: the tokens the engine sampled trained, the rest masked, the environment's rubric as the
reward. Its rows come from the taskset itself (``data.type=verifiers``: ``verifiers_task`` holds the
index). An episode in which the model sampled nothing (its errors in the worker's log and the
run's) is dropped and reported, like any step that returns nothing; one that failed after it
sampled counts as a failed reward (``episode_trajectory``). The rubric's parts and metrics ride in
the trajectory's scores (``verifiers/reward/<name>``, ``verifiers/metric/<name>``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute
from nexrl_hpc.hub.verifiers_env import (
    KEY,
    TASK_INDEX,
    VerifiersEnvError,
    VerifiersEnvProcess,
    episode_errors,
    episode_trajectory,
    worker_init,
)
from nexrl_hpc.inference.version import RolloutVersionLookup
from nexrl_hpc.models.run_tokenizer import load_run_tokenizer
from nexrl_hpc.rollout.base import UNDECODABLE_TOKENS, BaseRolloutWorker
from nexrl_hpc.types import PutStatus, Trajectory

logger = logging.getLogger(__name__)


class VerifiersRolloutWorker(BaseRolloutWorker):
    def __init__(self, config: RLTrainConfig):
        super().__init__(config)
        self._env: VerifiersEnvProcess | None = None
        self._versions = RolloutVersionLookup(self._model_tag)

    def set_module_references(
        self, trajectory_pool: Any, dataloader: Any, scheduler: Any, *rest: Any
    ) -> None:
        super().set_module_references(trajectory_pool, dataloader, scheduler, *rest)
        self._versions.set_scheduler(scheduler)

    def run(self) -> None:
        if self._env is None:
            if self._inference_service is None:
                raise RuntimeError(f"{self._module_name}: set_inference_service must be called before run")
            base_url, api_key = execute(self._inference_service.get_endpoint)
            if base_url is None:
                raise VerifiersEnvError(f"{KEY}: the inference service has no endpoint for the environment")
            cfg = self._config
            log = os.path.join(cfg["run_dir"], "logs", f"verifiers_{self._module_name}.log")
            env = VerifiersEnvProcess(
                cfg["rollout_worker"]["verifiers"], worker_init(cfg, base_url), log, api_key
            )
            ready = env.start()
            logger.info("%s: verifiers environment ready: %s", self._module_name, ready)
            self._env = env
        super().run()

    def stop(self) -> None:
        super().stop()
        if self._env is not None:
            self._env.close()
            self._env = None

    async def step(self, task: dict[str, Any]) -> PutStatus | None:
        index = task.get(TASK_INDEX)
        if not isinstance(index, int):
            raise VerifiersEnvError(
                f"task uid={task.get('uid')!r} has no {TASK_INDEX!r} index: {KEY} takes its rows from the "
                "taskset (data.type=verifiers)"
            )
        assert self._env is not None  # run() started it
        version = await self._versions.read()
        sampling = self._sampling_kwargs()
        record = await self._env.aepisode(index, sampling)
        self._mark_generated()
        fields = episode_trajectory(record)
        if fields is None:
            logger.warning(
                "%s: the episode of task %d gave nothing to train on: %s",
                self._module_name,
                index,
                "; ".join(episode_errors(record)) or "the model sampled no token",
            )
            return None
        if self._tokenizer is None:
            self._tokenizer = load_run_tokenizer(self._config["model"])
        response = self._tokenizer.decode(fields["response_ids"], skip_special_tokens=True)
        fields["scores"][UNDECODABLE_TOKENS] = self._undecodable_tokens(fields["response_ids"])
        rollout = {**fields, "model_tag": self._model_tag, "weight_version": version, "response": response}
        return await self._aput_trajectory(cast(Trajectory, {**task, **rollout}))
