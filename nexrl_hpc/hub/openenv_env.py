"""The run's side of an OpenEnv environment: its worker process, and an environment of the agent stack.

OpenEnv (``openenv``: FastAPI servers, WebSocket clients, gradio, fastmcp 3) lives in a venv of its own
(``scripts/install_openenv.sh``), as verifiers and vLLM do. The user's environment is the class a TRL
user passes as ``environment_factory`` (``reset(**row)``, public methods as tools, the reward read from
the instance by a reward function taking ``environments``); ``openenv_venv/worker.py`` runs it, and
serves the environment's OpenEnv server app on loopback when ``server_app`` names one.

The model side is the agent stack's: ``OpenEnvEnvironment`` is a ``ToolEnvironment`` whose tools run
in the worker, ``OpenEnvWorkflow`` a multi-turn workflow that reads the reward once the episode has
ended (as TRL reads it after the generation), and the agent is a ``ToolAgent`` given the class's
tools. So the episode trains as every agent episode does: one sequence, the engine's token ids
and log-probs, the environment's text masked.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from nexrl_hpc.agents.agent import FINISH_TOOL, question_text
from nexrl_hpc.agents.environments import ToolEnvironment, _as_tool_call
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.types import Episode, ToolCall
from nexrl_hpc.agents.workflow import MultiTurnWorkflow, TerminationEvent
from nexrl_hpc.config.rollout_schema import OpenEnvRolloutConfig
from nexrl_hpc.hub.venv_process import VenvWorkerError, VenvWorkerProcess, venv_python
from nexrl_hpc.rewards.runner import ERRORS

WORKER = Path(__file__).resolve().parent / "openenv_venv" / "worker.py"
KEY = "rollout_worker.openenv"


class OpenEnvError(VenvWorkerError):
    """The worker could not load the environment, died, or answered a request with an error."""


class OpenEnvProcess(VenvWorkerProcess):
    """One worker process serving one environment class to every episode of a rollout worker."""

    what = "OpenEnv"
    key = KEY
    error = OpenEnvError

    def __init__(self, cfg: OpenEnvRolloutConfig, log_path: str) -> None:
        init = {
            "env_factory": cfg["env_factory"],
            "reward_fn": cfg["reward_fn"],
            "server_app": cfg["server_app"],
            "python_path": [str(Path(p).resolve()) for p in cfg["python_path"]],
            "max_concurrent": cfg["max_concurrent"],
        }
        super().__init__(openenv_python(cfg["python"]), str(WORKER), init, log_path, cfg["start_timeout_s"])
        self.call_timeout_s = cfg["call_timeout_s"]

    def environment_name(self) -> str:
        return f"the OpenEnv environment {self.init['env_factory']!r}"

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, waited for (``call_timeout_s``); environment calls run in executor threads."""
        try:
            return self.request(op, **fields).result(timeout=self.call_timeout_s)
        except TimeoutError:
            raise OpenEnvError(
                f"{op}: the OpenEnv worker did not answer within {self.call_timeout_s:.0f} s "
                f"({KEY}.call_timeout_s; log: {self.log_path})"
            ) from None


def openenv_python(configured: str | None) -> str:
    """``rollout_worker.openenv.python``, else where ``scripts/install_openenv.sh`` puts the venv's
    python (``$NEXRL_OPENENV_VENV``, else ``~/.cache/nexrl_hpc/openenv-venv``)."""
    return venv_python(configured, "NEXRL_OPENENV_VENV", "~/.cache/nexrl_hpc/openenv-venv")


def tool_stubs(schemas: list[dict[str, Any]]) -> dict[str, Tool]:
    """The environment's tools as the agent sees them (name, description, parameters); they run in
    the worker, never here."""
    stubs = {}
    for schema in schemas:
        fn = schema["function"]
        stubs[fn["name"]] = Tool(name=fn["name"], description=fn["description"], parameters=fn["parameters"])
    return stubs


