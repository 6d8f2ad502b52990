"""The policy trainer: loss/gradient accumulation, NaN steps, checkpoints that plain transformers loads."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.checkpoint.state_file import load_state_file
from nexrl_hpc.trainer.logprobs import response_log_probs
from nexrl_hpc.trainer.loss_sums import LossSums
from nexrl_hpc.trainer.parallel import SingleProcess
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer, lr_factor
from nexrl_hpc.trainer.worker import TrainWorker
from nexrl_hpc.types import Batch
from tests.conftest import compose_config


def make_batch(n: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        p_len = 3 + i % 3
        r_len = 1 + i % 2
        trajs.append(
            {
                "prompt_ids": [1] + torch.randint(4, 16, (p_len,), generator=g).tolist(),
                "response_ids": torch.randint(4, 16, (r_len,), generator=g).tolist(),
                "behaviour_log_probs": [-2.5] * r_len,
            }
        )
    t = pack_trajectories(Batch.from_trajectories(trajs), pad_token_id=0)
    t["old_log_probs"] = t["behaviour_log_probs"].clone()
    t["advantages"] = torch.randn(n, 1, generator=g) * t["response_mask"]
    return t


def trainer(tiny_model_dir: str, overrides: list[str] | None = None) -> PolicyTrainer:
    cfg = compose_config(overrides or [])
    eng = PolicyTrainer(tiny_model_dir)
    worker = TrainWorker(cfg, eng)
    eng.initialize_worker(worker.train_service_config())
    eng.init_model()
    return eng


def params(eng: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.model.state_dict().items()}


def test_gradient_accumulation_matches_one_big_micro_batch(tiny_model_dir: str) -> None:
    batch = make_batch(16)
    a = trainer(tiny_model_dir, ["service.train_service.actor.ppo_micro_batch_size=16"])
    b = trainer(tiny_model_dir, ["service.train_service.actor.ppo_micro_batch_size=3"])
    ma = a.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    mb = b.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], abs=1e-6)
    grads_b = dict(b.model.named_parameters())
    for name, p in a.model.named_parameters():  # gradients of the (single) mini-batch are kept after the step
        assert torch.allclose(p.grad, grads_b[name].grad, atol=1e-7, rtol=1e-4), name


def test_compute_log_prob_matches_pre_update_forward(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir)
    batch = make_batch(8)
    lp = eng.compute_log_prob({"batch": batch})["batch"]["old_log_probs"]
    assert lp.shape == batch["responses"].shape
    batch["behaviour_log_probs"] = lp.clone()
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    assert metrics["actor/logprob_mismatch_max"] < 1e-6
    assert (lp * batch["response_mask"] <= 0).all()


def test_nan_loss_skips_the_optimizer_step(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir)
    before = params(eng)
    batch = make_batch(8)
    batch["advantages"][0, 0] = float("nan")
    metrics = eng.update_actor({"batch": batch})["meta_info"]["metrics"]
    assert metrics["actor/nan_skipped"] == 1 and metrics["actor/optimizer_steps"] == 0
    for k, v in params(eng).items():
        assert torch.equal(v, before[k]), k
    ok = eng.update_actor({"batch": make_batch(8)})["meta_info"]["metrics"]  # training goes on
    assert ok["actor/nan_skipped"] == 0 and ok["actor/optimizer_steps"] == 1


def test_batch_problems_name_the_key(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir)
    batch = make_batch(4)
    del batch["advantages"]
    with pytest.raises(KeyError, match="advantages"):
        eng.update_actor({"batch": batch})
    batch = make_batch(4)
    batch["advantages"] = batch["advantages"][:3]
    with pytest.raises(ValueError, match="different row counts"):
        eng.update_actor({"batch": batch})


def test_checkpoint_round_trip_and_plain_transformers_load(tiny_model_dir: str, tmp_path: Any) -> None:
    eng = trainer(tiny_model_dir)
    for seed in range(2):
        eng.update_actor({"batch": make_batch(8, seed)})
    eng.save_checkpoint(str(tmp_path), global_step=2)
    assert sorted(os.listdir(tmp_path / "model")) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "model.safetensors.xxh3",  # its digest, hashed as written: the checkpoint's COMPLETE takes it
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert sorted(os.listdir(tmp_path / "optimizer")) == ["rank_0.safetensors", "rank_0.safetensors.xxh3"]
    restored = trainer(tiny_model_dir)
    restored.load_checkpoint(str(tmp_path))
    for k, v in params(eng).items():
        assert torch.equal(v, params(restored)[k]), k
    # the same next step from both: optimizer moments and LR schedule were restored too
    m1 = eng.update_actor({"batch": make_batch(8, 9)})["meta_info"]["metrics"]
    m2 = restored.update_actor({"batch": make_batch(8, 9)})["meta_info"]["metrics"]
    assert m1["actor/lr"] == m2["actor/lr"]
    for k, v in params(eng).items():
        assert torch.allclose(v, params(restored)[k], atol=1e-7), k

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "model")
    ids = tok("m372=", return_tensors="pt").input_ids
    saved_state = load_state_file(str(tmp_path / "optimizer" / "rank_0.safetensors"))
    assert saved_state["global_step"] == 2 and ids[0, 0].item() == tok.bos_token_id
    assert not hf.config.tie_word_embeddings and "lm_head.weight" in dict(hf.named_parameters())


def test_resume_without_optimizer_state_says_why(tiny_model_dir: str, tmp_path: Any) -> None:
    eng = trainer(tiny_model_dir)
    eng.save_checkpoint(str(tmp_path), global_step=0, save_weight_only=True)
    with pytest.raises(FileNotFoundError, match="optimizer state missing"):
        trainer(tiny_model_dir).load_checkpoint(str(tmp_path))


def test_kl_to_reference_is_zero_before_the_policy_moves(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir, ["algorithm.kl_loss_coef=0.1", "algorithm.kl_loss_type=k3"])
    assert eng.ref_model is not None
    first = eng.update_actor({"batch": make_batch(8)})["meta_info"]["metrics"]
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    second = eng.update_actor({"batch": make_batch(8)})["meta_info"]["metrics"]
    assert second["actor/kl_loss"] > 0.0
    assert trainer(tiny_model_dir).ref_model is None  # coefficient 0: no reference model


def test_lr_warmup_then_constant_or_cosine() -> None:
    assert [lr_factor(s, 4, "constant", 10, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, 4, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 4, "cosine", 10, 0.1) == pytest.approx(0.1)


def test_deepspeed_refuses_optimizer_state_of_another_zero_stage() -> None:
    from nexrl_hpc.trainer.deepspeed_strategy import DeepSpeedZeRO

    strategy = DeepSpeedZeRO.__new__(DeepSpeedZeRO)  # the check runs before DeepSpeed is touched
    strategy.stage, strategy.world_size = 1, 2
    with pytest.raises(
        ValueError, match=r"ZeRO stage 3; this run has service.train_service.deepspeed.zero_stage=1"
    ):
        strategy.load_optimizer_state(torch.nn.Linear(1, 1), None, {"zero_stage": 3})  # type: ignore[arg-type]


def optimizer_tensors(eng: PolicyTrainer) -> dict[str, torch.Tensor]:
    assert eng.optimizer is not None
    return {
        f"{i}.{k}": v for i, s in enumerate(eng.optimizer.state.values()) for k, v in s.items() if v.dim() > 0
    }


def test_a_trained_engine_loads_a_checkpoint_into_its_own_memory(tiny_model_dir: str, tmp_path: Any) -> None:
    """The bytes go straight into the live parameters and optimizer moments (same storage after the
    load), and the result is the saved trainer exactly: the next step matches."""
    saved = trainer(tiny_model_dir)
    for seed in (1, 2):
        saved.update_actor({"batch": make_batch(8, seed)})
    saved.save_checkpoint(str(tmp_path), global_step=2)
    live = trainer(tiny_model_dir)
    live.update_actor({"batch": make_batch(8, 7)})  # other values, same shapes
    where = {k: v.data_ptr() for k, v in {**live.model.state_dict(), **optimizer_tensors(live)}.items()}
    live.load_checkpoint(str(tmp_path))
    after = {**live.model.state_dict(), **optimizer_tensors(live)}
    assert {k: v.data_ptr() for k, v in after.items()} == where
    for k, v in {**saved.model.state_dict(), **optimizer_tensors(saved)}.items():
        assert torch.equal(v, after[k]), k
    m1 = saved.update_actor({"batch": make_batch(8, 9)})["meta_info"]["metrics"]
    m2 = live.update_actor({"batch": make_batch(8, 9)})["meta_info"]["metrics"]
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"] and m1["actor/grad_norm"] == m2["actor/grad_norm"]


def test_a_checkpoint_that_does_not_fit_changes_nothing(tiny_model_dir: str, tmp_path: Any) -> None:
    """Shapes and optimizer layout are checked from the headers before a byte is read: the live
    weights and optimizer state stay as they were (before, the weights were replaced and then the
    optimizer refused)."""
    from safetensors.torch import load_file, save_file

    from nexrl_hpc.checkpoint.state_file import save_state_file

    src = trainer(tiny_model_dir)
    src.update_actor({"batch": make_batch(8, 1)})
    live = trainer(tiny_model_dir)
    live.update_actor({"batch": make_batch(8, 2)})
    before = {k: v.clone() for k, v in {**live.model.state_dict(), **optimizer_tensors(live)}.items()}

    def unchanged() -> None:
        for k, v in {**live.model.state_dict(), **optimizer_tensors(live)}.items():
            assert torch.equal(v, before[k]), k

    layout = tmp_path / "layout"
    src.save_checkpoint(str(layout), global_step=1)
    opt_file = str(layout / "optimizer" / "rank_0.safetensors")
    saved = load_state_file(opt_file)
    save_state_file({**saved, "world_size": 2, "engine": "deepspeed"}, opt_file)
    with pytest.raises(ValueError, match="engine=deepspeed on 2 rank"):
        live.load_checkpoint(str(layout))
    unchanged()
    # a layout that is resharded, with a saved rank's file missing: refused before a byte is read too
    save_state_file({**saved, "world_size": 2, "engine": "fsdp"}, opt_file)
    with pytest.raises(
        ValueError, match=r"rank_1\.safetensors: missing \(the checkpoint's optimizer state was written by 2"
    ):
        live.load_checkpoint(str(layout))
    unchanged()

    shapes = tmp_path / "shapes"
    src.save_checkpoint(str(shapes), global_step=1)
    weights = load_file(str(shapes / "model" / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.up_proj.weight"))
    weights[name] = weights[name][:-1].contiguous()
    save_file(weights, str(shapes / "model" / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"shapes differ from the model's: \['{name} \["):
        live.load_checkpoint(str(shapes))
    unchanged()
    live.update_actor({"batch": make_batch(8, 3)})  # still trains


def test_a_load_that_fails_halfway_keeps_the_engine_from_training(
    tiny_model_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error after the live state was partly overwritten: the error says so, training and
    saving refuse, and a load that succeeds clears it."""
    import errno

    from nexrl_hpc.checkpoint import tensor_reads

    src = trainer(tiny_model_dir)
    src.update_actor({"batch": make_batch(8, 1)})
    src.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    live = trainer(tiny_model_dir)
    live.update_actor({"batch": make_batch(8, 2)})
    real_preadv, calls = os.preadv, []

    def failing_preadv(fd: int, buffers: Any, offset: int) -> int:
        """EIO at the second read of the optimizer file (its first went into the live state);
        the weights, read meanwhile on the main thread, are read as they are."""
        if os.readlink(f"/proc/self/fd/{fd}").endswith("rank_0.safetensors"):
            calls.append(offset)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(tensor_reads.os, "preadv", failing_preadv)
    with pytest.raises(OSError, match="Input/output error; the tensors loaded in place are incomplete"):
        live.load_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.undo()
    with pytest.raises(
        RuntimeError, match="the last load_checkpoint failed halfway: rank 0: PartialLoadError"
    ):
        live.update_actor({"batch": make_batch(8, 3)})
    with pytest.raises(RuntimeError, match="load a checkpoint again"):
        live.save_checkpoint(str(tmp_path / "other"), global_step=1)
    live.load_checkpoint(str(tmp_path / "ckpt"))
    for k, v in src.model.state_dict().items():
        assert torch.equal(v, live.model.state_dict()[k]), k
    live.update_actor({"batch": make_batch(8, 3)})


