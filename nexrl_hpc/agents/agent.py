"""Agents of the agent model: BaseAgent, MathAgent, ToolAgent.

An agent keeps two things: ``chat_completions`` (the messages the model is sent next) and
``trajectory`` (what is recorded for training). Workflows drive it with ``update_from_env`` /
``update_from_model``; the agent never calls the model or the environment itself.

Why assistant messages hold the model's text verbatim: the next prompt is rendered from these
messages by the server's chat template, and it must extend the previous prompt + completion token
for token (see ``nexrl_hpc.agents.sequence``) for the episode to train as one sequence.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from nexrl_hpc.agents.tool_format import format_tool_result, parse_tool_calls, tool_arguments
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.multi_tool import MultiTool
from nexrl_hpc.agents.types import ModelOutput, Step, ToolCall, Trajectory

FINISH_TOOL = "finish"
"""The pseudo tool whose ``response`` argument is the final answer (ToolEnvironment ends the episode on it)."""

TOOL_CALL_ERROR = "<tool_call_error>"
"""Pseudo tool name of a call the model wrote but that did not parse (not an identifier: no model
can name a real tool this way); its ``message`` argument becomes an error observation."""


@dataclass
class Action:
    """What ``update_from_model`` returns: the thing to pass to ``env.step``."""

    action: Any = None


def question_text(observation: Any, keys: tuple[str, ...] = ("question", "prompt", "problem")) -> str:
    """The question in an initial observation: a string, or a task dict's question/prompt/problem."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, dict):
        for key in keys:
            if observation.get(key) is not None:
                return str(observation[key])
        raise KeyError(f"initial observation has none of {list(keys)}; keys: {sorted(observation)}")
    raise TypeError(f"initial observation must be a str or a dict, got {type(observation).__name__}")


class BaseAgent(ABC):
    """The agent interface; subclasses implement ``format_observation`` and ``parse_action``.

    The step protocol: ``update_from_model`` opens a Step (prompt messages, response, action);
    the following ``update_from_env`` closes it (reward, done, info, next observation) and appends
    the observation as a message for the next turn.
    """

    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt
        self.messages: list[dict[str, Any]] = []
        self._trajectory = Trajectory()
        self.reset()

    # --- state -------------------------------------------------------------------------------------
    @property
    def chat_completions(self) -> list[dict[str, Any]]:
        return self.messages

    @property
    def trajectory(self) -> Trajectory:
        return self._trajectory

    def get_current_state(self) -> Step | None:
        """The last step (the one the next ``update_from_env`` completes), or None before the first."""
        return self._trajectory.steps[-1] if self._trajectory.steps else None

    def reset(self) -> None:
        self._trajectory = Trajectory()
        self.messages = (
            [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        )
        self._awaiting_env = False  # a step was opened by the model and not yet answered by the env

    # --- mutations ---------------------------------------------------------------------------------
    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict[str, Any]) -> None:
        """Record the env's answer to the last action, then show the observation to the model."""
        first = not self._trajectory.steps and not self._awaiting_env
        if self._awaiting_env:
            step = self._trajectory.steps[-1]
            step.reward = float(reward)
            step.done = bool(done)
            step.info.update(info or {})
            step.info["next_observation"] = _jsonable(observation)
            self._awaiting_env = False
        if done:
            return
        messages = self.format_observation(observation, first=first)
        self.messages.extend(messages)

    def update_from_model(self, response: str | ModelOutput, **kwargs: Any) -> Action:
        """Record the model's response as a new Step and return the action for the env."""
        if self._awaiting_env:
            raise RuntimeError(
                f"{type(self).__name__}.update_from_model called twice without update_from_env in between"
            )
        output = response if isinstance(response, ModelOutput) else None
        text = response.text if isinstance(response, ModelOutput) else str(response)
        action, thought = self.parse_action(text, output)
        step = Step(
            chat_completions=copy.deepcopy(self.messages),
            observation=self.messages[-1]["content"] if self.messages else None,
            thought=thought,
            action=action,
            model_response=text,
            model_output=output,
        )
        self._trajectory.steps.append(step)
        self.messages.append(self.assistant_message(text, output))
        self._awaiting_env = True
        return Action(action)

    # --- hooks -------------------------------------------------------------------------------------
    @abstractmethod
    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        """Messages that show ``observation`` to the model (``first``: the task's initial observation)."""

    @abstractmethod
    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        """(action, thought) from the model's response."""

    def assistant_message(self, text: str, output: ModelOutput | None) -> dict[str, Any]:
        """The response as a message; verbatim text so the next rendered prompt extends this one."""
        if output is not None and output.reasoning:
            return {"role": "assistant", "content": output.content, "reasoning_content": output.reasoning}
        return {"role": "assistant", "content": text}


