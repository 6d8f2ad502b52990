"""A stand-in for the inference service (benchmarks and tests only, never the default).

It answers like ``LLMServiceClient`` without any server, after ``latency_s``: the "response" is
one random character of the tokenizer's alphabet and EOS, with the run's real token ids (so a real
trainer can train on them) and constant logprobs.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from nexrl_hpc.core.execute import execute
from nexrl_hpc.inference.version import RolloutVersionLookup

if TYPE_CHECKING:
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef


class FakeLLMServiceClient:
    def __init__(self, model_tag: str, tokenizer: Any, seed: int = 0, latency_s: float = 0.0):
        self._model_tag = model_tag
        self._tokenizer = tokenizer
        self._choices = [
            (tok, idx)
            for tok, idx in tokenizer.get_vocab().items()
            if idx not in set(tokenizer.all_special_ids)
        ]
        self._eos = tokenizer.eos_token_id
        self._rng = random.Random(seed)
        self._latency_s = latency_s
        self._scheduler: RolloutSchedulerRef | None = None  # the module, or a handle to it
        self._version_lookup = RolloutVersionLookup(model_tag)
        self.in_flight = 0  # requests being answered now, the most at once, and the threads then
        self.peak_in_flight = 0
        self.threads_at_peak = 0
        self._prompt_ids: dict[str, list[int]] = {}

    def set_scheduler(self, scheduler: RolloutSchedulerRef | None) -> None:
        self._scheduler = scheduler
        self._version_lookup.set_scheduler(scheduler)

    def _version(self) -> int:
        """The version the (imaginary) engine serves: the rollout scheduler's rollout version."""
        if self._scheduler is None:
            return 0
        return int(execute(self._scheduler.get_rollout_model_version, self._model_tag))

    def _answer(self, prompt: Any, kwargs: dict[str, Any], version: int) -> dict[str, Any]:
        text, token = self._choices[self._rng.randrange(len(self._choices))]
        if isinstance(prompt, str):
            prompt_ids = self._prompt_ids.get(prompt)
            if prompt_ids is None:
                prompt_ids = self._prompt_ids[prompt] = self._tokenizer(prompt).input_ids
        else:
            prompt_ids = list(prompt)
        out = dict(kwargs)
        out.update(
            prompt=prompt,
            response=text,
            finish_reason="stop",
            prompt_ids=prompt_ids,
            response_ids=[token, self._eos],
            logprobs=[-2.3, -0.1],
            weight_version=version,
            model_tag=self._model_tag,
        )
        return out

    def completion(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        version = self._version()  # the weights a request starts with produce all of its tokens
        if self._latency_s:
            time.sleep(self._latency_s)
        return self._answer(prompt, kwargs, version)

    async def acompletion(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        version = await self._version_lookup.read() or 0
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight, self.threads_at_peak = self.in_flight, threading.active_count()
        try:
            if self._latency_s:
                await asyncio.sleep(self._latency_s)
            return self._answer(prompt, kwargs, version)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        return None