def test_loss_sums_give_the_losses_per_optimizer_step_and_the_ratios_per_token() -> None:
    sums = LossSums()
    sums.add(
        LossSums(
            pg_loss=1.0,
            kl_loss=0.25,
            entropy_loss=0.5,
            clipfrac=2.0,
            clipfrac_lower=0.0,
            clipfrac_upper=2.0,
            clipfrac_dual=1.0,
            ppo_kl=0.5,
            entropy=6.0,
            tokens=4.0,
        )
    )
    sums.add(
        LossSums(
            pg_loss=3.0, kl_loss=0.25, entropy_loss=1.5, clipfrac=0.0, ppo_kl=1.5, entropy=2.0, tokens=4.0
        )
    )
    reduced = sums.all_reduced(SingleProcess())  # one rank: the sums themselves
    assert reduced == LossSums(
        pg_loss=4.0,
        kl_loss=0.5,
        entropy_loss=2.0,
        clipfrac=2.0,
        clipfrac_upper=2.0,
        clipfrac_dual=1.0,
        ppo_kl=2.0,
        entropy=8.0,
        tokens=8.0,
    )
    assert reduced.metrics(optimizer_steps=2, kl_loss_coef=0.5, entropy_coeff=0.1) == {
        "actor/pg_loss": 2.0,
        "actor/kl_loss": 0.25,
        "actor/entropy_loss": 1.0,
        "actor/loss": pytest.approx((4.0 + 0.5 * 0.5 - 0.1 * 2.0) / 2),
        "actor/pg_clipfrac": 0.25,
        "actor/pg_clipfrac_lower": 0.0,
        "actor/pg_clipfrac_upper": 0.25,
        "actor/pg_clipfrac_dual": 0.125,
        "actor/ppo_kl": 0.25,
        "actor/entropy": 1.0,
    }
    assert LossSums(clipfrac=3.0).metrics(1, 0.0, 0.0)["actor/pg_clipfrac"] == 3.0  # no tokens: divided by 1


