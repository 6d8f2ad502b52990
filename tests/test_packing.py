"""Padding-free training: packed forward passes and token-budget micro-batches compute what the
padded ones do — log-probs, entropy, losses and gradients, for every loss aggregation mode — on the
tiny char model and on a user's tied GQA Qwen2 with long, variable-length responses (FSDP2 and
DeepSpeed against the single process: tests/test_parallel_engines.py)."""

from __future__ import annotations

import pytest
import torch

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.models.tiny import load_model
from nexrl_hpc.trainer.packing import (
    micro_batch_ranges,
    pack_sequences,
    packed_response_log_probs_and_entropy,
    plan_micro_batches,
)
from nexrl_hpc.trainer.policy_trainer import response_log_probs_and_entropy
from nexrl_hpc.types import Batch
from tests.test_policy_trainer import trainer

PACKED = ["service.train_service.actor.packing=true"]


def variable_batch(
    n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Prompts of 1..max_prompt and responses of 1..max_response tokens (ids 4..vocab-1), with a
    tool-like stretch of loss-mask-0 tokens inside some responses."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for _ in range(n):
        p_len = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        r_len = int(torch.randint(1, max_response + 1, (1,), generator=g))
        loss_mask = [1] * r_len
        if r_len > 6:
            loss_mask[2:4] = [0, 0]
        trajs.append(
            {
                "prompt_ids": torch.randint(4, vocab, (p_len,), generator=g).tolist(),
                "response_ids": torch.randint(4, vocab, (r_len,), generator=g).tolist(),
                "behaviour_log_probs": [-2.0] * r_len,
                "loss_mask": loss_mask,
            }
        )
    t = pack_trajectories(Batch.from_trajectories(trajs), pad_token_id=0)
    t["old_log_probs"] = t["behaviour_log_probs"] + 0.1 * torch.randn(
        t["behaviour_log_probs"].shape, generator=g
    )
    t["advantages"] = torch.randn(n, 1, generator=g) * t["response_mask"]
    return t


def test_micro_batches_by_rows_or_by_a_token_budget() -> None:
    lengths = [5, 9, 3, 12, 2, 2]
    assert micro_batch_ranges(lengths, 4, None) == [(0, 4), (4, 6)]
    assert micro_batch_ranges(lengths, 4, 14) == [
        (0, 2),
        (2, 3),
        (3, 5),
        (5, 6),
    ]  # 14, 3 (+12 > 14), 12 + 2, 2
    assert micro_batch_ranges(lengths, 4, 10) == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
        (4, 6),
    ]  # 12 > 10 goes alone
    assert micro_batch_ranges([], 4, 10) == []


def test_a_packed_slice_is_binned_whole_then_cut_into_micro_batches() -> None:
    lengths = [5, 9, 3, 12, 2, 2]  # bins of 12 tokens, first fit in decreasing length
    assert plan_micro_batches(lengths, 4, None, packing=False) == [[[0], [1], [2], [3]], [[4], [5]]]
    assert plan_micro_batches(lengths, 4, 14, packing=True) == [[[3]], [[1, 2]], [[0, 4, 5]]]
    assert plan_micro_batches(lengths, 4, 30, packing=True) == [[[3], [1, 2]], [[0, 4, 5]]]
    assert plan_micro_batches(lengths, 5, None, packing=True) == [[[3], [1, 2]], [[0, 4, 5]]]  # by rows


def test_sequences_are_packed_first_fit_with_positions_restarting() -> None:
    # rows: prompt 2 + response 3 (5 real), prompt 1 + response 1 (2 real), prompt 3 + response 2 (5 real)
    micro = pack_trajectories(
        Batch.from_trajectories(
            [
                {"prompt_ids": [11, 12], "response_ids": [21, 22, 23], "behaviour_log_probs": [0.0] * 3},
                {"prompt_ids": [13], "response_ids": [24], "behaviour_log_probs": [0.0]},
                {"prompt_ids": [14, 15, 16], "response_ids": [25, 26], "behaviour_log_probs": [0.0] * 2},
            ]
        ),
        pad_token_id=0,
    )
    packed = pack_sequences(micro)
    # bins as wide as the longest sequence (5): [row 0], [row 2], then row 1 + padding
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23], [14, 15, 16, 25, 26], [13, 24, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    # response token j of row b is predicted by the logit one column before it
    got = sorted(
        zip(packed.seq.tolist(), packed.pos.tolist(), packed.bin_row.tolist(), packed.bin_col.tolist())
    )
    assert got == [(0, 0, 0, 1), (0, 1, 0, 2), (0, 2, 0, 3), (1, 0, 2, 0), (2, 0, 1, 2), (2, 1, 1, 3)]


@pytest.mark.parametrize("model", ["tiny", "chatml"])
def test_packed_log_probs_and_entropy_equal_the_padded_ones(
    model: str, tiny_model_dir: str, chatml_model_dir: str
) -> None:
    model_dir = tiny_model_dir if model == "tiny" else chatml_model_dir
    net = load_model(model_dir, torch.float32).eval()
    vocab = net.config.vocab_size
    micro = variable_batch(9, vocab, max_prompt=24, max_response=96 if model == "chatml" else 40)
    with torch.no_grad():
        ref_logp, ref_ent = response_log_probs_and_entropy(net, micro)
        logp, ent = packed_response_log_probs_and_entropy(net, micro, with_entropy=True, entropy_grad=False)
    assert ent is not None
    real = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
    assert float((ref_logp - logp)[real].abs().max()) <= 1e-5
    assert float((ref_ent - ent)[real].abs().max()) <= 1e-5
    assert float(logp[~real].abs().max()) == 0.0  # past each response: nothing


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_packed_token_budget_update_matches_the_padded_update(tiny_model_dir: str, agg: str) -> None:
    batch = variable_batch(16, 16, max_prompt=8, max_response=40, seed=3)
    common = [f"service.train_service.actor.loss_agg_mode={agg}", "service.train_service.actor.ppo_mini_batch_size=8",
              "service.train_service.actor.entropy_coeff=0.01"]  # fmt: skip
    padded = trainer(tiny_model_dir, [*common, "service.train_service.actor.ppo_micro_batch_size=3"])
    packed = trainer(
        tiny_model_dir, [*common, *PACKED, "service.train_service.actor.ppo_max_token_len_per_gpu=60"]
    )
    before = {k: v.clone() for k, v in padded.model.state_dict().items()}
    ref = padded.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    got = packed.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert got[key] == pytest.approx(ref[key], abs=1e-5), key
    assert got["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-5)
    worst = max(
        float((a - b).abs().max())
        for a, b in zip(padded.model.state_dict().values(), packed.model.state_dict().values())
    )
    moved = max(float((v - before[k]).abs().max()) for k, v in padded.model.state_dict().items())
    assert moved > 1e-4 and worst <= 1e-5, (moved, worst)
    a = padded.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"]
    b = packed.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"]
    assert float(((a - b) * batch["response_mask"]).abs().max()) <= 1e-5
