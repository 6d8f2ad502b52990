"""The multi-turn tool task: "c?" -> call ``<k>c</k>`` -> read ``<r>7</r>`` -> answer "7".

Each row hides a fresh table of digits for the keys a-d; the prompt only names a key. The answer
exists only in the environment, so it cannot be memorised or guessed better than 1 in 10: the
model has to look it up (turn 1: exactly ``<k>KEY</k>``, copying the key from the prompt, then
EOS) and copy the tool's result (turn 2). An episode::

    c?<k>c</k></s><r>7</r>7</s>        (prompt, model, tool result, model)

Reward (sums to 1.0):

* turn 1 is one well-formed ``<k>...</k>`` call ended by EOS: ``call_reward`` (0.3), the lookup
  runs and the model gets turn 2; anything else ends the episode with ``call_reward`` times the
  fraction of the 9 target tokens (the call for this key + EOS) it got right position by position.
  Why shaped: a randomly initialised char model never writes a 9-token call by chance, and
  per-position credit lets GRPO learn all positions at once.
* turn 2 starts with the looked-up key's digit: ``1 - call_reward`` (0.7), via the task's
  ``reward_fn`` (prefix match). A model that always looks up one fixed key is right ~32% of the
  time (mean reward ~0.52): reaching 0.7 needs the key copied.
"""

from __future__ import annotations

import random
import string
from typing import Any

from nexrl_hpc.agents.agent import FINISH_TOOL, TOOL_CALL_ERROR, ToolAgent
from nexrl_hpc.agents.environments import ToolEnvironment
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.types import ModelOutput, ToolCall

TOOL = "k"


def generate_splits(params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "validation": rows}``; a row is ``{"prompt", "key", "table", "answer"}``."""
    keys = string.ascii_lowercase[: int(params["num_keys"])]
    rng = random.Random(seed)

    def row() -> dict[str, Any]:
        table = {k: str(rng.randrange(10)) for k in keys}
        key = rng.choice(keys)
        return {"prompt": f"{key}?", "key": key, "table": table, "answer": table[key]}

    return {
        "train": [row() for _ in range(int(params["train_size"]))],
        "validation": [row() for _ in range(int(params["val_size"]))],
    }


class LookupTool(Tool):
    """The row's hidden table; the environment sets ``table`` at reset."""

    name = TOOL
    description = "Look up the digit stored under a key."
    parameters = {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "a key, e.g. c"}},
        "required": ["key"],
    }

    def __init__(self, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.table: dict[str, str] = {}

    def forward(self, key: str) -> ToolOutput:  # type: ignore[override]
        if key not in self.table:
            return ToolOutput(self.name, error=f"no key {key!r}")
        return ToolOutput(self.name, output=self.table[key])


class LookupAgent(ToolAgent):
    """ToolAgent whose action also carries the raw text and finish reason (the env's shaping reads them)."""

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        calls, thought = super().parse_action(text, output)
        finish_reason = output.finish_reason if output is not None else "stop"
        return {"calls": calls, "text": text, "finish_reason": finish_reason}, thought


def call_similarity(text: str, stopped: bool, target: str) -> float:
    """Fraction of ``target`` + EOS matched position by position (EOS counts when the turn stopped right after)."""
    hits = sum(a == b for a, b in zip(text, target))
    hits += int(stopped and len(text) == len(target))
    return hits / (len(target) + 1)


class LookupEnvironment(ToolEnvironment):
    """Turn 1: the lookup call (shaped credit otherwise); turn 2: the answer. See the module docstring."""

    def __init__(self, call_reward: float = 0.3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= call_reward <= 1.0:
            raise ValueError(f"call_reward must be in [0, 1], got {call_reward}")
        if TOOL not in self.tools.tools or not isinstance(self.tools.tools[TOOL], LookupTool):
            raise ValueError(
                f"LookupEnvironment needs tool_map {{{TOOL}: LookupTool}}; got {self.tools.names}"
            )
        self.call_reward = call_reward
        self.turn = 0

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        observation, info = super().reset(task)
        self.turn = 0
        tool = self.tools.tools[TOOL]
        assert isinstance(tool, LookupTool)
        tool.table = dict(self.task["table"])  # type: ignore[index]
        return observation, info

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if not isinstance(action, dict) or "calls" not in action:
            raise TypeError(
                "LookupEnvironment takes LookupAgent actions ({'calls', 'text', 'finish_reason'})"
            )
        self.turn += 1
        text, stopped = str(action["text"]), action["finish_reason"] == "stop"
        calls: list[ToolCall] = action["calls"]
        if self.turn == 1:
            self.num_tool_errors += sum(c.name == TOOL_CALL_ERROR for c in calls)
            lookups = [c for c in calls if c.name == TOOL]
            well_formed = (
                stopped and len(calls) == 1 and len(lookups) == 1 and text == f"<{TOOL}>{text[3:-4]}</{TOOL}>"
            )
            if well_formed:
                observation, _, _, info = super().step(lookups)
                return observation, self.call_reward, False, info
            target = f"<{TOOL}>{self.task['key']}</{TOOL}>"  # type: ignore[index]
            reward = self.call_reward * call_similarity(text, stopped, target)
            return {}, reward, True, {**self._counts(), "is_correct": False}
        answer = [c for c in calls if c.name == FINISH_TOOL]
        observation, reward, _, info = super().step(
            answer or [ToolCall(name=FINISH_TOOL, arguments={"response": text})]
        )
        return observation, (1.0 - self.call_reward) * reward, True, info
