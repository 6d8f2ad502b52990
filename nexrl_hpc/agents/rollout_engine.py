"""RolloutEngine: ``await get_model_response(messages) -> ModelOutput``.

Workflows only see this interface, so they run the same against the real inference client and
against a scripted test double.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from nexrl_hpc.agents.agent import TOOL_CALL_ERROR
from nexrl_hpc.agents.tool_format import parse_openai_tool_calls
from nexrl_hpc.agents.types import ModelOutput, ToolCall


def model_output_from_result(result: dict[str, Any]) -> ModelOutput:
    """A ModelOutput from ``LLMServiceClient.completion``/``generate`` results (keys ``response``, ``response_ids``, ...).

    Tool calls in the OpenAI shape (``{"function": {"name", "arguments": "<json>"}}``) are parsed
    here; malformed ones raise ``ValueError`` naming the call — callers that must not crash use
    ``nexrl_hpc.agents.tool_format.parse_openai_tool_calls`` to get error observations instead.
    """
    for key in ("response", "prompt_ids", "response_ids", "logprobs"):
        if key not in result:
            raise KeyError(f"inference result has no {key!r} (keys: {sorted(result)})")
    completion_ids = [int(t) for t in result["response_ids"]]
    logprobs = [float(x) for x in result["logprobs"]]
    if len(logprobs) != len(completion_ids):
        raise ValueError(
            f"inference result has {len(logprobs)} logprobs for {len(completion_ids)} completion tokens"
        )
    parsed = parse_openai_tool_calls(result.get("tool_calls") or [])
    if parsed.errors:
        raise ValueError("; ".join(e.message for e in parsed.errors))
    content = result["response"] or ""
    reasoning = result.get("reasoning") or ""
    text = f"{reasoning}{content}" if reasoning else content
    return ModelOutput(
        text=text,
        content=content,
        reasoning=reasoning,
        tool_calls=parsed.calls,
        prompt_ids=[int(t) for t in result["prompt_ids"]],
        completion_ids=completion_ids,
        logprobs=logprobs,
        finish_reason=result.get("finish_reason"),
        weight_version=result.get("weight_version"),
    )


class RolloutEngine(ABC):
    @abstractmethod
    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput: ...


class ClientRolloutEngine(RolloutEngine):
    """Chat completions through ``LLMServiceClient.agenerate``; ``sampling`` are default request kwargs.

    The server applies its chat template; ids and logprobs are taken from its answer unchanged.
    OpenAI ``tool_calls`` that do not parse become ``TOOL_CALL_ERROR`` pseudo calls in
    ``ModelOutput.tool_calls`` (the ToolEnvironment answers them with an error observation)
    instead of failing the episode.
    """

    def __init__(self, client: Any, **sampling: Any) -> None:
        if not hasattr(client, "agenerate"):
            raise TypeError(f"client {type(client).__name__} has no agenerate(messages, **kwargs)")
        self.client = client
        self.sampling = sampling

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        result = dict(await self.client.agenerate(messages, **{**self.sampling, **kwargs}))
        parsed = parse_openai_tool_calls(result.pop("tool_calls", None) or [])
        output = model_output_from_result(result)
        output.tool_calls = parsed.calls + [
            ToolCall(name=TOOL_CALL_ERROR, arguments={"message": e.message, "tool": e.name})
            for e in parsed.errors
        ]
        return output
