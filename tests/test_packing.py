"""Padding-free training: packed forward passes (and packed with shared prompts) and token-budget
micro-batches compute what the padded ones do — log-probs, entropy, losses and gradients, for every
loss aggregation mode — on the tiny char model and on a user's tied GQA Qwen2 with long,
variable-length responses (FSDP2 and DeepSpeed against the single process:
tests/test_parallel_engines.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.models.tiny import load_model
from nexrl_hpc.trainer import packing
from nexrl_hpc.trainer.logprobs import response_log_probs_and_entropy
from nexrl_hpc.trainer.packing import (
    micro_batch_ranges,
    pack_sequences,
    pack_shared_prompts,
    packed_response_log_probs_and_entropy,
    plan_micro_batches,
    plan_shared_prompt_micro_batches,
    prompt_keys_and_lengths,
)
from nexrl_hpc.types import Batch
from tests.test_policy_trainer import trainer

PADDED = ["service.train_service.actor.share_prompt=false"]  # padded unless actor.packing (default: auto)
PACKED = ["service.train_service.actor.packing=true", *PADDED]
SHARED = ["service.train_service.actor.share_prompt=true"]


def variable_batch(
    n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0, group: int = 1
) -> dict[str, torch.Tensor]:
    """Prompts of 1..max_prompt and responses of 1..max_response tokens (ids 4..vocab-1), with a
    tool-like stretch of loss-mask-0 tokens inside some responses; ``group`` consecutive rows share
    a prompt (a GRPO group's samples)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    prompt: list[int] = []
    for i in range(n):
        if i % group == 0:
            p_len = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
            prompt = torch.randint(4, vocab, (p_len,), generator=g).tolist()
        r_len = int(torch.randint(1, max_response + 1, (1,), generator=g))
        loss_mask = [1] * r_len
        if r_len > 6:
            loss_mask[2:4] = [0, 0]
        trajs.append(
            {
                "prompt_ids": prompt,
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


def test_rows_sharing_a_prompt_are_packed_as_the_prompt_once_then_each_response() -> None:
    # rows 0 and 2 share prompt [11, 12]; row 1 has prompt [13]
    micro = pack_trajectories(
        Batch.from_trajectories(
            [
                {"prompt_ids": [11, 12], "response_ids": [21, 22], "behaviour_log_probs": [0.0] * 2},
                {"prompt_ids": [13], "response_ids": [24, 25, 26], "behaviour_log_probs": [0.0] * 3},
                {"prompt_ids": [11, 12], "response_ids": [23], "behaviour_log_probs": [0.0]},
            ]
        ),
        pad_token_id=0,
    )
    keys, prompt_lengths = prompt_keys_and_lengths(micro)
    assert keys[0] == keys[2] != keys[1] and prompt_lengths == [2, 1, 2]
    lengths = micro["attention_mask"].sum(-1).tolist()  # 4, 4, 3 real tokens
    # families in order of first appearance; computed tokens: 2 + 2 + 1 = 5 and 1 + 3 = 4
    assert plan_shared_prompt_micro_batches(keys, prompt_lengths, lengths, 8, None) == [[[0, 2], [1]]]
    assert plan_shared_prompt_micro_batches(keys, prompt_lengths, lengths, 8, 8) == [[[0, 2]], [[1]]]
    assert plan_shared_prompt_micro_batches(keys, prompt_lengths, lengths, 8, 9) == [[[0, 2], [1]]]
    packed = pack_shared_prompts(micro, [[0, 2], [1]])
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23], [13, 24, 25, 26, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 0]]
    assert packed.allowed is not None
    assert packed.allowed[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # row 0's response sees the prompt and itself, causally
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # row 2's response: the prompt and itself, not row 0's response
    ]
    assert packed.allowed[1, 4].int().tolist() == [0, 0, 0, 0, 1]  # padding: itself only
    # the first response token is predicted by the prompt's last token, shared by the family
    got = sorted(
        zip(packed.seq.tolist(), packed.pos.tolist(), packed.bin_row.tolist(), packed.bin_col.tolist())
    )
    assert got == [(0, 0, 0, 1), (0, 1, 0, 2), (1, 0, 1, 0), (1, 1, 1, 1), (1, 2, 1, 2), (2, 0, 0, 1)]
    # two families in one bin: each sees its own prompt only
    both = pack_shared_prompts(micro, [[0, 1, 2]])
    assert both.input_ids.tolist() == [[11, 12, 21, 22, 23, 13, 24, 25, 26]]
    assert both.allowed is not None
    assert both.allowed[0, 7].int().tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0]  # row 1's 2nd response token
    assert both.allowed[0, 4].int().tolist() == [1, 1, 0, 0, 1, 0, 0, 0, 0]  # row 2's response token
    assert both.bin_col[both.seq == 1].tolist() == [5, 6, 7]


def test_a_prompt_drawn_by_two_groups_is_cut_back_to_group_size() -> None:
    """Two GRPO groups with the same prompt make one family of 2n rows: it is cut into two of n, so
    it does not set the width of every bin."""
    keys = [b"a"] * 4 + [b"b"] * 2 + [b"c"] * 2
    lengths = [5] * 8  # prompt 3 + response 2
    (micro,) = plan_shared_prompt_micro_batches(keys, [3] * 8, lengths, 64, None)
    assert sorted(micro) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model", ["tiny", "chatml"])