class MathAgent(BaseAgent):
    """Question in, answer out: the action is the response text (math_reward_fn reads the answer)."""

    def __init__(self, system_prompt: str | None = None, instruction: str = "") -> None:
        self.instruction = instruction
        super().__init__(system_prompt)

    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        if first:
            return [{"role": "user", "content": question_text(observation) + self.instruction}]
        if observation is None or observation == {} or observation == "":
            return []  # single-turn envs answer the final action with an empty observation
        content = observation if isinstance(observation, str) else str(observation)
        return [{"role": "user", "content": content}]

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        if output is not None and output.reasoning:
            return output.content, output.reasoning
        return text, ""


class ToolAgent(BaseAgent):
    """Tool use in the tag syntax of ``nexrl_hpc.agents.tool_format`` (or OpenAI tool_calls when the server parsed them).

    The action is a list of ToolCalls. A response without calls is the final answer, sent as a
    ``finish`` call; calls that do not parse are sent as ``TOOL_CALL_ERROR`` calls so the
    environment answers them with an error observation instead of the episode crashing.
    Tool results come back as ``<result_tag>...</result_tag>`` in a message of ``observation_role``.
    """

    def __init__(
        self,
        tools: list[str] | None = None,
        tool_map: dict[str, Tool | type[Tool]] | None = None,
        system_prompt: str | None = None,
        result_tag: str = "result",
        observation_role: str = "user",
        max_calls_per_turn: int = 8,
    ) -> None:
        multi = MultiTool(tools=tools, tool_map=tool_map)
        if not multi.names:
            raise ValueError("ToolAgent needs at least one tool (tools=[...] or tool_map={...})")
        self.tool_names = multi.names
        self.tool_primary_arguments = tool_arguments(multi.tools)
        self.result_tag = result_tag
        self.observation_role = observation_role
        self.max_calls_per_turn = max_calls_per_turn
        super().__init__(system_prompt)

    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        if first and isinstance(observation, list):  # the prompt as chat messages
            return [dict(m) for m in observation]
        if first:
            return [{"role": "user", "content": question_text(observation)}]
        if isinstance(observation, dict) and "tool_outputs" in observation:
            outputs = [
                o if isinstance(o, ToolOutput) else ToolOutput.from_dict(o)
                for o in observation["tool_outputs"]
            ]
            content = "".join(format_tool_result(o, self.result_tag) for o in outputs)
            return [{"role": self.observation_role, "content": content}]
        if observation is None or observation == {} or observation == "":
            return []
        return [{"role": self.observation_role, "content": str(observation)}]

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        thought = output.reasoning if output is not None else ""
        if output is not None and output.tool_calls:
            return list(output.tool_calls), thought
        content = output.content if output is not None and output.reasoning else text
        parsed = parse_tool_calls(content, self.tool_primary_arguments, max_calls=self.max_calls_per_turn)
        calls = list(parsed.calls)
        calls += [
            ToolCall(name=TOOL_CALL_ERROR, arguments={"message": e.message, "tool": e.name})
            for e in parsed.errors
        ]
        if not calls:
            calls = [ToolCall(name=FINISH_TOOL, arguments={"response": parsed.content})]
        return calls, thought


def _jsonable(value: Any) -> Any:
    """Observations hold ToolOutputs; steps keep them as dicts so episodes serialise to JSON."""
    if isinstance(value, ToolOutput):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value
