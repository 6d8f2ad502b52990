"""SingleTurnRolloutWorker: one completion per task, scored by ``rollout_worker.reward_fn``.

The reward runs on the RewardRunner's threads, not on the worker's event loop: a slow scorer
(math-verify, a sandbox) does not hold up the requests of the other steps in flight, and a reward
that raises, returns no number or runs past ``reward_timeout_s`` scores 0 and is counted
(``reward/errors``, ``reward/timeouts`` in every trajectory's scores).
"""

from __future__ import annotations

import asyncio
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.rewards.loader import load_reward
from nexrl_hpc.rewards.runner import RewardRunner
from nexrl_hpc.rollout.base import BaseRolloutWorker


class SingleTurnRolloutWorker(BaseRolloutWorker):
    def __init__(self, config: RLTrainConfig):
        super().__init__(config)
        rw = config["rollout_worker"]
        self._reward = load_reward(rw["reward_fn"], "rollout_worker.reward_fn")
        self._reward_timeout_s = rw["reward_timeout_s"]
        self._reward_threads = rw["reward_threads"]
        self._rewards: RewardRunner | None = None

    def _reward_runner(self) -> RewardRunner:
        """Made on first use, so a worker that never runs starts no threads."""
        if self._rewards is None:
            self._rewards = RewardRunner(
                self._reward, self._reward_timeout_s, self._reward_threads, f"{self._module_name}-reward"
            )
        return self._rewards

    def stop(self) -> None:
        super().stop()
        if self._rewards is not None:
            self._rewards.close()  # hung calls are left to their daemon threads
            self._rewards = None  # a later run starts a fresh pool

    async def step(self, task: dict[str, Any]) -> str | None:
        prompt = self._engine_prompt(task)  # chat messages: the chat template's token ids
        if prompt is None:
            return None
        assert self._llm_client is not None  # run() made it
        result = await self._llm_client.acompletion(prompt, **self._sampling_kwargs())
        self._mark_generated()
        scores = await asyncio.wrap_future(self._reward_runner().submit(task, result["response"]))
        return await self._aput_trajectory(self.make_trajectory(task, result, scores))
