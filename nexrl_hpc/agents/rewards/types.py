"""RewardOutput, the reward-function protocol, and loading a reward function named in the config."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

from nexrl_hpc.config.validate import ConfigError, ConfigProblem
from nexrl_hpc.core.imports import load_object


@dataclass
class RewardOutput:
    """What a reward function returns: the scalar, evaluation details, and correctness."""

    reward: float
    metadata: dict[str, Any] = field(default_factory=dict)
    is_correct: bool | None = None


class RewardFunction(Protocol):
    """``reward_fn(task_info, action) -> RewardOutput``; ``action`` is the model's final answer text."""

    def __call__(self, task_info: dict[str, Any], action: Any) -> RewardOutput: ...


def zero_reward(task_info: dict[str, Any], action: Any) -> RewardOutput:
    """The no-op default: every action earns 0."""
    return RewardOutput(reward=0.0, metadata={}, is_correct=None)


def load_reward_fn(spec: str, key: str = "reward_fn") -> RewardFunction:
    """Import ``"module:function"`` and check it can be called as ``fn(task_info=..., action=...)``.

    Why up front: a wrong path or signature should stop the run before start, with the config
    ``key`` named, not fail inside the first rollout.
    """
    try:
        fn = load_object(spec)
    except (ImportError, AttributeError) as exc:
        raise ConfigError([ConfigProblem(key, f"cannot import reward function {spec!r}: {exc}")]) from exc
    if not callable(fn):
        raise ConfigError([ConfigProblem(key, f"{spec!r} is a {type(fn).__name__}, not a callable")])
    try:
        inspect.signature(fn).bind(task_info={}, action="")
    except TypeError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    key,
                    f"{spec!r} must accept (task_info, action); its signature is {inspect.signature(fn)}: {exc}",
                )
            ]
        ) from exc
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn
