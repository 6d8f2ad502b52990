"""Advantages against verl's formulas (written out here as verl writes them, per sample in Python
loops), and equal-reward groups: an exact "all equal" test gives exactly 0 and counts the group."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from nexrl_hpc.algorithm.core_algos import (
    batch_whiten,
    grpo_advantages,
    outcome_advantages,
    stepwise_grpo_advantages,
)

ESTIMATORS = ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def verl_grpo(scores: list[float], index: list[int], by_std: bool, eps: float) -> list[float]:
    """verl's compute_grpo_outcome_advantage (groups of >1; torch.std is unbiased)."""
    by_group: dict[int, list[float]] = {}
    for s, i in zip(scores, index):
        by_group.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        group = torch.tensor(by_group[i])
        mean, std = torch.mean(group), torch.std(group)
        out.append(float((s - mean) / (std + eps)) if by_std else float(s - mean))
    return out


def verl_rloo(scores: list[float], index: list[int]) -> list[float]:
    """verl's compute_rloo_outcome_advantage."""
    by_group: dict[int, list[float]] = {}
    for s, i in zip(scores, index):
        by_group.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        n = len(by_group[i])
        mean = float(torch.mean(torch.tensor(by_group[i])))
        out.append(s * n / (n - 1) - mean * n / (n - 1))
    return out


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_whiten: (v - masked mean) * rsqrt(unbiased masked var + 1e-8)."""
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups of 2-8 with partial-credit rewards that are not all equal, ragged masks."""
    rng = random.Random(seed)
    rewards: list[float] = []
    groups: list[int] = []
    for g in range(rng.randint(2, 6)):
        size = rng.randint(2, 8)
        values = [rng.choice([0.0, 0.1, 0.3, 0.7, 0.9, 1.0]) for _ in range(size)]
        values[0] = 0.05 if values[1] != 0.05 else 0.15  # never all equal
        if size == 3:  # a sample at its group's exact mean keeps verl's (non-zero) whitened value
            values = [0.0, 0.5, 1.0]
        rewards += values
        groups += [g] * size
    lengths = [rng.randint(1, 6) for _ in rewards]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    return torch.tensor(rewards), torch.tensor(groups), mask


@pytest.mark.parametrize("seed", range(20))
def test_non_equal_groups_match_verls_formulas(seed: int) -> None:
    rewards, groups, mask = _random_batch(seed)
    scores, index = rewards.tolist(), groups.tolist()
    for by_std in (True, False):
        ours, stats = outcome_advantages("grpo", rewards, groups, mask, by_std, 1e-6)
        assert ours.tolist() == pytest.approx(verl_grpo(scores, index, by_std, 1e-6), abs=1e-5)
        assert stats["zero_std_group_frac"] == 0.0
    ours, _ = outcome_advantages("rloo", rewards, groups, mask, True, 1e-6)
    assert ours.tolist() == pytest.approx(verl_rloo(scores, index), abs=1e-5)
    # REINFORCE++-baseline: group mean off, then whitened over the response tokens
    centered = torch.tensor(verl_grpo(scores, index, False, 1e-6))
    expected = verl_masked_whiten(centered[:, None] * mask, mask.float())
    ours, _ = outcome_advantages("reinforce_pp_baseline", rewards, groups, mask, True, 0.0)
    assert torch.allclose((ours[:, None] * mask)[mask.bool()], expected[mask.bool()], atol=1e-4)
    expected = verl_masked_whiten(rewards[:, None] * mask, mask.float())
    ours, _ = outcome_advantages("reinforce_pp", rewards, groups, mask, True, 0.0)
    assert torch.allclose((ours[:, None] * mask)[mask.bool()], expected[mask.bool()], atol=1e-4)


