"""The multi-turn tool task: "2" -> call ``<k>2</k>`` -> read ``<r>3</r>`` -> answer "3".

Each row hides a fresh table (keys 0-7 -> values 0-7 in the task config); the prompt only names
a key. The answer exists only in the environment, so it cannot be memorised or guessed better
than 1 in 8: the model has to look it up (turn 1: exactly ``<k>KEY</k>``, copying the key from the
prompt, then EOS) and copy the tool's result (turn 2). An episode::

    2<k>2</k></s><r>3</r>3</s>        (prompt, model, tool result, model)

``copy_reward`` (task config: 0.2) is partial credit for answering the value the tool returned
when the wrong key was looked up: copying the result is learnt first, then the key (why: with
both random the full reward is 1 in 64 and neither skill gets credit alone).

The fresh tiny model is first taught the syntax only (``format_warmup``: random contents, a few
seconds); RL then has to learn to use the tool: put the prompt's key in the call and copy the
result. The task config sets ``call_reward: 0``: the reward is answer correctness (1/0), which
starts near chance (1/8 with values 0-7).

Reward (sums to 1.0):

* turn 1 is one well-formed ``<k>...</k>`` call ended by EOS: ``call_reward``, the lookup
  runs and the model gets turn 2; anything else ends the episode with ``call_reward`` times the
  fraction of the 9 target tokens (the call for this key + EOS) it got right from the start.
  Why shaped: a randomly initialised char model never writes a 9-token call by chance; prefix
  credit lets GRPO learn it token after token.
* turn 2 starts with the looked-up key's value: ``1 - call_reward``, via the task's ``reward_fn``
  (prefix match). A model that always looks up one fixed key (8 keys, 8 values) is right
  1/8 + 7/8 * 1/8 = 23% of the time: reaching 0.7 needs the key copied.
"""

from __future__ import annotations

import random
from typing import Any

from nexrl_hpc.agents.agent import FINISH_TOOL, TOOL_CALL_ERROR, ToolAgent
from nexrl_hpc.agents.environments import ToolEnvironment
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.types import ModelOutput, ToolCall

TOOL = "k"


def generate_splits(params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "validation": rows}``; a row is ``{"prompt", "key", "table", "answer"}``.

    ``params.keys`` / ``params.values``: the characters keys and stored values are drawn from
    (single characters; few of them keep the char vocabulary, and so random exploration, small).
    """
    keys, values = str(params["keys"]), str(params["values"])
    if not keys or not values:
        raise ValueError("task.params.keys and task.params.values must not be empty")
    rng = random.Random(seed)

    def row() -> dict[str, Any]:
        table = {k: rng.choice(values) for k in keys}
        key = rng.choice(keys)
        return {"prompt": key, "key": key, "table": table, "answer": table[key]}

    return {
        "train": [row() for _ in range(int(params["train_size"]))],
        "validation": [row() for _ in range(int(params["val_size"]))],
    }


def format_warmup(model: Any, tokenizer: Any, seed: int, steps: int = 120, batch_size: int = 32) -> None:
    """Teach the fresh model the episode SYNTAX only: ``<k>X</k>`` EOS, then one value EOS.

    Why: RL post-training starts from a model that can already write the format; a randomly
    initialised char model never writes a 9-token call by chance. The demonstrations' contents are
    random and unrelated (the called key ignores the prompt, the answer ignores the tool result),
    so the warmed-up model is right only by chance (1 in len(values)); copying the key into the
    call and the result into the answer is what RL has to learn. Loss on the model's turns only.
    """
    import torch

    vocab = tokenizer.get_vocab()
    digits = sorted(c for c in vocab if len(c) == 1 and c.isdigit())
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def episode() -> tuple[list[int], list[int]]:
        p, q, v, a = (rng.choice(digits) for _ in range(4))
        parts = [(p, 0), (f"<{TOOL}>{q}</{TOOL}>", 1), (None, 1), (f"<r>{v}</r>", 0), (a, 1), (None, 1)]
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in parts:
            tokens = [eos] if text is None else [vocab[c] for c in text]
            ids += tokens
            mask += [trained] * len(tokens)
        return ids, mask

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = [episode() for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows])  # every episode has the same length
        mask = torch.tensor([r[1] for r in rows], dtype=torch.float32)[:, 1:]
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (loss * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


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
    """Fraction of ``target`` + EOS that ``text`` gets right from the start (EOS counts after the whole target).

    Why a prefix and not per-position matches: per-position credit rewards repeating one
    character (``<<<<<<<<<`` hits two of nine), an attractor a tiny model collapses into; a
    prefix is learnt token after token along the call's own order.
    """
    hits = 0
    for a, b in zip(text, target):
        if a != b:
            break
        hits += 1
    hits += int(hits == len(target) and stopped and len(text) == len(target))
    return hits / (len(target) + 1)


class LookupEnvironment(ToolEnvironment):
    """Turn 1: the lookup call (shaped credit otherwise); turn 2: the answer. See the module docstring."""

    def __init__(self, call_reward: float = 0.3, copy_reward: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, value in (("call_reward", call_reward), ("copy_reward", copy_reward)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if TOOL not in self.tools.tools or not isinstance(self.tools.tools[TOOL], LookupTool):
            raise ValueError(
                f"LookupEnvironment needs tool_map {{{TOOL}: LookupTool}}; got {self.tools.names}"
            )
        self.call_reward = call_reward
        self.copy_reward = copy_reward
        self.turn = 0
        self.looked_up: str | None = None

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> LookupEnvironment:
        """ToolEnvironment's keys plus ``call_reward``; every other key is the task."""
        args = dict(env_args)
        known = {"tools", "tool_map", "reward_fn", "max_tool_calls", "call_reward", "copy_reward"}
        task = {k: v for k, v in args.items() if k not in known}
        return cls(task=task or None, **{k: v for k, v in args.items() if k in known})

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        observation, info = super().reset(task)
        self.turn = 0
        self.looked_up = None
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
                result = observation["tool_outputs"][0]
                self.looked_up = None if result.get("error") else str(result.get("output"))
                # not correct (yet): an episode cut off before the answer must not count as solved
                return observation, self.call_reward, False, {**info, "is_correct": False}
            target = f"<{TOOL}>{self.task['key']}</{TOOL}>"  # type: ignore[index]
            reward = self.call_reward * call_similarity(text, stopped, target)
            return {}, reward, True, {**self._counts(), "is_correct": False}
        answer = [c for c in calls if c.name == FINISH_TOOL]
        observation, reward, _, info = super().step(
            answer or [ToolCall(name=FINISH_TOOL, arguments={"response": text})]
        )
        given = str(info.get("answer", ""))
        if reward <= 0 and self.looked_up is not None and given.startswith(self.looked_up):
            reward = self.copy_reward  # faithful to the tool, but the wrong key was looked up
            info["copied_wrong_lookup"] = True
        return observation, (1.0 - self.call_reward) * reward, True, info
