"""GRPO advantages, KL estimators and the clipped loss against hand-computed numbers; batch packing."""

from __future__ import annotations

import math

import pytest
import torch

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.algorithm.core_algos import aggregate, group_index, grpo_advantages, kl_penalty, ppo_clip_loss
from nexrl_hpc.algorithm.grpo import GRPOProcessor
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


def test_grpo_processor_builds_the_training_batch() -> None:
    cfg = compose_config()
    proc = GRPOProcessor(cfg, pad_token_id=0)
    trajs = []
    for g, rewards in (("a", [1.0, 0.0]), ("b", [0.0, 0.0])):
        for r in rewards:
            cut = g == "a" and r == 0.0  # one response ran into max_response_length
            trajs.append(
                {"group_id": g, "uid": g, "epoch": 0, "reward": r, "prompt_ids": [1, 4],
                 "response_ids": [5, 6, 7] if cut else [5, 2], "behaviour_log_probs": [-1.0] * (3 if cut else 2),
                 "loss_mask": [1] * (3 if cut else 2), "weight_version": 3, "finish_reason": "length" if cut else "stop"}
            )  # fmt: skip
    out = proc.compute(Batch.from_trajectories(trajs, {"model_tag": "default"}))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(
        out.values["advantages"], torch.tensor([[a, a, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0]]), atol=1e-5
    )
    metrics = out.metadata["metrics"]
    assert metrics["train/response_clip_ratio"] == 0.25
    assert metrics["train/response_length_mean"] == 2.25 and metrics["train/response_length_max"] == 3
    assert out.values["weight_version"].tolist() == [3, 3, 3, 3]
    assert out.metadata["metrics"]["train/reward_mean"] == 0.25
    assert out.metadata["uid"] == ["a", "a", "b", "b"] and out.metadata["model_tag"] == "default"


def test_stepwise_advantages_give_each_turn_its_own_group_normalised_return() -> None:
    """Two 2-turn episodes and a 1-turn one in a group: turn 1 normalised over all three, turn 2
    over the two that reached it; environment tokens between turns (masked) get nothing."""
    cfg = compose_config(["task=tool_lookup", "algorithm.advantage_granularity=step"])
    proc = GRPOProcessor(cfg, pad_token_id=0)
    # response: turn 1 = tokens [0, 2), env tokens [2, 3), turn 2 = [3, 4)
    episodes = [([0.5, 0.5], [[0, 2], [3, 4]], [1, 1, 0, 1]),
                ([0.0, 0.5], [[0, 2], [3, 4]], [1, 1, 0, 1]),
                ([0.5, 0.0], [[0, 2], [3, 4]], [1, 1, 0, 1]),
                ([0.0], [[0, 2]], [1, 1])]  # fmt: skip
    trajs = [
        {"group_id": "g", "uid": "g", "epoch": 0, "reward": sum(ret), "prompt_ids": [1],
         "response_ids": [5, 6, 7, 8][: len(mask)], "behaviour_log_probs": [-1.0] * len(mask),
         "loss_mask": mask, "step_returns": ret, "step_rewards": ret, "step_spans": spans}
        for ret, spans, mask in episodes
    ]  # fmt: skip
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
