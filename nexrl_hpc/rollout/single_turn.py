"""SingleTurnRolloutWorker: one completion per task, scored by the task's reward function."""

from __future__ import annotations

from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.imports import load_object
from nexrl_hpc.rollout.base import BaseRolloutWorker


def normalize_scores(value: Any, spec: str) -> dict[str, float]:
    """A reward function may return a number or a dict with a "reward" entry."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward function {spec} returned a dict without 'reward': {sorted(value)}")
        return {k: float(v) for k, v in value.items()}
    return {"reward": float(value)}


class SingleTurnRolloutWorker(BaseRolloutWorker):
    def __init__(self, config: RLTrainConfig):
        super().__init__(config)
        self._reward_spec = config["rollout_worker"]["reward_fn"]
        self._reward_fn = load_object(self._reward_spec)

    async def step(self, task: dict[str, Any]) -> str | None:
        prompt = self._engine_prompt(task)  # chat messages: the chat template's token ids
        if prompt is None:
            return None
        assert self._llm_client is not None  # run() made it
        result = await self._llm_client.acompletion(prompt, **self._sampling_kwargs())
        scores = normalize_scores(self._reward_fn(task, result["response"]), self._reward_spec)
        return await self._aput_trajectory(self.make_trajectory(task, result, scores))
