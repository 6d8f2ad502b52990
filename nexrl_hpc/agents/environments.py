"""Environments of the agent model: BaseEnv, MultiTurnEnvironment, SingleTurnEnvironment, ToolEnvironment.

The Gym interface with a task: ``reset(task) -> (observation, info)``, ``step(action) ->
(observation, reward, done, info)``. Rewards come from a reward function (any signature
nexrl_hpc.rewards accepts, used as ``fn(task_info, action) -> RewardOutput``); ``info`` carries ``is_correct`` and its metadata so
workflows can report correctness without re-scoring.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from nexrl_hpc.agents.agent import FINISH_TOOL, TOOL_CALL_ERROR
from nexrl_hpc.agents.rewards.types import RewardFunction, RewardOutput, load_reward_fn, zero_reward
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.multi_tool import MultiTool
from nexrl_hpc.agents.types import ToolCall
from nexrl_hpc.rewards.loader import as_reward


class BaseEnv(ABC):
    """Subclasses implement ``reset`` and ``step``; ``from_dict`` builds one from config args.

    ``is_multithread_safe`` is False unless a subclass says otherwise: an engine only runs
    environments in parallel threads when their class declares it safe.
    """

    @abstractmethod
    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]: ...

    @abstractmethod
    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]: ...

    def close(self) -> None:
        """Release resources (processes, sockets); the default holds none."""
        return None

    @staticmethod
    def is_multithread_safe() -> bool:
        return False

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> BaseEnv:
        return cls(**env_args)


def _reward_fn(spec: RewardFunction | str | None, key: str) -> RewardFunction:
    if spec is None:
        return zero_reward
    if isinstance(spec, str):
        return load_reward_fn(spec, key=key)
    if not callable(spec):
        raise TypeError(f"{key} must be a callable or an import path, got {type(spec).__name__}")
    return as_reward(spec, key).as_reward_output_fn()  # any accepted signature, as a RewardOutput fn


def _score(reward_fn: RewardFunction, task: Any, action: Any) -> tuple[float, dict[str, Any]]:
    out = reward_fn(task_info=task if isinstance(task, dict) else {"question": task}, action=action)
    if not isinstance(out, RewardOutput):
        raise TypeError(
            f"reward function {getattr(reward_fn, '__qualname__', reward_fn)!r} returned "
            f"{type(out).__name__}, not RewardOutput"
        )
    return float(out.reward), {"is_correct": out.is_correct, "reward_metadata": dict(out.metadata)}


class MultiTurnEnvironment(BaseEnv):
    """Up to ``max_turns`` actions; ``get_reward_and_next_obs`` scores each one."""

    def __init__(self, task: dict[str, Any] | None = None, max_turns: int = 3) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.task = task
        self.max_turns = max_turns
        self.current_turn = 0
        self.done = False

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if task is not None:
            self.task = task
        if self.task is None:
            raise ValueError(f"{type(self).__name__}.reset needs a task (none given, none at construction)")
        self.current_turn = 0
        self.done = False
        return self.task, {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step called after the episode ended; call reset")
        self.current_turn += 1
        reward, next_obs, info = self.get_reward_and_next_obs(self.task, action)
        self.done = self.current_turn >= self.max_turns
        return next_obs, reward, self.done, info

    @abstractmethod
    def get_reward_and_next_obs(self, task: Any, action: Any) -> tuple[float, Any, dict[str, Any]]: ...

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # state is per instance


class SingleTurnEnvironment(MultiTurnEnvironment):
    """One action, scored by ``reward_fn(task_info=task, action=action)``."""

    def __init__(
        self, task: dict[str, Any] | None = None, reward_fn: RewardFunction | str | None = None
    ) -> None:
        super().__init__(task=task, max_turns=1)
        self.reward_fn = _reward_fn(reward_fn, "env_args.reward_fn")

    def get_reward_and_next_obs(self, task: Any, action: Any) -> tuple[float, Any, dict[str, Any]]:
        reward, info = _score(self.reward_fn, task, action)
        return reward, {}, info

    @staticmethod
    def from_dict(env_args: dict[str, Any]) -> SingleTurnEnvironment:
        """From env args: the reward_fn key is the function, every other key is the task."""
        args = dict(env_args)
        reward_fn = args.pop("reward_fn", None)
        return SingleTurnEnvironment(task=args or None, reward_fn=reward_fn)


def _as_tool_call(raw: Any, i: int) -> ToolCall:
    """ToolCalls as the agent sends them, or the OpenAI tool-call dict shape ``{"function": {"name", "arguments"}}``."""
    if isinstance(raw, ToolCall):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        fn = raw["function"]
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        return ToolCall(name=str(fn.get("name")), arguments=dict(args), id=raw.get("id"))
    if isinstance(raw, dict) and "name" in raw:
        return ToolCall.from_dict(raw)
    raise TypeError(f"action[{i}] is not a tool call: {raw!r:.120}")


class ToolEnvironment(BaseEnv):
    """Runs the model's tool calls through a MultiTool; a ``finish`` call's ``response`` is scored by ``reward_fn``.

    An action is a list of ToolCalls (a bare string is a final answer). Tool errors and calls that
    did not parse come back as error outputs, so the model sees its mistake next turn. At most
    ``max_tool_calls`` calls run per episode; a turn that would exceed it ends the episode with
    reward 0 and ``info["max_tool_calls_exceeded"]`` (an agent that never answers earns nothing).
    """

    def __init__(
        self,
        task: dict[str, Any] | None = None,
        tools: list[str] | None = None,
        tool_map: dict[str, Tool | type[Tool]] | None = None,
        reward_fn: RewardFunction | str | None = None,
        max_tool_calls: int = 8,
    ) -> None:
        self.tools = MultiTool(tools=tools, tool_map=tool_map)
        if not self.tools.names:
            raise ValueError("ToolEnvironment needs at least one tool (tools=[...] or tool_map={...})")
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.reward_fn = _reward_fn(reward_fn, "env_args.reward_fn")
        self.task = task
        self.max_tool_calls = max_tool_calls
        self.num_tool_calls = 0
        self.num_tool_errors = 0

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if task is not None:
            self.task = task
        if self.task is None:
            raise ValueError("ToolEnvironment.reset needs a task (none given, none at construction)")
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        return self.task, {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if isinstance(action, str):
            action = [ToolCall(name=FINISH_TOOL, arguments={"response": action})]
        elif isinstance(action, (ToolCall, dict)):
            action = [action]
        if not isinstance(action, list):
            raise TypeError(
                f"ToolEnvironment.step takes a list of tool calls or a str, got {type(action).__name__}"
            )
        calls = [_as_tool_call(raw, i) for i, raw in enumerate(action)]
        for call in calls:
            if call.name == FINISH_TOOL:
                answer = call.arguments.get("response", "")
                reward, info = _score(self.reward_fn, self.task, answer)
                info.update(self._counts(), answer=answer)
                return {}, reward, True, info
        return self.tool_turn(calls)

    def execute_tool(self, call: ToolCall) -> ToolOutput:
        """Run one call (an environment whose tools run elsewhere overrides this)."""
        return self.tools.execute(call)

    def tool_turn(self, calls: list[ToolCall]) -> tuple[Any, float, bool, dict[str, Any]]:
        """A turn of tool calls: their outputs (calls that did not parse answered with their error),
        or the end of the episode, reward 0, when they would exceed ``max_tool_calls``."""
        real = [c for c in calls if c.name != TOOL_CALL_ERROR]
        if self.num_tool_calls + len(real) > self.max_tool_calls:
            info = self._counts()
            info.update(max_tool_calls_exceeded=True, is_correct=False)
            return {}, 0.0, True, info
        outputs: list[ToolOutput] = []
        for call in calls:
            if call.name == TOOL_CALL_ERROR:
                out = ToolOutput(
                    call.arguments.get("tool") or "tool_call", error=call.arguments.get("message")
                )
            else:
                self.num_tool_calls += 1
                out = self.execute_tool(call)
            if not out.ok:
                self.num_tool_errors += 1
            outputs.append(out)
        return {"tool_outputs": [o.to_dict() for o in outputs]}, 0.0, False, self._counts()

    def _counts(self) -> dict[str, Any]:
        return {"num_tool_calls": self.num_tool_calls, "num_tool_errors": self.num_tool_errors}

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # tools are per instance; the python tool's sandbox is per call

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> ToolEnvironment:
        args = dict(env_args)
        known = {"tools", "tool_map", "reward_fn", "max_tool_calls"}
        task = {k: v for k, v in args.items() if k not in known}
        return cls(task=task or None, **{k: v for k, v in args.items() if k in known})
