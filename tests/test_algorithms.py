"""GRPO advantages, KL estimators and the clipped loss against hand-computed numbers; batch packing."""

from __future__ import annotations

import math

import pytest
import torch

from nexrl_hpc.algorithm.advantage_processor import AdvantageProcessor, overlong_penalty
from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.algorithm.core_algos import (
    aggregate,
    group_index,
    grpo_advantages,
    gspo_loss,
    kl_penalty,
    outcome_advantages,
    policy_loss,
    ppo_clip_loss,
    rloo_advantages,
)
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.types import Batch
from tests.conftest import compose_config


def test_group_index_is_dense_in_first_seen_order() -> None:
    assert group_index(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_grpo_advantages_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, stats = grpo_advantages(rewards, groups, norm_by_std=True, epsilon=1e-6)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1,0,0,1]
    expected = 0.5 / (std + 1e-6)
    assert adv[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # all-equal group: no signal
    assert stats["zero_std_group_frac"] == 0.5
    adv_raw, _ = grpo_advantages(rewards, groups, norm_by_std=False, epsilon=1e-6)
    assert adv_raw.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_single_sample_group_has_zero_advantage() -> None:
    adv, _ = grpo_advantages(torch.tensor([3.0]), torch.tensor([0]), True, 1e-6)
    assert adv.tolist() == [0.0]


def test_kl_estimators_hand_computed() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    k3 = 0.5 - 1 + ln2  # r - 1 - log r with r = 0.25 / 0.5
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(k3)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(k3)
    assert kl_penalty(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k5")


def test_ppo_clip_loss_hand_computed() -> None:
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.9]]))  # ratios 1.5, 0.5, 0.9
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean")
    # tokens: max(-1.5, -1.2) = -1.2 ; max(0.5, 0.8) = 0.8 ; max(-0.9, -0.9) = -0.9
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 0.9) / 3)
    assert stats["clipfrac_sum"].item() == 2
    masked, _ = ppo_clip_loss(logp, old, adv, torch.tensor([[1.0, 0.0, 1.0]]), 0.2, 0.2, "token-mean")
    assert masked.item() == pytest.approx((-1.2 - 0.9) / 2)


