"""GuardedReward: an agent environment's reward, run as the single-turn worker runs its rewards.

An environment scores an action on its own thread and wants a ``RewardOutput`` back. This wraps the
run's reward in a RewardRunner (made on first call, so a workflow built only to check the config
starts no threads): a reward that raises (``sys.exit()`` and ``os._exit()`` included), returns no
number or runs past ``reward_timeout_s`` scores 0 instead of failing the episode (the processes it
started are reaped when its call ends: runner.py), and every output carries the counts
``reward/errors``/``reward/timeouts`` in its metadata for the episode's metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from nexrl_hpc.rewards.loader import Reward
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS, RewardRunner
from nexrl_hpc.rewards.types import RewardOutput

_OUTPUT = "_reward_output"  # the RewardOutput itself, carried through the runner's score dict


@dataclass(frozen=True)
class _KeepsOutput(Reward):
    """The reward called the agent stack's way; the runner passes the RewardOutput through."""

    def __call__(self, task: Mapping[str, Any], response: Any) -> dict[str, Any]:
        out = self.as_reward_output_fn()(task_info=dict(task), action=response)
        return {"reward": float(out.reward), _OUTPUT: out}


class GuardedReward:
    """``fn(task_info, action) -> RewardOutput`` that never raises and never waits past the timeout."""

    def __init__(self, reward: Reward, timeout_s: float, num_threads: int) -> None:
        self.reward = _KeepsOutput(**{f.name: getattr(reward, f.name) for f in fields(reward)})
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self._runner: RewardRunner | None = None
        self._lock = threading.Lock()

    def _runner_now(self) -> RewardRunner:
        with self._lock:
            if self._runner is None:
                self._runner = RewardRunner(self.reward, self.timeout_s, self.num_threads, "env-reward")
            return self._runner

    def __call__(self, task_info: dict[str, Any], action: Any) -> RewardOutput:
        scores = self._runner_now().score(task_info, action)
        out = scores.get(_OUTPUT)
        counts = {ERRORS: float(scores[ERRORS]), TIMEOUTS: float(scores[TIMEOUTS])}
        if not isinstance(out, RewardOutput):  # the call failed: scored 0
            return RewardOutput(0.0, counts, False)
        return RewardOutput(out.reward, {**out.metadata, **counts}, out.is_correct)

    def close(self) -> None:
        with self._lock:
            if self._runner is not None:
                self._runner.close()
                self._runner = None
