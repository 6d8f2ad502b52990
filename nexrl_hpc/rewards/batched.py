"""TRL's reward contract: ``reward_func(prompts, completions, completion_ids, **kwargs) -> list[float | None]``.

A TRL reward function scores a whole batch in one call. It gets the prompts as the dataset holds
them, the completions (chat form ``[{"role": "assistant", "content": text}]`` when the prompt is a
list of chat messages, the text otherwise: TRL's ``is_conversational``), the completions' token ids,
and every other dataset column as a keyword holding one value per completion (``solution=[...]``).
An ``async def`` function is awaited (on the scoring thread). A function without ``**kwargs`` gets
only the keywords it names; one that names a column the rows lack is refused with the columns they
have. Its result is one value per completion, ``None`` for a sample it does not score.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TRL_FIXED = ("prompts", "completions", "completion_ids")
"""The keywords TRL passes besides the dataset's columns; any of them marks a TRL reward function."""

COMPLETION_IDS = "completion_ids"
"""The task field the single-turn worker puts a response's token ids in, for the reward to pass on."""

_NOT_COLUMNS = {"prompt", "completion", COMPLETION_IDS}


class RewardContractError(ValueError):
    """A batched reward function's result is not one value per completion."""


def is_conversational(prompt: Any) -> bool:
    """A prompt of chat messages (TRL's conversational form)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )


def completion_of(task: Mapping[str, Any], response: Any) -> Any:
    """The completion as TRL hands it over: chat form for a conversational prompt, the text otherwise."""
    if is_conversational(task.get("prompt")) and isinstance(response, str):
        return [{"role": "assistant", "content": response}]
    return response


def batched_kwargs(tasks: Sequence[Mapping[str, Any]], responses: Sequence[Any]) -> dict[str, list[Any]]:
    """Every keyword TRL would pass: prompts, completions, completion ids, the columns as lists."""
    kwargs: dict[str, list[Any]] = {
        "prompts": [t.get("prompt") for t in tasks],
        "completions": [completion_of(t, r) for t, r in zip(tasks, responses)],
        "completion_ids": [list(t.get(COMPLETION_IDS) or []) for t in tasks],
    }
    columns: dict[str, None] = {}
    for task in tasks:
        columns.update(dict.fromkeys(k for k in task if k not in _NOT_COLUMNS and k not in kwargs))
    for key in columns:
        kwargs[key] = [t.get(key) for t in tasks]
    return kwargs


def call_batched(
    fn: Callable[..., Any],
    keywords: frozenset[str] | None,
    tasks: Sequence[Mapping[str, Any]],
    responses: Sequence[Any],
) -> list[Any]:
    """``fn``'s values for the batch, one per response; TypeError naming a column the rows lack,
    ValueError for a result that is not one value per response."""
    kwargs = batched_kwargs(tasks, responses)
    missing = sorted(k for k in _required(fn) if k not in kwargs)
    if missing:
        raise TypeError(
            f"{getattr(fn, '__name__', fn)} needs the dataset column(s) {', '.join(map(repr, missing))}, "
            f"which the rows do not have (they have: {', '.join(sorted(kwargs))})"
        )
    if keywords is not None:  # no **kwargs: only what it names
        kwargs = {k: v for k, v in kwargs.items() if k in keywords}
    values = fn(**kwargs)
    if inspect.iscoroutine(values):  # an async reward function (TRL awaits those too)
        values = asyncio.run(values)
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise RewardContractError(
            f"returned {type(values).__name__} {str(values)[:80]!r}; a batched reward function "
            "returns a list with one reward (or None) per completion"
        )
    values = list(values)
    if len(values) != len(responses):
        raise ValueError(
            f"returned {len(values)} rewards for {len(responses)} completions (one per completion)"
        )
    return values


def _required(fn: Callable[..., Any]) -> list[str]:
    """The keyword parameters ``fn`` cannot do without."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