def _rails_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five tokens (log ratio, advantage): (2, -1) ratio e^2 against a negative advantage,
    (ln 2.5, -1) below the dual bound, (2, +1) clipped above, (ln 0.5, -1) clipped below,
    (ln 0.9, +1) unclipped."""
    logp = torch.tensor([[2.0, math.log(2.5), 2.0, math.log(0.5), math.log(0.9)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0, 1.0]])
    return logp, torch.zeros(1, 5), adv, torch.ones(1, 5)


def test_dual_clip_bounds_the_loss_of_negative_advantages_hand_computed() -> None:
    logp, old, adv, mask = _rails_tokens()
    plain, plain_stats = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean")
    # tokens: max(e^2, 1.2) = e^2 ; max(2.5, 1.2) = 2.5 ; max(-e^2, -1.2) = -1.2 ; max(0.5, 0.8) = 0.8 ; -0.9
    assert plain.item() == pytest.approx((math.exp(2) + 2.5 - 1.2 + 0.8 - 0.9) / 5)  # 1.7178
    assert plain_stats["clipfrac_dual_sum"].item() == 0
    dual, stats = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean", clip_ratio_c=3.0)
    # the ratio-e^2 token is bounded at -A * c = 3; ratio 2.5 < c and positive advantages are untouched
    assert dual.item() == pytest.approx((3.0 + 2.5 - 1.2 + 0.8 - 0.9) / 5)  # 0.84
    assert stats["clipfrac_sum"].item() == 2
    assert stats["clipfrac_lower_sum"].item() == 1 and stats["clipfrac_upper_sum"].item() == 1
    assert stats["clipfrac_dual_sum"].item() == 1
    dual.backward()
    # d/dlogp of -A r = r / 5 where unclipped; the dual- and PPO-clipped tokens get no gradient
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.5 / 5, 0.0, 0.0, -0.9 / 5])


def test_log_ratio_clamp_keeps_an_extreme_ratio_finite() -> None:
    """A token with log ratio 100 (exp overflows float32): without the clamp its gradient is NaN
    and the whole step would be skipped; clamped at 20 the loss and gradients are finite."""
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)

    def run(clamp: float | None, c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.tensor([[100.0, 100.0, math.log(0.9)]], requires_grad=True)
        loss, _ = ppo_clip_loss(
            logp, old, adv, mask, 0.2, 0.2, "token-mean", clip_ratio_c=c, log_ratio_clamp=clamp
        )
        loss.backward()
        assert logp.grad is not None
        return loss.detach(), logp.grad

    loss, grad = run(None, 3.0)
    assert not torch.isfinite(grad).all()
    loss, grad = run(20.0, 3.0)
    # -1.2 (clipped above), min(e^20, 3) = 3 (dual clip), -0.9
    assert loss.item() == pytest.approx((-1.2 + 3.0 - 0.9) / 3)
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, -0.9 / 3])
    loss, grad = run(20.0, None)  # without the dual clip the negative-advantage token is e^20, finite
    assert loss.item() == pytest.approx((-1.2 + math.exp(20) - 0.9) / 3, rel=1e-6)
    assert torch.isfinite(grad).all()


def test_entropy_bonus_gradient_matches_the_closed_form() -> None:
    """d(-coeff * token-mean H)/dz = coeff / n * p (log p + H) per masked position, H = -sum p log p."""
    from nexrl_hpc.trainer.logprobs import entropy_from_log_probs

    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    coeff = 0.1
    entropy = entropy_from_log_probs(torch.log_softmax(logits, dim=-1))
    (-coeff * aggregate(entropy, mask, "token-mean")).backward()
    p = torch.softmax(logits.detach()[0, 0], dim=-1)
    h = float(-(p * p.log()).sum())
    assert entropy[0, 0].item() == pytest.approx(h)
    expected = coeff * p * (p.log() + h)
    assert logits.grad is not None
    assert torch.allclose(logits.grad[0, 0], expected, atol=1e-7)
    assert logits.grad[0, 1].abs().max().item() == 0.0  # masked position


def test_grpo_groups_by_every_key_of_a_hierarchical_key_list() -> None:
    """Leaves [1, 1] and [0, 0] under one first key are two groups of identical rewards: advantage
    0, not the +-0.87 of one group [1, 1, 0, 0]."""
    cfg = compose_config(["trajectory_pool.key_list=[group_id,leaf]"])
    proc = AdvantageProcessor(cfg, pad_token_id=0)
    trajs = [
        {
            "group_id": "q",
            "leaf": leaf,
            "uid": "q",
            "epoch": 0,
            "reward": r,
            "prompt_ids": [1, 4],
            "response_ids": [5, 2],
            "behaviour_log_probs": [-1.0, -1.0],
            "loss_mask": [1, 1],
        }
        for leaf, r in (("x", 1.0), ("x", 1.0), ("y", 0.0), ("y", 0.0))
    ]
    out = proc.compute(Batch.from_trajectories(trajs, {"model_tag": "default"}))
    assert out.values["advantages"].abs().max().item() == 0.0
    assert out.metadata["metrics"]["train/num_groups"] == 2
    one_key = AdvantageProcessor(compose_config(), pad_token_id=0).compute(Batch.from_trajectories(trajs, {}))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.866: what grouping by the first key alone gives
    assert one_key.values["advantages"][:, 0].tolist() == pytest.approx([a, a, -a, -a], abs=1e-5)


def test_adv_epsilon_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.adv_epsilon.*must be > 0.0, got 0"):
        compose_config(["algorithm.adv_epsilon=0"])


def test_loss_gradient_ignores_masked_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(
        logp, logp.detach(), torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), 0.2, 0.2, "token-mean"
    )
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0 and logp.grad[0, 0].item() != 0.0


def test_aggregation_modes() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(6 / 3)
    assert aggregate(values, mask, "token-mean", normalizer=6.0).item() == pytest.approx(1.0)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 3) / 2)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3) / 2)


def test_pack_left_pads_prompts_right_pads_responses() -> None:
    batch = Batch.from_trajectories(
        [
            {"prompt_ids": [1, 5], "response_ids": [8, 2], "behaviour_log_probs": [-0.1, -0.2]},
            {"prompt_ids": [1, 6, 7], "response_ids": [9], "behaviour_log_probs": [-0.3], "loss_mask": [1]},
        ]
    )
    t = pack_trajectories(batch, pad_token_id=0)
    assert t["input_ids"].tolist() == [[0, 1, 5, 8, 2], [1, 6, 7, 9, 0]]
    assert t["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert t["position_ids"].tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert t["responses"].tolist() == [[8, 2], [9, 0]]
    assert t["response_mask"].tolist() == [[1, 1], [1, 0]]
    assert torch.allclose(t["behaviour_log_probs"], torch.tensor([[-0.1, -0.2], [-0.3, 0.0]]))


def test_pack_rejects_inconsistent_trajectories() -> None:
    bad = Batch.from_trajectories(
        [{"prompt_ids": [1], "response_ids": [2, 3], "behaviour_log_probs": [-1.0]}]
    )
    with pytest.raises(ValueError, match="2 response tokens but 1 behaviour logprobs"):
        pack_trajectories(bad, 0)


def test_advantage_processor_builds_the_training_batch() -> None:
    cfg = compose_config()
    proc = AdvantageProcessor(cfg, pad_token_id=0)
    trajs = []
    for g, rewards in (("a", [1.0, 0.0]), ("b", [0.0, 0.0])):
        for r in rewards:
            cut = g == "a" and r == 0.0  # one response ran into max_response_length
            trajs.append(
                {
                    "group_id": g,
                    "uid": g,
                    "epoch": 0,
                    "reward": r,
                    "prompt_ids": [1, 4],
                    "response_ids": [5, 6, 7] if cut else [5, 2],
                    "behaviour_log_probs": [-1.0] * (3 if cut else 2),
                    "loss_mask": [1] * (3 if cut else 2),
                    "weight_version": 3,
                    "finish_reason": "length" if cut else "stop",
                    "rollout_times": [10.0 + len(trajs), 11.0 + len(trajs), 11.5 + len(trajs)],
                }
            )
    out = proc.compute(Batch.from_trajectories(trajs, {"model_tag": "default"}))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(
        out.values["advantages"], torch.tensor([[a, a, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0]]), atol=1e-5
    )
    metrics = out.metadata["metrics"]
    assert metrics["train/response_clip_ratio"] == 0.25
    assert metrics["train/response_length_mean"] == 2.25 and metrics["train/response_length_max"] == 3
    assert metrics["train/response_length_min"] == 2 and metrics["perf/generated_tokens"] == 9
    # when the batch was generated and scored: the trainer splits its wait by these
    assert out.metadata["rollout_intervals"] == {
        "generation": [(10.0, 14.0)],
        "reward": [(11.0, 11.5), (12.0, 12.5), (13.0, 13.5), (14.0, 14.5)],
    }
    assert out.values["weight_version"].tolist() == [3, 3, 3, 3]
    assert out.metadata["metrics"]["train/reward_mean"] == 0.25
    assert out.metadata["uid"] == ["a", "a", "b", "b"] and out.metadata["model_tag"] == "default"


def test_stepwise_advantages_give_each_turn_its_own_group_normalised_return() -> None:
    """Two 2-turn episodes and a 1-turn one in a group: turn 1 normalised over all three, turn 2
    over the two that reached it; environment tokens between turns (masked) get nothing."""
    cfg = compose_config(["task=tool_lookup", "algorithm.advantage_granularity=step"])
    proc = AdvantageProcessor(cfg, pad_token_id=0)
    # response: turn 1 = tokens [0, 2), env tokens [2, 3), turn 2 = [3, 4)
    episodes = [
        ([0.5, 0.5], [[0, 2], [3, 4]], [1, 1, 0, 1]),
        ([0.0, 0.5], [[0, 2], [3, 4]], [1, 1, 0, 1]),
        ([0.5, 0.0], [[0, 2], [3, 4]], [1, 1, 0, 1]),
        ([0.0], [[0, 2]], [1, 1]),
    ]
    trajs = [
        {
            "group_id": "g",
            "uid": "g",
            "epoch": 0,
            "reward": sum(ret),
            "prompt_ids": [1],
            "response_ids": [5, 6, 7, 8][: len(mask)],
            "behaviour_log_probs": [-1.0] * len(mask),
            "loss_mask": mask,
            "step_returns": ret,
            "step_rewards": ret,
            "step_spans": spans,
        }
        for ret, spans, mask in episodes
    ]
    adv = proc.compute(Batch.from_trajectories(trajs, {"model_tag": "default"})).values["advantages"]
    t1, _ = grpo_advantages(torch.tensor([0.5, 0.0, 0.5, 0.0]), torch.zeros(4, dtype=torch.long), True, 1e-6)
    t2, _ = grpo_advantages(torch.tensor([0.5, 0.5, 0.0]), torch.zeros(3, dtype=torch.long), True, 1e-6)
    expected = torch.tensor(
        [
            [t1[0], t1[0], 0.0, t2[0]],
            [t1[1], t1[1], 0.0, t2[1]],
            [t1[2], t1[2], 0.0, t2[2]],
            [t1[3], t1[3], 0.0, 0.0],
        ]
    )
    assert torch.allclose(adv, expected, atol=1e-6), adv
    # episode 1 (wrong call, faithful answer) has the group's mean total reward: episode-level GRPO
    # gives it 0 everywhere; step-wise, its call is discouraged and its answer encouraged
    assert adv[1, 0] < 0 < adv[1, 3]


def test_stepwise_advantages_need_agent_rollouts() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["algorithm.advantage_granularity=step"])
    assert [p.path for p in info.value.problems] == ["algorithm.advantage_granularity"]


def test_rloo_subtracts_the_mean_of_the_groups_other_samples() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    adv, stats = rloo_advantages(rewards, groups)
    # group 0: 1 - (0+0)/2, 0 - (1+0)/2 twice; group 1 alone: no baseline; group 2: 2-4, 4-2
    assert adv.tolist() == [1.0, -0.5, -0.5, 0.0, -2.0, 2.0]
    assert stats["zero_std_group_frac"] == pytest.approx(1 / 3)


def test_reinforce_pp_whitens_the_rewards_over_the_batchs_tokens() -> None:
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv, _ = outcome_advantages(
        "reinforce_pp", torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, True, 0.0
    )
    # token-weighted: mean (1*1 + 0*3)/4 = 0.25, var (0.75^2 + 3 * 0.25^2)/3 = 0.25, std 0.5
    assert torch.allclose(adv, torch.tensor([1.5, -0.5]))


def test_reinforce_pp_baseline_takes_the_group_mean_off_then_whitens() -> None:
    mask = torch.tensor([[1, 0], [1, 0], [1, 1]])
    rewards, groups = torch.tensor([1.0, 0.0, 7.0]), torch.tensor([0, 0, 1])
    adv, _ = outcome_advantages("reinforce_pp_baseline", rewards, groups, mask, True, 0.0)
    # centred [0.5, -0.5, 0]; weights [1, 1, 2]: mean 0, var (0.25 + 0.25)/3, std sqrt(1/6)
    std = math.sqrt(1 / 6)
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0]))


def test_outcome_advantages_grpo_is_grpo_and_unknown_estimators_are_named() -> None:
    rewards, groups, mask = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1)
    adv, _ = outcome_advantages("grpo", rewards, groups, mask, True, 1e-6)
    assert torch.allclose(adv, grpo_advantages(rewards, groups, True, 1e-6)[0])
    with pytest.raises(ValueError, match="adv_estimator 'ppo'"):
        outcome_advantages("ppo", rewards, groups, mask, True, 1e-6)


def test_dr_grpo_aggregation_divides_token_sums_by_a_constant_budget() -> None:
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # per-sequence sums 3 and 3 (masked tokens out); no normaliser: sequences x padded width
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(6 / (2 * 3))
    # the trainer's normaliser: sequences in the mini-batch x actor.loss_norm_tokens
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm", normalizer=2 * 10)) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "preset,estimator,by_std,agg",
    [
        ("grpo", "grpo", True, "token-mean"),
        ("dr_grpo", "grpo", False, "seq-mean-token-sum-norm"),
        ("rloo", "rloo", True, "token-mean"),
        ("reinforce_pp", "reinforce_pp", True, "token-mean"),
        ("reinforce_pp_baseline", "reinforce_pp_baseline", True, "token-mean"),
        ("dapo", "grpo", True, "token-mean"),
        ("gspo", "grpo", True, "seq-mean-token-mean"),
    ],
)
def test_algorithm_presets_set_their_keys(preset: str, estimator: str, by_std: bool, agg: str) -> None:
    cfg = compose_config([f"algorithm={preset}"])
    assert cfg["algorithm"]["name"] == preset and cfg["algorithm"]["adv_estimator"] == estimator
    assert cfg["algorithm"]["norm_adv_by_std"] is by_std
    actor = cfg["service"]["train_service"]["actor"]
    assert (
        actor["loss_agg_mode"] == agg
        and actor["loss_norm_tokens"] == cfg["rollout_worker"]["max_response_length"]
    )


def test_per_turn_advantages_need_the_grpo_estimator() -> None:
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: rloo gives one advantage per sequence"):
        compose_config(["task=tool_lookup", "algorithm=rloo"])


def test_the_processor_uses_the_configured_estimator() -> None:
    proc = AdvantageProcessor(compose_config(["algorithm=rloo"]), pad_token_id=0)
    trajs = [
        {
            "group_id": "a",
            "uid": "a",
            "epoch": 0,
            "reward": r,
            "prompt_ids": [1, 4],
            "response_ids": [5, 2],
            "behaviour_log_probs": [-1.0, -1.0],
            "loss_mask": [1, 1],
            "weight_version": 0,
        }
        for r in (1.0, 0.0, 0.0)
    ]
    out = proc.compute(Batch.from_trajectories(trajs, {"model_tag": "default"}))
    assert out.values["advantages"][:, 0].tolist() == [1.0, -0.5, -0.5]


def test_dapo_and_gspo_presets_set_their_own_keys() -> None:
    dapo = compose_config(["algorithm=dapo", "rollout_worker.max_response_length=20"])
    actor = dapo["service"]["train_service"]["actor"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28)  # clip-higher
    assert dapo["algorithm"]["filter_groups"]["enable"] and dapo["algorithm"]["kl_loss_coef"] == 0.0
    assert dapo["algorithm"]["overlong"]["buffer_len"] == 4  # a fifth of the response budget
    assert compose_config(["algorithm=dapo"])["algorithm"]["overlong"]["buffer_len"] == 0  # 2 tokens: off
    gspo = compose_config(["algorithm=gspo"])["service"]["train_service"]["actor"]
    assert gspo["policy_loss"] == "gspo" and (gspo["clip_ratio_low"], gspo["clip_ratio_high"]) == (3e-4, 4e-4)


def test_gspo_takes_one_ratio_per_sequence_hand_computed() -> None:
    # sequence 0: token log-ratios 0.2 and -0.1 (mean 0.05); sequence 1: 0.3 and a masked token
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, -0.1], [0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = gspo_loss(logp, old, adv, mask, 0.1, 0.1, "seq-mean-token-mean")
    s0, s1 = (
        math.exp(0.05),
        math.exp(0.3),
    )  # s1 = 1.35 > 1 + 0.1: clipped for A < 0 only if it lowers the loss
    # A > 0: -min(s0, clip) = -s0 (s0 inside the range); A < 0: max(s1, clip(s1)) * 1 = s1 (unclipped)
    assert float(loss.detach()) == pytest.approx((-s0 + s1) / 2, rel=1e-6)
    assert float(stats["clipfrac_sum"]) == 0.0
    loss.backward()
    # d/dlogp_t of the sequence term: A * s_i / |y_i| per token, halved by the mean over sequences
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 2 / 2, -s0 / 2 / 2], rel=1e-6)
    assert logp.grad[1].tolist() == pytest.approx([s1 / 2, 0.0], rel=1e-6)
    # a sequence ratio outside the range is clipped as a whole: no gradient on any of its tokens
    logp2 = torch.tensor([[0.5, 0.5]], requires_grad=True)
    clipped, stats2 = gspo_loss(
        logp2, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.1, 0.1, "token-mean"
    )
    assert float(clipped.detach()) == pytest.approx(-1.1) and float(stats2["clipfrac_upper_sum"]) == 2.0
    clipped.backward()
    assert logp2.grad is not None and logp2.grad.abs().sum() == 0.0
    assert policy_loss("gspo") is gspo_loss and policy_loss("vanilla") is ppo_clip_loss
    with pytest.raises(ValueError, match="unknown actor.policy_loss 'ppo2'"):
        policy_loss("ppo2")


def test_gspo_equals_ppo_for_one_token_responses() -> None:
    logp = torch.tensor([[0.3], [-0.4]])
    old = torch.tensor([[0.1], [0.1]])
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.ones(2, 1)
    a, _ = gspo_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean", clip_ratio_c=3.0)
    b, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token-mean", clip_ratio_c=3.0)
    assert float(a) == pytest.approx(float(b))


def test_soft_overlong_penalty_hand_computed() -> None:
    lengths = torch.tensor([10, 16, 18, 20])
    # max 20, buffer 4: free up to 16 tokens, then -0.5 per token over it (factor 2 over 4 tokens)
    assert overlong_penalty(lengths, 20, 4, 2.0).tolist() == [0.0, 0.0, 1.0, 2.0]
    assert overlong_penalty(lengths, 20, 0, 2.0).tolist() == [0.0] * 4


def _trajs(rewards: list[float], lengths: list[int], finish: list[str]) -> list[dict]:
    return [
        {
            "group_id": "a",
            "uid": "a",
            "epoch": 0,
            "sample_index": i,
            "reward": r,
            "prompt_ids": [1, 4],
            "response_ids": [5] * n,
            "behaviour_log_probs": [-1.0] * n,
            "loss_mask": [1] * n,
            "weight_version": 0,
            "finish_reason": f,
        }
        for i, (r, n, f) in enumerate(zip(rewards, lengths, finish))
    ]


def test_the_processor_shapes_overlong_responses_before_the_advantage_and_can_mask_them() -> None:
    cfg = compose_config(
        [
            "rollout_worker.max_response_length=4",
            "algorithm.overlong.buffer_len=2",
            "algorithm.overlong.penalty_factor=1.0",
            "algorithm.norm_adv_by_std=false",
        ]
    )
    out = AdvantageProcessor(cfg, pad_token_id=0).compute(
        Batch.from_trajectories(_trajs([1.0, 1.0], [2, 4], ["stop", "length"]), {"model_tag": "default"})
    )
    # the 4-token response loses 1.0 (the whole factor at the limit): shaped rewards 1.0 and 0.0
    assert out.values["advantages"][:, 0].tolist() == [0.5, -0.5]
    assert out.values["rewards"].tolist() == [1.0, 1.0]  # as scored
    assert out.metadata["metrics"]["train/overlong_penalty_mean"] == 0.5
    cfg = compose_config(["rollout_worker.max_response_length=4", "algorithm.overlong.filter=true"])
    out = AdvantageProcessor(cfg, pad_token_id=0).compute(
        Batch.from_trajectories(_trajs([1.0, 0.0], [2, 4], ["stop", "length"]), {"model_tag": "default"})
    )
    assert out.values["response_mask"][1].sum() == 0 and out.values["advantages"][1].abs().sum() == 0
    assert out.values["response_mask"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.values["advantages"][0, 0] > 0  # the cut-off sample still counted in the group's baseline
    assert out.metadata["metrics"]["train/overlong_filtered"] == 1


def test_dynamic_sampling_and_overlong_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: dynamic sampling compares"):
        compose_config(["algorithm=dapo", "data.rollout_repeat_n=1"])
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: dynamic sampling drops"):
        compose_config(["algorithm=dapo", "trajectory_pool.key_list=[]"])
    with pytest.raises(ConfigError, match="algorithm.overlong.buffer_len: must be below"):
        compose_config(["algorithm.overlong.buffer_len=2"])
    with pytest.raises(ConfigError, match="algorithm.overlong.buffer_len: the soft overlong penalty"):
        compose_config(["task=tool_lookup", "algorithm.overlong.buffer_len=1"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_identical_rewards_and_groups_of_one_give_zero_advantages_for_every_estimator(estimator: str) -> None:
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    same, _ = outcome_advantages(
        estimator, torch.full((4,), 0.7), torch.tensor([0, 0, 1, 1]), mask, True, 1e-6
    )
    assert same.abs().max() == 0.0
    if estimator != "reinforce_pp":  # the group estimators: a group of one has no baseline
        alone, _ = outcome_advantages(
            estimator, torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask[:2], True, 1e-6
        )
        assert alone.tolist() == [0.0, 0.0]


def test_every_name_the_config_accepts_has_an_implementation_and_the_schema_types_it() -> None:
    import typing

    from nexrl_hpc.algorithm.core_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from nexrl_hpc.config.algorithm_names import AdvantageEstimator, KLEstimator, PolicyLossName
    from nexrl_hpc.config.schema import AlgorithmConfig
    from nexrl_hpc.config.train_service_schema import ActorConfig

    assert set(ADVANTAGE_ESTIMATORS) == set(AdvantageEstimator)
    assert set(POLICY_LOSSES) == set(PolicyLossName)
    for kind in KLEstimator:
        assert kl_penalty(torch.zeros(1), torch.zeros(1), kind).tolist() == [0.0]
    algorithm, actor = typing.get_type_hints(AlgorithmConfig), typing.get_type_hints(ActorConfig)
    assert algorithm["adv_estimator"] is AdvantageEstimator and algorithm["kl_loss_type"] is KLEstimator
    assert actor["policy_loss"] is PolicyLossName


def test_the_actor_loss_is_the_surrogate_minus_the_entropy_bonus_plus_the_kl_penalty() -> None:
    from nexrl_hpc.algorithm.loss import ActorLoss, LossInputs

    actor = compose_config()["service"]["train_service"]["actor"]
    actor = {**actor, "entropy_coeff": 0.01}
    loss_fn = ActorLoss.from_config(actor, {"kl_loss_coef": 0.1, "kl_loss_type": "k3"})
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(3, 4, generator=g).clamp(max=-0.1).requires_grad_()
    entropy = torch.rand(3, 4, generator=g)
    tensors = {
        "old_log_probs": log_prob.detach() - 0.05,
        "advantages": torch.randn(3, 4, generator=g),
        "response_mask": torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
    }
    ref = log_prob.detach() + 0.2
    loss, metrics = loss_fn(LossInputs(log_prob, entropy, tensors, 9.0, ref))
    mask, agg = tensors["response_mask"], actor["loss_agg_mode"]
    pg, _ = ppo_clip_loss(
        log_prob,
        tensors["old_log_probs"],
        tensors["advantages"],
        mask,
        actor["clip_ratio_low"],
        actor["clip_ratio_high"],
        agg,
        9.0,
        clip_ratio_c=actor["clip_ratio_c"],
        log_ratio_clamp=actor["log_ratio_clamp"],
    )
    kl = aggregate(kl_penalty(log_prob, ref, "k3"), mask, agg, 9.0)
    expected = pg - 0.01 * aggregate(entropy, mask, agg, 9.0) + 0.1 * kl
    assert float(loss.detach()) == float(expected.detach()) and float(metrics["kl_loss"]) == float(
        kl.detach()
    )
    assert float(metrics["entropy"]) == pytest.approx(float((entropy * mask).sum()))
    assert float(metrics["tokens"]) == 9.0 and float(metrics["pg_loss"]) == float(pg.detach())
    assert loss_fn.entropy_needs_grad
    without_ref = loss_fn(LossInputs(log_prob, entropy, tensors, 9.0, None))
    assert float(without_ref[1]["kl_loss"]) == 0.0
