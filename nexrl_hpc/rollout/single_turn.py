"""SingleTurnRolloutWorker: one completion per task, scored by ``rollout_worker.reward_fn``.

The reward runs on the RewardRunner's threads, not on the worker's event loop: a slow scorer
(math-verify, a sandbox) does not hold up the requests of the other steps in flight, and a reward
that raises, returns no number or runs past ``reward_timeout_s`` scores 0 and is counted
(``reward/errors``, ``reward/timeouts`` in every trajectory's scores, with the sampled ids the
tokenizer has no token for: ``rollout/undecodable_tokens``). Responses that come back
together (one coalesced completion request) are scored as one submission and their scores come
back to the loop together: per-response hand-offs cost more than the default task's reward. A
batched reward (TRL's ``reward_func(completions, **kwargs)``) is called once for such a batch, with
each response's token ids (``completion_ids``). A trajectory whose reward call failed carries the
run's first reward error (``reward_error``: the function and its traceback), so the algorithm
processor can stop a run whose reward fails for most samples with the cause.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.bridge import FutureBridge
from nexrl_hpc.rewards.batched import COMPLETION_IDS
from nexrl_hpc.rewards.runner import ERRORS, RewardRunner
from nexrl_hpc.rollout.base import UNDECODABLE_TOKENS, BaseRolloutWorker
from nexrl_hpc.scoring.reward import run_reward
from nexrl_hpc.types import PutStatus


class SingleTurnRolloutWorker(BaseRolloutWorker):
    def __init__(self, config: RLTrainConfig):
        super().__init__(config)
        rw = config["rollout_worker"]
        self._reward, self._model_reward = run_reward(config)  # reward_fn, with reward_model's scorer
        self._reward_timeout_s = rw["reward_timeout_s"]
        self._reward_threads = rw["reward_threads"]
        self._rewards: RewardRunner | None = None
        self._to_score: list[tuple[dict[str, Any], str, asyncio.Future[dict[str, float]]]] = []
        self._bridge: FutureBridge | None = None

    def _reward_runner(self) -> RewardRunner:
        """Made on first use, so a worker that never runs starts no threads."""
        if self._rewards is None:
            self._rewards = RewardRunner(
                self._reward, self._reward_timeout_s, self._reward_threads, f"{self._module_name}-reward"
            )
        return self._rewards

    def set_reward_service(self, reward_service: Any) -> None:
        if self._model_reward is None:
            raise RuntimeError(f"{self._module_name}: reward_model.type is null, no reward service to call")
        self._model_reward.set_service(reward_service)

    def stop(self) -> None:
        super().stop()
        if self._rewards is not None:
            self._rewards.close()  # hung calls are left to their daemon threads
            self._rewards = None  # a later run starts a fresh pool

    async def step(self, task: dict[str, Any]) -> PutStatus | None:
        prompt = self._engine_prompt(task)  # chat messages: the chat template's token ids
        if prompt is None:
            return None
        assert self._llm_client is not None  # run() made it
        result = await self._llm_client.acompletion(prompt, **self._sampling_kwargs())
        self._mark_generated()
        scored_task = {**task, COMPLETION_IDS: result["response_ids"]} if self._reward.batched else task
        scores = await self._score(scored_task, result["response"])
        scores = {**scores, UNDECODABLE_TOKENS: self._undecodable_tokens(result["response_ids"])}
        trajectory = self.make_trajectory(task, result, scores)
        if scores.get(ERRORS) and self._rewards is not None:
            trajectory["reward_error"] = self._rewards.first_error
        return await self._aput_trajectory(trajectory)

    async def _score(self, task: dict[str, Any], response: str) -> dict[str, float]:
        """The reward's score dict; responses scored in the same turn of the loop go out together."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[dict[str, float]] = loop.create_future()
        if not self._to_score:
            loop.call_soon(self._submit_scores)
        self._to_score.append((task, response, waiter))
        return await waiter

    def _submit_scores(self) -> None:
        batch, self._to_score = self._to_score, []
        loop = asyncio.get_running_loop()
        if self._bridge is None or self._bridge.loop is not loop:
            self._bridge = FutureBridge(loop)
        try:
            futures = self._reward_runner().submit_many([(task, response) for task, response, _ in batch])
        except Exception as exc:  # the runner was closed (the worker stops)
            for _, _, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        for (_, _, waiter), future in zip(batch, futures):
            self._bridge.deliver(future, waiter)
