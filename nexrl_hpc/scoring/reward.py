"""The model reward behind the one reward API: ``run_reward(config)`` is the rollout worker's reward.

``ModelReward`` has TRL's batched form ``(prompts, completions, **kwargs) -> list[scores]``, so the
reward runner calls it once per submission of responses, off the worker's event loop, under
``rollout_worker.reward_timeout_s`` (a timeout or a raise scores the submission 0 and is counted:
``reward/timeouts``, ``reward/errors``). It scores in this process (``placement=colocated``: the
classifier loaded here, or a judge at ``judge.base_url``) or calls a ``RewardService`` over the
signed RPC (``placement=own_ranks``: ``set_service`` hands it the worker's service). With
``combine=replace`` it is the reward; with ``add`` it is one more member of the reward set
(``rewards/<reward_model|judge>`` logged beside the functions'), weighed by ``reward_model.weight``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute
from nexrl_hpc.rewards.checks import KEY, WEIGHTS_KEY
from nexrl_hpc.rewards.combined import RewardSet, function_names, load_rewards
from nexrl_hpc.rewards.loader import Reward, as_reward

if TYPE_CHECKING:
    from nexrl_hpc.scoring.service import RewardService, Scorer


def response_text(completion: Any) -> str:
    """A completion as TRL hands it over (text, or chat form) as text."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


class ModelReward:
    """The configured reward model or judge as a TRL-form batched reward function."""

    def __init__(self, config: RLTrainConfig) -> None:
        self._config = config
        rm = config["reward_model"]
        self.__name__ = "reward_model" if rm["type"] == "classifier" else "judge"
        self._remote = rm["placement"] == "own_ranks"
        self._service: RewardService | None = None
        self._scorer: Scorer | None = None
        if not self._remote:  # loaded with the worker: the first call's deadline is not the load's
            from nexrl_hpc.scoring.service import build_scorer

            self._scorer = build_scorer(config)

    def set_service(self, service: RewardService) -> None:
        self._service = service

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[dict[str, float]]:
        responses = [response_text(c) for c in completions]
        answers = list(kwargs.get("answer") or [None] * len(responses))
        if self._remote:
            if self._service is None:
                raise RuntimeError(
                    "reward_model.placement=own_ranks: no reward service was wired to this worker"
                )
            return execute(self._service.score_batch, list(prompts), responses, answers)
        assert self._scorer is not None
        return self._scorer.score_batch(list(prompts), responses, answers)

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()


def run_reward(config: RLTrainConfig) -> tuple[Reward | RewardSet, ModelReward | None]:
    """The single-turn worker's reward (``rollout_worker.reward_fn``, with the model reward as
    ``reward_model.combine`` says) and the model reward itself (None when ``reward_model.type`` is null)."""
    rw, rm = config["rollout_worker"], config["reward_model"]
    assert rw["reward_fn"] is not None  # rewards.checks: null only for a verifiers rollout
    functions = load_rewards(rw["reward_fn"], rw["reward_weights"], KEY, WEIGHTS_KEY)
    if rm["type"] is None:
        return functions, None
    model = ModelReward(config)
    scored = as_reward(model, "reward_model.type", f"reward_model:{rm['type']}")
    if rm["combine"] == "replace":
        if float(rm["weight"]) == 1.0:
            return scored, model
        return RewardSet((scored,), (float(rm["weight"]),), (scored.name,)), model
    members = functions.members if isinstance(functions, RewardSet) else (functions,)
    weights = functions.weights if isinstance(functions, RewardSet) else (1.0,)
    everything = (*members, scored)
    return RewardSet(everything, (*weights, float(rm["weight"])), function_names(everything)), model
