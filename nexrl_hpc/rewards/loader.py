"""One reward API: load ``rollout_worker.reward_fn`` once, detect its calling convention, score to a dict.

Three conventions are accepted, told apart once at load time by ``inspect.signature``:

- ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (found by
  the parameter names ``solution_str`` and ``ground_truth``), called with keywords from the task's
  ``data_source``, ``answer`` and ``extra_info``; returns a number/bool or a dict with ``score``;
- ``agent``: ``fn(task_info, action) -> RewardOutput`` (the parameter names ``task_info`` and
  ``action``), called with those keywords;
- ``task``: ``fn(task, response)`` (any two positional parameters), returns a number/bool or a
  dict with ``reward``.

Whatever the convention, ``Reward(task, response)`` returns ``{"reward": float, ...}`` with every
other finite numeric entry kept (``accuracy``, ``is_correct``, a verl dict's extras) and raises on
a result that is no reward (not a number, NaN/inf, a dict without ``reward``/``score``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nexrl_hpc.config.validate import ConfigError, ConfigProblem, import_configured
from nexrl_hpc.rewards.types import RewardFunction, RewardOutput

Convention = Literal["verl", "agent", "task"]

ACCEPTED = (
    "(data_source, solution_str, ground_truth, extra_info=None) [verl's compute_score], "
    "(task_info, action) -> RewardOutput, or (task, response) -> float | dict with 'reward'"
)


def _params(sig: inspect.Signature) -> tuple[set[str], bool]:
    names = {p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, has_kwargs


def detect_convention(fn: Callable[..., Any]) -> tuple[Convention, bool] | None:
    """(convention, passes extra_info) for ``fn``, or None when it fits none of them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the two-argument form
        return "task", False
    names, has_kwargs = _params(sig)
    if {"solution_str", "ground_truth"} <= names:
        try:
            sig.bind(data_source=None, solution_str="", ground_truth=None)
        except TypeError:
            return None
        return "verl", "extra_info" in names or has_kwargs
    if {"task_info", "action"} <= names:
        try:
            sig.bind(task_info={}, action="")
        except TypeError:
            return None
        return "agent", False
    try:
        sig.bind({}, "")
    except TypeError:
        return None
    return "task", False


def _as_float(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bool, int, float, numpy/torch scalars), else None."""
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0:
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def _finite_numbers(entries: Mapping[str, Any], skip: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in entries.items():
        number = _as_float(value)
        if key not in skip and number is not None and math.isfinite(number):
            out[str(key)] = number
    return out


def to_scores(value: Any) -> dict[str, float]:
    """A reward function's result as ``{"reward": float, <other finite numbers>}``; ValueError when
    the result holds no usable reward."""
    if isinstance(value, RewardOutput):
        reward = _as_float(value.reward)
        extras = _finite_numbers(value.metadata or {}, {"reward"})
        if value.is_correct is not None:
            extras["is_correct"] = float(bool(value.is_correct))
    elif isinstance(value, Mapping):
        key = "reward" if "reward" in value else "score" if "score" in value else None
        if key is None:
            raise ValueError(f"returned a dict without 'reward' or 'score' (keys: {sorted(map(str, value))})")
        reward = _as_float(value[key])
        extras = _finite_numbers(value, {"reward", "score"})
    else:
        reward = _as_float(value)
        extras = {}
    if reward is None:
        raise ValueError(
            f"returned {type(value).__name__} {str(value)[:80]!r}, which holds no numeric reward"
        )
    if not math.isfinite(reward):
        raise ValueError(f"returned a non-finite reward ({reward})")
    return {"reward": reward, **extras}


@dataclass(frozen=True)
class Reward:
    """A loaded reward function: ``reward(task, response) -> {"reward": float, ...}`` whatever its convention."""

    fn: Callable[..., Any]
    spec: str
    convention: Convention
    passes_extra_info: bool = False

    def raw(self, task: Mapping[str, Any], response: Any) -> Any:
        """What the function itself returns for ``task`` and ``response`` (called its own way)."""
        if self.convention == "verl":
            kwargs: dict[str, Any] = {
                "data_source": task.get("data_source"),
                "solution_str": response,
                "ground_truth": task.get("answer"),
            }
            if self.passes_extra_info:
                kwargs["extra_info"] = task.get("extra_info")
            return self.fn(**kwargs)
        if self.convention == "agent":
            return self.fn(task_info=task, action=response)
        return self.fn(task, response)

    def __call__(self, task: Mapping[str, Any], response: str) -> dict[str, float]:
        return to_scores(self.raw(task, response))

    def as_reward_output_fn(self) -> RewardFunction:
        """This reward in the agent stack's form ``fn(task_info, action) -> RewardOutput``: a
        RewardOutput the function returns passes through whole (its text metadata too); any other
        result becomes one, with an ``is_correct`` (else ``accuracy``) entry as the correctness."""

        def reward_fn(task_info: dict[str, Any], action: Any) -> RewardOutput:
            as_given = self.convention == "agent"  # the agent stack's own functions get the action as is
            out = self.raw(task_info, action if as_given else "" if action is None else str(action))
            if isinstance(out, RewardOutput):
                to_scores(out)  # the same checks: a NaN reward is an error here too
                return out
            scores = to_scores(out)
            verdict = scores.get("is_correct", scores.get("accuracy"))
            return RewardOutput(
                reward=scores["reward"], metadata=scores, is_correct=None if verdict is None else verdict > 0
            )

        reward_fn.__qualname__ = f"reward_output({self.spec})"
        return reward_fn


def describe(fn: Any) -> str:
    """A name for a reward function in messages: its module and qualified name."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def as_reward(fn: Callable[..., Any], key: str, spec: str | None = None) -> Reward:
    """Wrap a callable given directly (not by its import path); ConfigError naming ``key`` if unfit."""
    name = spec or describe(fn)
    if not callable(fn):
        raise ConfigError([ConfigProblem(key, f"{name!r} is a {type(fn).__name__}, not a callable")])
    found = detect_convention(fn)
    if found is None:
        try:
            shown = str(inspect.signature(fn))
        except (TypeError, ValueError):
            shown = "(?)"
        raise ConfigError(
            [ConfigProblem(key, f"{name!r} has the signature {shown}; a reward function takes {ACCEPTED}")]
        )
    return Reward(fn, name, found[0], found[1])


def load_reward(spec: str, key: str) -> Reward:
    """Import ``module:function`` or ``path/to/file.py:function`` and adapt it; a ConfigError names
    ``key`` when it does not import or fits no accepted signature (checked before the run starts)."""
    fn = import_configured(spec, key, form="module:function", label="reward function ")
    return as_reward(fn, key, spec)


def reward_problems(cfg: Mapping[str, Any], key: str) -> list[ConfigProblem]:
    """The config check of the reward function at dotted ``key`` (absent or null: nothing to check)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return []
        node = node[part]
    if node is None:
        return []
    try:
        load_reward(node, key)
    except ConfigError as exc:
        return list(exc.problems)
    return []
