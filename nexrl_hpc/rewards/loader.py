"""One reward API: load ``rollout_worker.reward_fn`` once, detect its calling convention, score to a dict.

Four conventions are accepted, told apart once at load time by ``inspect.signature``:

- ``trl``: TRL's batched ``reward_func(completions, **kwargs) -> list[float | None]`` (found by the
  parameter names ``completions``, ``prompts`` or ``completion_ids``), called once for many
  responses with the dataset's columns as keyword lists (``rewards.batched``); ``None`` skips a sample;
- ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (found by
  the parameter names ``solution_str`` and ``ground_truth``), called with keywords from the task's
  ``data_source``, ``answer`` and ``extra_info`` (``data_source`` and ``extra_info`` only when it
  takes them: verl's per-dataset scorers, ``gsm8k.compute_score(solution_str, ground_truth,
  method='strict', format_score=0.0, score=1.0)``, take neither); returns a number/bool or a dict
  with ``score``;
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
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nexrl_hpc.config.validate import ConfigError, ConfigProblem, import_configured
from nexrl_hpc.rewards.batched import TRL_FIXED, call_batched
from nexrl_hpc.rewards.types import RewardFunction, RewardOutput

Convention = Literal["verl", "agent", "task", "trl"]

ACCEPTED = (
    "(completions, **kwargs) -> list[float | None] [TRL's reward functions], "
    "(data_source, solution_str, ground_truth, extra_info=None) [verl's compute_score; "
    "data_source and extra_info optional], "
    "(task_info, action) -> RewardOutput, or (task, response) -> float | dict with 'reward'"
)
SKIPPED = "reward/skipped"
"""Score key: 1 when the reward returned None for the sample (TRL: skip it); the sample trains nothing."""


@dataclass(frozen=True)
class Detected:
    """How a reward function is called: its convention and the optional arguments it takes."""

    convention: Convention
    passes_extra_info: bool = False
    passes_data_source: bool = True
    keywords: frozenset[str] | None = None  # trl: the keywords it takes (None: **kwargs, any)


def _params(sig: inspect.Signature) -> tuple[set[str], bool]:
    names = {p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, has_kwargs


def detect_convention(fn: Callable[..., Any]) -> Detected | None:
    """How ``fn`` is called, or None when it fits no accepted signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the two-argument form
        return Detected("task")
    names, has_kwargs = _params(sig)
    if names & set(TRL_FIXED):
        return (
            None
            if _positional_only(sig)
            else Detected("trl", keywords=None if has_kwargs else frozenset(names))
        )
    if {"solution_str", "ground_truth"} <= names:
        with_source = "data_source" in names or has_kwargs
        try:
            sig.bind(solution_str="", ground_truth=None, **({"data_source": None} if with_source else {}))
        except TypeError:
            return None
        return Detected("verl", "extra_info" in names or has_kwargs, with_source)
    if {"task_info", "action"} <= names:
        try:
            sig.bind(task_info={}, action="")
        except TypeError:
            return None
        return Detected("agent")
    try:
        sig.bind({}, "")
    except TypeError:
        return None
    return Detected("task")


def _positional_only(sig: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in sig.parameters.values())


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


def scores_of(value: Any, none_skips: bool) -> dict[str, float]:
    """``to_scores``; with ``none_skips`` (TRL's functions) a None is a skipped sample."""
    if none_skips and value is None:
        return {"reward": 0.0, SKIPPED: 1.0}
    return to_scores(value)


def _outcome(score: Callable[..., dict[str, float]], *args: Any) -> Outcome:
    """``score(*args)``, or the failure it raised."""
    try:
        return score(*args)
    except BaseException as exc:
        if not contained(exc):
            raise
        return RewardFailure.now(exc)


def contained(exc: BaseException) -> bool:
    """Whether ``exc`` is one sample's failure: any exception, and off the main thread any
    ``BaseException`` too (``sys.exit()`` in a scorer); the main thread's Ctrl-C and exit stay its own."""
    return isinstance(exc, Exception) or threading.current_thread() is not threading.main_thread()


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
class RewardFailure:
    """One sample the reward could not score: the error's one-line message and its traceback."""

    message: str
    traceback: str = ""

    @staticmethod
    def now(exc: BaseException) -> RewardFailure:
        """The exception being handled, as a failure."""
        return RewardFailure(f"{type(exc).__name__}: {exc}", traceback.format_exc())


Outcome = dict[str, float] | RewardFailure


@dataclass(frozen=True)
class Reward:
    """A loaded reward function: ``reward(task, response) -> {"reward": float, ...}`` whatever its
    convention; ``score_batch`` scores many responses (one call for a TRL function)."""

    fn: Callable[..., Any]
    spec: str
    convention: Convention
    passes_extra_info: bool = False
    passes_data_source: bool = True
    keywords: frozenset[str] | None = None

    @property
    def batched(self) -> bool:
        """Called once for many responses (TRL's form)."""
        return self.convention == "trl"

    @property
    def name(self) -> str:
        """The function's own name (TRL's ``reward_func.__name__``): metric names, messages."""
        return str(getattr(self.fn, "__name__", type(self.fn).__name__))

    def raw(self, task: Mapping[str, Any], response: Any) -> Any:
        """What the function itself returns for ``task`` and ``response`` (called its own way)."""
        if self.convention == "trl":
            return self.raw_batch([task], [response])[0]
        if self.convention == "verl":
            kwargs: dict[str, Any] = {"solution_str": response, "ground_truth": task.get("answer")}
            if self.passes_data_source:
                kwargs["data_source"] = task.get("data_source")
            if self.passes_extra_info:
                kwargs["extra_info"] = task.get("extra_info")
            return self.fn(**kwargs)
        if self.convention == "agent":
            return self.fn(task_info=task, action=response)
        return self.fn(task, response)

    def raw_batch(self, tasks: Sequence[Mapping[str, Any]], responses: Sequence[Any]) -> list[Any]:
        """One value per response; a TRL function is called once (its list is checked for length)."""
        if self.convention != "trl":
            return [self.raw(task, response) for task, response in zip(tasks, responses)]
        return call_batched(self.fn, self.keywords, tasks, responses)

    def __call__(self, task: Mapping[str, Any], response: str) -> dict[str, float]:
        return scores_of(self.raw(task, response), self.batched)

    def score_batch(self, tasks: Sequence[Mapping[str, Any]], responses: Sequence[Any]) -> list[Outcome]:
        """Each response's scores, or its failure; raises only when a TRL call itself fails (then no
        response of the batch has a score)."""
        if not self.batched:
            return [_outcome(self, task, response) for task, response in zip(tasks, responses)]
        return [_outcome(scores_of, value, True) for value in self.raw_batch(tasks, responses)]

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
    return Reward(
        fn, name, found.convention, found.passes_extra_info, found.passes_data_source, found.keywords
    )


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
