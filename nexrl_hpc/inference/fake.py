"""A zero-latency stand-in for the inference service (benchmarks and tests only, never the default).

It answers like ``LLMServiceClient`` without any server: the "response" is one random digit and
EOS, token ids come from a fixed character map, logprobs are constants.
"""

from __future__ import annotations

import random
from typing import Any

EOS_ID = 2


class FakeLLMServiceClient:
    def __init__(self, model_tag: str, seed: int = 0, latency_s: float = 0.0):
        self._model_tag = model_tag
        self._rng = random.Random(seed)
        self._latency_s = latency_s
        self._version = 0
        self._prompt_ids: dict[str, list[int]] = {}

    def set_weight_sync_controller(self, controller: Any) -> None:
        self._controller = controller

    def _answer(self, prompt: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        digit = str(self._rng.randrange(10))
        if isinstance(prompt, str):
            prompt_ids = self._prompt_ids.get(prompt)
            if prompt_ids is None:
                prompt_ids = self._prompt_ids[prompt] = [1] + [ord(c) % 90 + 4 for c in prompt]
        else:
            prompt_ids = list(prompt)
        out = dict(kwargs)
        out.update(
            prompt=prompt,
            response=digit,
            finish_reason="stop",
            prompt_ids=prompt_ids,
            response_ids=[ord(digit) % 90 + 4, EOS_ID],
            logprobs=[-2.3, -0.1],
            weight_version=self._version,
            model_tag=self._model_tag,
        )
        return out

    def completion(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        if self._latency_s:
            import time

            time.sleep(self._latency_s)
        return self._answer(prompt, kwargs)

    async def acompletion(self, prompt: Any, **kwargs: Any) -> dict[str, Any]:
        if self._latency_s:
            import asyncio

            await asyncio.sleep(self._latency_s)
        return self._answer(prompt, kwargs)

    async def aclose(self) -> None:
        return None
