"""The multi-turn tool task: "c" -> call ``<k>c</k>`` -> read ``=3`` -> answer "3".

Each row hides a fresh table (keys ``abcdefgh`` -> values ``01234567`` in the task config); the
prompt only names a key. The answer exists only in the environment, so it cannot be memorised or
guessed better than 1 in 8: the model has to look it up (turn 1: exactly ``<k>KEY</k>`` then EOS,
copying the key from the prompt) and answer with the tool's result (turn 2). An episode::

    c<k>c</k></s>=3 3</s>        (prompt, model, tool result, model; no space in the real text)

The call is parsed by ToolAgent's tag syntax (``nexrl_hpc.agents.tool_format``); the result comes
back as ``=VALUE`` (``LookupAgent``: a char model uses the result by copying the token it is
reading). Keys and values are different characters, so the prompt's key is the one letter in
sight when the call is written.

Reward (sums to 1.0), one credit per skill so each is learnt from its own signal:

* turn 1, ``call_reward``: the call ``<k>KEY</k>`` + EOS for the prompt's key. A well-formed call
  for another key earns nothing but still runs (turn 2 happens); a malformed turn (a tool error
  observation is not needed: nothing could be looked up) ends the episode with reward 0.
* turn 2, ``1 - call_reward``: the answer starts with the value the tool returned. Right call and
  faithful answer = the correct answer; ``is_correct`` (the task's ``reward_fn`` against the
  row's true answer) is reported next to the reward.

Why not answer correctness alone: with both skills at chance that reward is 1 in 64 and a credit
that needs both copies at once taught neither in 60 steps (measured). The fresh tiny model is
first taught the syntax only (``format_warmup``); the warmed-up model calls a key and answers a
value at chance (reward ~0.13), and RL learns both copies.
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


def format_warmup(
    model: Any,
    tokenizer: Any,
    seed: int,
    keys: str,
    values: str,
    steps: int,
    batch_size: int,
    lr: float,
    spread: float,
) -> None:
    """Teach the fresh model the episode SYNTAX only: ``<k>KEY</k>`` EOS, then one value and EOS.

    Why: RL post-training starts from a model that can already write the format; a randomly
    initialised char model never writes a 9-token call by chance. What it must not learn here is
    *which* key to call or *which* value to answer: those two positions are trained mainly to hold
    some key / some value (loss ``-log P(any key)``, ``-log P(any value)``), which leaves the choice
    among them to the context. (Training them on random contents instead teaches the model that
    the context does not matter there, and GRPO then needed far more steps to learn the copies.)
    ``spread`` adds that weight times the members' mean log-probability relative to the set: without
    it the position collapsed onto one key, and a group whose samples all call the same key gives
    GRPO no signal. So the warmed-up model calls a key and answers a value at about chance; RL has
    to learn to copy the prompt's key into the call and the tool's result into the answer.
    """
    import torch

    vocab = tokenizer.get_vocab()
    missing = sorted(set(keys + values) - set(vocab))
    if missing:
        raise ValueError(
            f"the tokenizer has no token for {missing} (task.alphabet must hold keys and values)"
        )
    eos = tokenizer.eos_token_id
    sets = {
        "key": torch.tensor([vocab[c] for c in keys]),
        "value": torch.tensor([vocab[c] for c in values]),
    }
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = [_warmup_episode(rng, keys, values, vocab, eos) for _ in range(batch_size)]
        loss = _warmup_loss(model, rows, sets, spread)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


# (text, how the model's next-token prediction of each of its tokens is trained); None: EOS
_WARMUP_TEMPLATE = [
    ("P", None),
    (f"<{TOOL}>", "token"),
    ("Q", "key"),
    (f"</{TOOL}>", "token"),
    (None, "token"),
    ("=V", None),
    ("A", "value"),
    (None, "token"),
]


def _warmup_episode(
    rng: random.Random, keys: str, values: str, vocab: dict[str, int], eos: int
) -> tuple[list[int], list[str | None]]:
    """One episode of random contents: (token ids, how each token's prediction is trained)."""
    fill = {
        "P": rng.choice(keys),
        "Q": rng.choice(keys),
        "V": rng.choice(values),
        "A": rng.choice(values),
    }
    ids: list[int] = []
    how: list[str | None] = []
    for text, kind in _WARMUP_TEMPLATE:
        chars = [eos] if text is None else [vocab[fill.get(c, c)] for c in text]
        ids += chars
        how += [kind] * len(chars)
    return ids, how


def _warmup_loss(
    model: Any, rows: list[tuple[list[int], list[str | None]]], sets: dict[str, Any], spread: float
) -> Any:
    """``format_warmup``'s loss on a batch of episodes (see there)."""
    import torch

    ids = torch.tensor([r[0] for r in rows])  # every episode has the same length
    how = [r[1][1:] for r in rows]  # what predicts token t sits at position t - 1
    logp = torch.log_softmax(model(ids).logits[:, :-1], dim=-1)
    terms = []
    for b, kinds in enumerate(how):
        for t, kind in enumerate(kinds):
            if kind == "token":
                terms.append(logp[b, t, ids[b, t + 1]])
            elif kind is not None:  # any member of the set: log of their summed probability
                member = logp[b, t, sets[kind]]
                in_set = torch.logsumexp(member, dim=0)
                terms.append(in_set + spread * (member - in_set).mean())
    return -torch.stack(terms).mean()


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
    """ToolAgent whose action also carries the raw text and finish reason (the env's shaping reads
    them) and that shows a successful lookup as ``=VALUE`` (errors keep the tag syntax)."""

    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        outputs = observation.get("tool_outputs") if isinstance(observation, dict) else None
        if not first and outputs and all(not o.get("error") for o in outputs):
            content = "".join(f"={o['output']}" for o in outputs)
            return [{"role": self.observation_role, "content": content}]
        return super().format_observation(observation, first)

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        calls, thought = super().parse_action(text, output)
        finish_reason = output.finish_reason if output is not None else "stop"
        return {"calls": calls, "text": text, "finish_reason": finish_reason}, thought


class LookupEnvironment(ToolEnvironment):
    """Turn 1: the lookup call; turn 2: the answer. Rewards: see the module docstring."""

    def __init__(self, call_reward: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= call_reward <= 1.0:
            raise ValueError(f"call_reward must be in [0, 1], got {call_reward}")
        if TOOL not in self.tools.tools or not isinstance(self.tools.tools[TOOL], LookupTool):
            raise ValueError(
                f"LookupEnvironment needs tool_map {{{TOOL}: LookupTool}}; got {self.tools.names}"
            )
        self.call_reward = call_reward
        self.turn = 0
        self.looked_up: str | None = None

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> LookupEnvironment:
        """ToolEnvironment's keys plus ``call_reward``; every other key is the task."""
        args = dict(env_args)
        known = {"tools", "tool_map", "reward_fn", "max_tool_calls", "call_reward"}
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
        target = f"<{TOOL}>{self.task['key']}</{TOOL}>"  # type: ignore[index]
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
                reward = self.call_reward * float(text == target)
                # not correct (yet): an episode cut off before the answer must not count as solved
                return observation, reward, False, {**info, "is_correct": False}
            # no partial credit: a malformed call scoring above a well-formed call for the wrong
            # key drove the model into malformed calls (measured)
            return {}, 0.0, True, {**self._counts(), "is_correct": False}
        answer = [c for c in calls if c.name == FINISH_TOOL]
        observation, _, _, info = super().step(  # scores the answer against the row: is_correct
            answer or [ToolCall(name=FINISH_TOOL, arguments={"response": text})]
        )
        given = str(info.get("answer", ""))
        faithful = self.looked_up is not None and given.startswith(self.looked_up)
        info["faithful_to_tool"] = faithful
        return observation, (1.0 - self.call_reward) * float(faithful), True, info
