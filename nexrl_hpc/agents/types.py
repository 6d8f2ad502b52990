"""Episode data of the agent model: ToolCall, ModelOutput, Step, Trajectory, Episode.

Everything here is plain data with ``to_dict``/``from_dict`` so an episode can be dumped to JSON,
shipped between ranks and loaded back unchanged. Token ids and log-probs are the engine's, copied
from the inference client's result dict, never recomputed by tokenising text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class ToolCall:
    """One function call the model asked for; ``id`` is the OpenAI call id when the server gave one."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments), "id": self.id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        return cls(name=data["name"], arguments=dict(data.get("arguments") or {}), id=data.get("id"))

    def to_openai(self) -> dict[str, Any]:
        """The assistant-message form (``arguments`` as a JSON string), for chat templates that render tool calls."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass
class ModelOutput:
    """One model response with the token accounting training needs.

    ``content`` is the answer part, ``reasoning`` what a reasoning parser split off (chat API),
    ``text`` their concatenation: the chat API does not return the raw decoded text, so ``text``
    is for reading and reward parsing, never for training. ``prompt_ids``/``completion_ids``/
    ``logprobs`` are exactly what the server returned, and they are what trains.
    """

    text: str = ""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    weight_version: int | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_length(self) -> int:
        return len(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "content": self.content,
            "reasoning": self.reasoning,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "logprobs": list(self.logprobs),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelOutput:
        return cls(
            text=data.get("text", ""),
            content=data.get("content", ""),
            reasoning=data.get("reasoning", ""),
            tool_calls=[ToolCall.from_dict(c) for c in data.get("tool_calls") or []],
            prompt_ids=list(data.get("prompt_ids") or []),
            completion_ids=list(data.get("completion_ids") or []),
            logprobs=list(data.get("logprobs") or []),
            finish_reason=data.get("finish_reason"),
            weight_version=data.get("weight_version"),
        )


def _action_to_dict(action: Any) -> Any:
    """Actions are text, a ToolCall, a list of ToolCalls or JSON data; tool calls are tagged so they load back."""
    if isinstance(action, ToolCall):
        return {"__tool_call__": action.to_dict()}
    if isinstance(action, list) and action and all(isinstance(a, ToolCall) for a in action):
        return {"__tool_calls__": [a.to_dict() for a in action]}
    return action


def _action_from_dict(data: Any) -> Any:
    if isinstance(data, dict) and set(data) == {"__tool_call__"}:
        return ToolCall.from_dict(data["__tool_call__"])
    if isinstance(data, dict) and set(data) == {"__tool_calls__"}:
        return [ToolCall.from_dict(c) for c in data["__tool_calls__"]]
    return data


@dataclass
class Step:
    """One decision point: what the model saw, what it said, what it did, and what that earned."""

    chat_completions: list[dict[str, Any]] = field(default_factory=list)
    observation: Any = None
    thought: str = ""
    action: Any = None
    model_response: str = ""
    model_output: ModelOutput | None = None
    info: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    done: bool = False
    mc_return: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "chat_completions": [dict(m) for m in self.chat_completions],
            "observation": self.observation,
            "thought": self.thought,
            "action": _action_to_dict(self.action),
            "model_response": self.model_response,
            "model_output": None if self.model_output is None else self.model_output.to_dict(),
            "info": dict(self.info),
            "reward": self.reward,
            "done": self.done,
            "mc_return": self.mc_return,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        output = data.get("model_output")
        return cls(
            chat_completions=[dict(m) for m in data.get("chat_completions") or []],
            observation=data.get("observation"),
            thought=data.get("thought", ""),
            action=_action_from_dict(data.get("action")),
            model_response=data.get("model_response", ""),
            model_output=None if output is None else ModelOutput.from_dict(output),
            info=dict(data.get("info") or {}),
            reward=float(data.get("reward", 0.0)),
            done=bool(data.get("done", False)),
            mc_return=float(data.get("mc_return", 0.0)),
        )


@dataclass
class Trajectory:
    """The ordered steps of one agent in one episode, with the task and the trajectory-level reward."""

    name: str = "agent"
    task: Any = None
    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def is_cumulative(self) -> bool:
        """True when each step's prompt extends the previous step's prompt plus response.

        Then the whole trajectory can train as one sequence (one forward pass) instead of one per step.
        """
        for prev, cur in zip(self.steps, self.steps[1:]):
            before = prev.chat_completions
            if cur.chat_completions[: len(before)] != before:
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "steps": [s.to_dict() for s in self.steps],
            "reward": self.reward,
            "info": dict(self.info),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(
            name=data.get("name", "agent"),
            task=data.get("task"),
            steps=[Step.from_dict(s) for s in data.get("steps") or []],
            reward=float(data.get("reward", 0.0)),
            info=dict(data.get("info") or {}),
        )


class TerminationReason(str, Enum):
    """Why an episode ended; ERROR is the only reason an engine retries."""

    MAX_TURNS_EXCEEDED = "max_turns_exceeded"
    MAX_RESPONSE_LENGTH_EXCEEDED = "max_response_length_exceeded"
    MAX_PROMPT_LENGTH_EXCEEDED = "max_prompt_length_exceeded"
    ENV_DONE = "env_done"
    TIMEOUT = "timeout"
    ERROR = "error"
    UNKNOWN = "unknown"


@dataclass
class Episode:
    """One rollout of a workflow on one task: the trajectories of all its agents plus the outcome."""

    id: str = ""
    task: Any = None
    termination_reason: TerminationReason | None = None
    is_correct: bool = False
    trajectories: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "termination_reason": None if self.termination_reason is None else self.termination_reason.value,
            "is_correct": self.is_correct,
            "trajectories": [t.to_dict() for t in self.trajectories],
            "metrics": dict(self.metrics),
            "info": dict(self.info),
            "error": None if self.error is None else dict(self.error),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        reason = data.get("termination_reason")
        return cls(
            id=data.get("id", ""),
            task=data.get("task"),
            termination_reason=None if reason is None else TerminationReason(reason),
            is_correct=bool(data.get("is_correct", False)),
            trajectories=[Trajectory.from_dict(t) for t in data.get("trajectories") or []],
            metrics=dict(data.get("metrics") or {}),
            info=dict(data.get("info") or {}),
            error=None if data.get("error") is None else dict(data["error"]),
        )