def test_entropy_carries_gradient_only_for_the_bonus(tiny_model_dir: str) -> None:
    """With zero advantages the pg loss has no gradient: an update with entropy_coeff > 0 is pure
    entropy ascent (the batch's entropy rises); with 0 the entropy is built without a graph."""
    from nexrl_hpc.trainer.logprobs import response_log_probs_and_entropy

    batch = make_batch(8, seed=5)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    # a small step: Adam's first step moves every weight by lr, which overshoots at the default 1e-3
    eng = trainer(
        tiny_model_dir,
        ["service.train_service.actor.entropy_coeff=1.0", "service.train_service.actor.optim.lr=1e-5"],
    )
    mask = batch["response_mask"]

    def mean_entropy() -> float:
        with torch.no_grad():
            return float((response_log_probs_and_entropy(eng.model, batch)[1] * mask).sum() / mask.sum())

    assert not response_log_probs_and_entropy(eng.model, batch)[1].requires_grad
    assert response_log_probs_and_entropy(eng.model, batch, entropy_grad=True)[1].requires_grad
    before = mean_entropy()
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    assert metrics["actor/entropy_loss"] == pytest.approx(before, rel=1e-5)  # token-mean entropy
    assert metrics["actor/loss"] == pytest.approx(metrics["actor/pg_loss"] - before, rel=1e-5)
    assert metrics["actor/grad_norm"] > 0 and mean_entropy() > before


def test_entropy_metric_is_the_policys_mean_entropy_over_response_tokens(tiny_model_dir: str) -> None:
    """actor/entropy equals -sum p log p of the model before the update, averaged over the
    batch's response tokens (one epoch, one optimizer step: the forward is the pre-update model)."""
    from nexrl_hpc.trainer.logprobs import response_log_probs_and_entropy

    eng = trainer(tiny_model_dir, ["service.train_service.actor.ppo_mini_batch_size=16"])
    batch = make_batch(16, seed=4)
    with torch.no_grad():
        logp, entropy = response_log_probs_and_entropy(eng.model, batch)
        assert torch.allclose(logp, response_log_probs(eng.model, batch))
    mask = batch["response_mask"]
    expected = float((entropy * mask).sum() / mask.sum())
    assert 0.0 < expected <= math.log(eng.model.config.vocab_size) + 1e-6
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-5)