def tools_system_prompt(schemas: list[dict[str, Any]]) -> str:
    """A system prompt listing the tools and the call syntax of ``nexrl_hpc.agents.tool_format``."""
    listing = "\n".join(json.dumps(s["function"], separators=(", ", ": ")) for s in schemas)
    return (
        "You can call these tools:\n"
        f"{listing}\n"
        'Call a tool by writing <NAME>{"argument": "value"}</NAME>; its result comes back in the next '
        "message. Answer without a tool call when you are done."
    )


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns that JSON can carry (the ones ``reset(**row)`` and the reward function get)."""
    kept = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


def with_observation(task: dict[str, Any], observation: str | None) -> str | list[dict[str, Any]]:
    """The episode's first observation: the row's prompt (text, or chat messages) with what ``reset``
    returned appended to it (to the last message's content), after a newline."""
    prompt = task.get("prompt")
    if isinstance(prompt, list):
        messages = [dict(m) for m in prompt]
        if observation and messages:
            content = str(messages[-1].get("content") or "")
            messages[-1]["content"] = f"{content}\n{observation}" if content else observation
        return messages
    text = question_text(task)
    if not observation:
        return text
    return f"{text}\n{observation}" if text else observation


class OpenEnvEnvironment(ToolEnvironment):
    """One slot of the worker's environment instances (TRL keeps one per generation): ``reset`` resets
    the slot's instance with the row's columns, a turn's tool calls run on it (``ToolEnvironment``'s
    turn: calls that did not parse answered with their error, ``max_tool_calls`` ends the episode). A
    turn without a tool call is the final answer and ends the episode. A tool that raises answers
    with its error, and the episode goes on (TRL's rule)."""

    def __init__(self, process: OpenEnvProcess, max_tool_calls: int = 8) -> None:
        super().__init__(tool_map=dict(tool_stubs(process.ready["tools"])), max_tool_calls=max_tool_calls)
        self.process = process
        self.slot = uuid.uuid4().hex
        self.task: dict[str, Any] = {}
        self.row: dict[str, Any] = {}  # the task's JSON-able columns: reset(**row), the reward's columns

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> OpenEnvEnvironment:
        return cls(**env_args)

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if task is None:
            raise ValueError("OpenEnvEnvironment.reset needs the task (the row)")
        self.task = dict(task)
        self.row = _jsonable(self.task)
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        answer = self.process.call("open", slot=self.slot, row=self.row)
        return with_observation(self.task, answer.get("observation")), {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if isinstance(action, dict) and "calls" in action:  # an agent that also passes its raw text
            action = action["calls"]
        if isinstance(action, str):
            action = [ToolCall(name=FINISH_TOOL, arguments={"response": action})]
        calls = [_as_tool_call(raw, i) for i, raw in enumerate(action)]
        if any(c.name == FINISH_TOOL for c in calls):
            return {}, 0.0, True, self._counts()  # the reward is read when the episode has ended
        return self.tool_turn(calls)

    def execute_tool(self, call: ToolCall) -> ToolOutput:
        stub = self.tools.tools.get(call.name)
        error = stub.check_arguments(call.arguments) if stub is not None else None
        if error is not None:  # the schema's required/known arguments, checked before the call
            return ToolOutput(call.name, error=error)
        answer = self.process.call("call", slot=self.slot, name=call.name, arguments=call.arguments)
        return ToolOutput(call.name, output=answer.get("output"), error=answer.get("tool_error"))

    def reward(self, prompts: list[Any], completions: list[Any]) -> float:
        """The episode's reward: the reward function on the instance (or its ``reward`` attribute)."""
        answer = self.process.call(
            "reward", slot=self.slot, row=self.row, prompts=prompts, completions=completions
        )
        return float(answer["reward"])


class OpenEnvWorkflow(MultiTurnWorkflow):
    """MultiTurnWorkflow that reads the reward when the episode has ended (the final answer, the turn
    limit, the length limit; not a timeout or an error), and gives it to the last turn. A reward
    function that raises scores 0 and counts in ``reward/errors``, with its message."""

    env: OpenEnvEnvironment

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode | None:
        try:
            return await super().run(task, uid, **kwargs)
        except TerminationEvent:
            await self._score()
            raise

    async def _score(self) -> None:
        steps = self.agent.trajectory.steps
        if not steps:
            return
        messages = self.agent.chat_completions
        first = len(steps[0].chat_completions)
        prompts, completions = [messages[:first]], [messages[first:]]
        last = steps[-1]
        metadata = last.info.setdefault("reward_metadata", {})
        try:
            reward = await self.run_in_executor(self.env.reward, prompts, completions)
            metadata[ERRORS] = 0.0
        except OpenEnvError as exc:
            reward = 0.0
            metadata[ERRORS] = 1.0
            last.info["reward_error"] = str(exc)
        for step in steps:
            step.reward = 0.0
        last.reward = reward
