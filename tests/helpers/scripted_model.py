"""TEST DOUBLE: a scripted "model" behind the RolloutEngine interface, with server-shaped token accounting.

It is not a model. Replies come from a script; token ids imitate a char-level server with a chat
template, so multi-turn bookkeeping can be checked against exact expected ids:

* a token id is the character's code point (``"a"`` -> 97); EOS is id 2 (the character ``"\\x02"``),
* the prompt is ``"{role}: {content}[\\x02 after assistant messages]\\n" ... + "assistant: "``
  (``eos_in_template=False`` drops the ``\\x02``, like a template that does not reproduce EOS),
* completion ids are the reply's characters, plus EOS when the finish reason is ``"stop"``,
* the logprob of token id t is ``-(t % 7 + 1) / 10`` (distinct, checkable values).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from nexrl_hpc.agents.rollout_engine import RolloutEngine
from nexrl_hpc.agents.types import ModelOutput

EOS = 2

Reply = str | tuple[str, str] | BaseException
"""Reply text, (text, finish_reason), or an exception to raise."""


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def logprob(token: int) -> float:
    return -((token % 7) + 1) / 10


def render(messages: list[dict[str, Any]], eos_in_template: bool = True) -> str:
    parts = []
    for m in messages:
        end = "\x02" if m["role"] == "assistant" and eos_in_template else ""
        parts.append(f"{m['role']}: {m['content']}{end}\n")
    return "".join(parts) + "assistant: "


class ScriptedModel(RolloutEngine):
    """Replies from ``script`` (a list consumed in order, or ``fn(messages, call_index) -> Reply``)."""

    def __init__(
        self,
        script: list[Reply] | Callable[[list[dict[str, Any]], int], Reply],
        eos_in_template: bool = True,
        delay_s: float = 0.0,
        weight_version: int | None = 0,
    ) -> None:
        self.script = script
        self.eos_in_template = eos_in_template
        self.delay_s = delay_s
        self.weight_version = weight_version
        self.calls: list[list[dict[str, Any]]] = []
        self.kwargs: list[dict[str, Any]] = []

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        index = len(self.calls)
        self.calls.append([dict(m) for m in messages])
        self.kwargs.append(dict(kwargs))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if callable(self.script):
            reply = self.script(messages, index)
        else:
            if index >= len(self.script):
                raise AssertionError(f"scripted model asked for reply {index}, script has {len(self.script)}")
            reply = self.script[index]
        if isinstance(reply, BaseException):
            raise reply
        text, finish = (reply, "stop") if isinstance(reply, str) else reply
        completion = ids(text) + ([EOS] if finish == "stop" else [])
        return ModelOutput(
            text=text,
            content=text,
            prompt_ids=ids(render(messages, self.eos_in_template)),
            completion_ids=completion,
            logprobs=[logprob(t) for t in completion],
            finish_reason=finish,
            weight_version=self.weight_version,
        )