def test_shared_prompt_log_probs_and_entropy_equal_the_padded_ones(
    model: str, attn: str, tiny_model_dir: str, chatml_model_dir: str
) -> None:
    model_dir = tiny_model_dir if model == "tiny" else chatml_model_dir
    net = load_model(model_dir, torch.float32, attn_implementation=attn).eval()
    micro = variable_batch(
        12, net.config.vocab_size, max_prompt=24, max_response=64 if model == "chatml" else 30, group=4
    )
    keys, prompt_lengths = prompt_keys_and_lengths(micro)
    lengths = micro["attention_mask"].sum(-1).tolist()
    (bins,) = plan_shared_prompt_micro_batches(keys, prompt_lengths, lengths, 64, None)
    assert sorted(bins) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # widest family first
    with torch.no_grad():
        ref_logp, ref_ent = response_log_probs_and_entropy(net, micro)
        logp, ent = packed_response_log_probs_and_entropy(net, micro, True, False, bins, share_prompt=True)
    assert ent is not None
    real = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
    assert float((ref_logp - logp)[real].abs().max()) <= 1e-5
    assert float((ref_ent - ent)[real].abs().max()) <= 1e-5
    assert float(logp[~real].abs().max()) == 0.0


def test_shared_prompts_refuse_flash_attention_naming_the_key() -> None:
    from tests.test_hardware import _problems

    got = _problems([*SHARED, "hardware=gpu", "model.attn_implementation=flash_attention_2"])
    assert (
        "flash_attention_2 takes no custom attention mask" in got["service.train_service.actor.share_prompt"]
    )
    assert "service.train_service.actor.share_prompt" not in _problems([*SHARED, "hardware=gpu"])


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


@pytest.mark.parametrize("layout", ["packing", "share_prompt"])
@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_packed_token_budget_update_matches_the_padded_update(
    tiny_model_dir: str, agg: str, layout: str
) -> None:
    batch = variable_batch(
        16, 16, max_prompt=8, max_response=40, seed=3, group=4 if layout == "share_prompt" else 1
    )
    # Adam with eps=1 steps in proportion to the gradient: the weights then compare the gradients (with
    # eps=1e-8 a first step is ~lr * sign(g), and a gradient near 1e-8 makes summation order visible)
    common = [
        f"service.train_service.actor.loss_agg_mode={agg}",
        "service.train_service.actor.ppo_mini_batch_size=8",
        "service.train_service.actor.entropy_coeff=0.01",
        "service.train_service.actor.optim.eps=1.0",
        "service.train_service.actor.optim.lr=0.1",
    ]
    padded = trainer(tiny_model_dir, [*common, *PADDED, "service.train_service.actor.ppo_micro_batch_size=3"])
    packed = trainer(
        tiny_model_dir,
        [
            *common,
            *(PACKED if layout == "packing" else SHARED),
            "service.train_service.actor.ppo_max_token_len_per_gpu=60",
        ],
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


def test_auto_shares_prompts_only_where_its_estimate_is_cheaper(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 8 with 1-2 token responses (the default task's shape): sharing computes each prompt
    once and wins; with responses up to 400 tokens a family's row makes attention quadratic in
    its whole width, so the batch stays padded. flash_attention_2 never shares."""
    auto = trainer(tiny_model_dir, ["service.train_service.actor.share_prompt=auto"])
    short = variable_batch(64, 16, max_prompt=8, max_response=2, seed=1, group=8)
    long = variable_batch(64, 16, max_prompt=8, max_response=400, seed=1, group=8)
    assert auto.plan_batch("update_actor", short)[0]["shared_prompts"] is True
    assert auto.plan_batch("update_actor", long)[0]["shared_prompts"] is False
    packed_families: list[int] = []
    original = packing.pack_shared_prompts

    def counting(micro: dict[str, torch.Tensor], bins: list[list[int]], pad_token_id: int = 0) -> Any:
        packed_families.append(len(bins))
        return original(micro, bins, pad_token_id)

    monkeypatch.setattr(packing, "pack_shared_prompts", counting)
    padded = trainer(tiny_model_dir, PADDED)
    got = auto.compute_log_prob({"batch": dict(short)})["batch"]["old_log_probs"]
    assert packed_families  # the forward took the plan's choice
    ref = padded.compute_log_prob({"batch": dict(short)})["batch"]["old_log_probs"]
    assert float(((got - ref) * short["response_mask"]).abs().max()) <= 1e-5
    monkeypatch.setattr(auto.model.config, "_attn_implementation", "flash_attention_2")
    assert auto.plan_batch("update_actor", short)[0]["shared_prompts"] is False


@pytest.mark.parametrize("model_name", ["tiny", "qwen2_tied_gqa"])
def test_the_cost_estimate_reads_the_hf_config_through_an_engine_wrapper(
    model_name: str, tiny_model_dir: str, chatml_model_dir: str
) -> None:
    """A DeepSpeed engine holds DeepSpeed's own ``config`` and the model as ``module``; the estimate
    counts every weight matmul once, grouped-query K/V and a tied LM head included."""
    model = load_model(tiny_model_dir if model_name == "tiny" else chatml_model_dir)
    engine_like = SimpleNamespace(config={"train_batch_size": 8}, module=model)
    assert packing.hf_config(engine_like) is model.config
    per_token, per_pair = packing.forward_costs(packing.hf_config(engine_like))
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert per_pair == 4.0 * layers * hidden
    weights = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    assert per_token == 2.0 * (weights + hidden * model.config.vocab_size)  # every matmul weight, once