@pytest.mark.parametrize(("value", "size"), [(0.7, 16), (0.9, 64), (0.1, 8), (1 / 3, 12)])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_group_of_equal_inexact_rewards_gets_exactly_zero_and_is_counted(
    estimator: str, value: float, size: int
) -> None:
    rewards = torch.full((size,), value)
    mask = torch.ones(size, 3)
    # the rounding error the exact test removes (today's formula gave +0.106 for 0.7 x 16)
    assert float((rewards - rewards.mean()).abs().max()) > 0.0 or value == 0.1
    adv, stats = outcome_advantages(estimator, rewards, torch.zeros(size, dtype=torch.long), mask, True, 1e-6)
    assert adv.tolist() == [0.0] * size
    assert stats["zero_std_group_frac"] == 1.0


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_mixed_equal_groups_give_zero_and_a_group_with_spread_keeps_its_advantage(estimator: str) -> None:
    rewards = torch.tensor([0.7] * 8 + [0.1] * 8 + [0.9, 0.3, 0.3, 0.9])
    groups = torch.tensor([0] * 8 + [1] * 8 + [2] * 4)
    mask = torch.ones(20, 2)
    adv, stats = outcome_advantages(estimator, rewards, groups, mask, True, 1e-6)
    assert adv[:16].tolist() == [0.0] * 16
    assert stats["zero_std_group_frac"] == pytest.approx(2 / 3)
    assert bool((adv[16:] != 0).all())
    # only equal groups: nothing to whiten, exactly 0 (REINFORCE++-baseline gave +-0.032 here)
    adv, stats = outcome_advantages(estimator, rewards[:16], groups[:16], mask[:16], True, 1e-6)
    assert adv.tolist() == [0.0] * 16 and stats["zero_std_group_frac"] == 1.0


def test_grpo_keeps_verls_numbers_next_to_an_equal_group_and_reports_its_std_as_zero() -> None:
    rewards = torch.tensor([0.7] * 16 + [1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0] * 16 + [1] * 4)
    adv, stats = grpo_advantages(rewards, groups, True, 1e-6)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv[16:].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert stats["group_reward_std_mean"] == pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-6)


def test_batch_whiten_of_equal_values_is_exactly_zero_and_ignores_rows_without_tokens() -> None:
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    assert batch_whiten(torch.tensor([0.7, 0.7, 5.0]), mask, 1e-6).tolist() == [0.0] * 3
    assert batch_whiten(torch.full((3,), 0.9), torch.ones(3, 2), 1e-6).tolist() == [0.0] * 3


def test_per_turn_advantages_of_equal_turn_returns_are_exactly_zero() -> None:
    returns = [[0.7, 0.9]] * 16
    spans = [[[0, 2], [2, 4]]] * 16
    adv, stats = stepwise_grpo_advantages(returns, spans, torch.zeros(16, dtype=torch.long), 4, True, 1e-6)
    assert adv.abs().max() == 0.0
    assert stats["zero_std_group_frac"] == 1.0


def _problems(overrides: list[str]) -> dict[str, str]:
    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config.validate import ConfigError
    from tests.conftest import compose_raw

    try:
        validate_config(compose_raw(overrides))
    except ConfigError as err:
        return {p.path: p.message for p in err.problems}
    return {}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_one_sample_per_prompt_with_a_group_estimator_is_refused_naming_the_key(estimator: str) -> None:
    problems = _problems(["data.rollout_repeat_n=1", f"algorithm.adv_estimator={estimator}"])
    assert list(problems) == ["data.rollout_repeat_n"]
    assert f"adv_estimator={estimator}" in problems["data.rollout_repeat_n"]
    assert _problems(["data.rollout_repeat_n=2", f"algorithm.adv_estimator={estimator}"]) == {}


def test_one_sample_per_prompt_is_fine_without_a_group_baseline() -> None:
    assert _problems(["data.rollout_repeat_n=1", "algorithm.adv_estimator=reinforce_pp"]) == {}


def test_the_refusal_is_a_pre_flight_exit_2(tmp_path: Path) -> None:
    from tests.conftest import run_train

    proc = run_train([f"run_dir={tmp_path / 'run'}", "data.rollout_repeat_n=1"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.rollout_repeat_n: 1 sample per prompt with algorithm.adv_estimator=grpo" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
