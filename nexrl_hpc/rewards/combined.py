"""Several reward functions with weights (TRL's ``reward_funcs`` + ``reward_weights``).

``rollout_worker.reward_fn`` may be a list; ``rollout_worker.reward_weights`` (null: 1 each) weighs
them. A sample's reward is the weighted sum of the functions that scored it (a function returning
None for it is left out, as TRL's ``nansum``); when every function returned None the sample is
skipped (``reward/skipped``, it trains nothing). Each function's own value is kept as
``rewards/<its name>`` (averaged over the samples it scored: ``train/rewards/<name>``). A function
that raises fails the sample (or, a batched call, the batch): scored 0 and counted, as one function's
failure is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nexrl_hpc.config.validate import ConfigError, ConfigProblem
from nexrl_hpc.rewards.loader import SKIPPED, Outcome, Reward, RewardFailure, contained, load_reward

PER_FUNCTION = "rewards/"
"""Score-key prefix of each function's own value when there are several."""


@dataclass(frozen=True)
class RewardSet:
    """Several rewards scored as one: ``reward_set(task, response)`` and ``score_batch`` as ``Reward``'s."""

    members: tuple[Reward, ...]
    weights: tuple[float, ...]
    names: tuple[str, ...]

    @property
    def spec(self) -> str:
        return ", ".join(m.spec for m in self.members)

    @property
    def batched(self) -> bool:
        return any(m.batched for m in self.members)

    def __call__(self, task: Mapping[str, Any], response: str) -> dict[str, float]:
        return self._combine([m(task, response) for m in self.members])

    def score_batch(self, tasks: Sequence[Mapping[str, Any]], responses: Sequence[Any]) -> list[Outcome]:
        by_member: list[list[Outcome]] = []
        for member in self.members:
            try:
                by_member.append(member.score_batch(tasks, responses))
            except BaseException as exc:
                if not contained(exc):
                    raise
                failure = RewardFailure.now(exc)
                by_member.append(
                    [RewardFailure(f"{member.name}: {failure.message}", failure.traceback)] * len(tasks)
                )
        out: list[Outcome] = []
        for i in range(len(tasks)):
            outcomes = [scores[i] for scores in by_member]
            failed = [o for o in outcomes if isinstance(o, RewardFailure)]
            out.append(failed[0] if failed else self._combine(outcomes))  # type: ignore[arg-type]
        return out

    def _combine(self, scores: list[dict[str, float]]) -> dict[str, float]:
        total, scored, extras = 0.0, False, {}
        for name, weight, member_scores in zip(self.names, self.weights, scores):
            # a skipped member's counters still count (a judge's failures: reward/judge_errors)
            extras.update({k: v for k, v in member_scores.items() if k not in ("reward", SKIPPED)})
            if member_scores.get(SKIPPED):
                continue
            scored = True
            total += weight * member_scores["reward"]
            extras[f"{PER_FUNCTION}{name}"] = member_scores["reward"]
        if not scored:
            return {"reward": 0.0, SKIPPED: 1.0}
        return {"reward": total, **extras}


def function_names(rewards: Sequence[Reward]) -> tuple[str, ...]:
    """Each function's own name; a name taken twice gets ``_2``, ``_3``, ... (metric keys differ)."""
    seen: dict[str, int] = {}
    names = []
    for reward in rewards:
        seen[reward.name] = seen.get(reward.name, 0) + 1
        names.append(reward.name if seen[reward.name] == 1 else f"{reward.name}_{seen[reward.name]}")
    return tuple(names)


def load_rewards(
    spec: str | Sequence[str], weights: Sequence[float] | None, key: str, weights_key: str
) -> Reward | RewardSet:
    """The reward of ``rollout_worker.reward_fn`` (one spec or a list) weighed by ``weights``; a
    ConfigError names the key of a function that does not load or a weight list of another length."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise ConfigError([ConfigProblem(key, "an empty list: name at least one reward function")])
    problems: list[ConfigProblem] = []
    rewards: list[Reward] = []
    for i, one in enumerate(specs):
        try:
            rewards.append(load_reward(one, key if isinstance(spec, str) else f"{key}[{i}]"))
        except ConfigError as exc:
            problems += exc.problems
    if weights is not None and len(weights) != len(specs):
        problems.append(
            ConfigProblem(
                weights_key, f"{len(weights)} weight(s) for {len(specs)} reward function(s) in {key}"
            )
        )
    if problems:
        raise ConfigError(problems)
    if len(rewards) == 1 and (weights is None or float(weights[0]) == 1.0):
        return rewards[0]
    chosen = tuple(float(w) for w in weights) if weights is not None else (1.0,) * len(rewards)
    return RewardSet(tuple(rewards), chosen, function_names(rewards))
