"""SimpleRolloutWorker: one completion per task; the trajectory carries the task's own reward, if any."""

from __future__ import annotations

from typing import Any

from nexrl_hpc.rollout.base import BaseRolloutWorker
from nexrl_hpc.types import PutStatus


class SimpleRolloutWorker(BaseRolloutWorker):
    async def step(self, task: dict[str, Any]) -> PutStatus | None:
        prompt = self._engine_prompt(task)  # chat messages: the chat template's token ids
        if prompt is None:
            return None
        assert self._llm_client is not None  # run() made it
        result = await self._llm_client.acompletion(prompt, **self._sampling_kwargs())
        reward = float(task.get("reward", 0.0))
        return await self._aput_trajectory(self.make_trajectory(task, result, {"reward": reward}))
