"""LoRA policies (``service.train_service.actor.lora``, through real peft): only the adapter trains,
the KL reference is the base with the adapter off, checkpoints hold the adapter in PEFT layout
(``PeftModel.from_pretrained`` gives the trainer's log-probs), resume continues the adapter's
optimizer state exactly, and the merge command exports a plain HF directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nexrl_hpc.checkpoint.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer, response_log_probs
from tests.conftest import REPO
from tests.test_policy_trainer import make_batch, trainer

LORA = ["service.train_service.actor.lora.rank=4", "service.train_service.actor.lora.alpha=8"]


def _base_and_adapter(eng: PolicyTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    adapter = {k: v for k, v in state.items() if "lora_" in k}
    return {k: v for k, v in state.items() if k not in adapter}, adapter


def _train(eng: PolicyTrainer, steps: int, seed: int = 0) -> list[dict[str, Any]]:
    return [
        eng.update_actor({"batch": make_batch(8, seed + i)})["meta_info"]["metrics"] for i in range(steps)
    ]


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir, [*LORA, "model.gradient_checkpointing=true"])
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert eng.optimizer is not None
    held = [p for group in eng.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(trainable) and all(p.requires_grad for p in held)
    assert eng.optimizer.param_groups[0]["lr"] == 1.0e-2  # actor.lora.lr, not actor.optim.lr
    base0, adapter0 = _base_and_adapter(eng)
    metrics = _train(eng, 2)
    assert all(m["actor/optimizer_steps"] == 1 for m in metrics)
    base1, adapter1 = _base_and_adapter(eng)
    assert base0.keys() == base1.keys()
    for name in base0:  # bit-identical
        assert torch.equal(base0[name], base1[name]), name
    assert any(not torch.equal(adapter0[k], adapter1[k]) for k in adapter0)
    # optimizer state exists only for the adapter
    assert len(eng.optimizer.state) == len(trainable)


def test_packing_and_gradient_checkpointing_train_the_same_adapter(tiny_model_dir: str) -> None:
    plain = trainer(tiny_model_dir, LORA)
    packed = trainer(
        tiny_model_dir,
        [*LORA, "service.train_service.actor.packing=true", "model.gradient_checkpointing=true"],
    )
    metrics = [_train(eng, 1)[0] for eng in (plain, packed)]
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], abs=1e-6)
    grads = {n: p.grad for n, p in packed.model.named_parameters() if p.requires_grad}
    for name, p in plain.model.named_parameters():  # the step's gradients are kept after it
        if p.requires_grad:
            assert torch.allclose(p.grad, grads[name], atol=1e-7, rtol=1e-4), name
        else:
            assert p.grad is None and name not in grads


def test_kl_reference_is_the_base_with_the_adapter_off_and_no_second_copy(tiny_model_dir: str) -> None:
    kl = ["algorithm.kl_loss_coef=0.1"]
    eng = trainer(tiny_model_dir, [*LORA, *kl])
    assert eng.ref_model is None
    first = _train(eng, 1)[0]
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at 0: adapted == base
    second = _train(eng, 1, seed=5)[0]
    assert second["actor/kl_loss"] > 1e-6  # the adapter moved the policy away from the base


def _log_probs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(model.eval(), batch) * batch["response_mask"]


def test_a_checkpoint_is_a_peft_adapter_that_gives_the_trainers_log_probs(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    eng = trainer(tiny_model_dir, LORA)
    _train(eng, 2)
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=2)
    model_dir = tmp_path / "ckpt" / "model"
    assert sorted(os.listdir(model_dir)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert json.loads((model_dir / ADAPTER_CONFIG).read_text())["r"] == 4
    assert (model_dir / ADAPTER_WEIGHTS).stat().st_size < 200_000  # the adapter alone
    batch = make_batch(8, seed=9)
    expected = eng.compute_log_prob({"batch": batch})["batch"]["old_log_probs"] * batch["response_mask"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(model_dir))
    assert torch.allclose(_log_probs(loaded, batch), expected, atol=1e-6)
    # the base alone differs: the adapter is what the checkpoint adds
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not torch.allclose(_log_probs(plain, batch), expected, atol=1e-4)


def test_resume_continues_the_adapters_optimizer_state_exactly(tiny_model_dir: str, tmp_path: Path) -> None:
    straight = trainer(tiny_model_dir, LORA)
    _train(straight, 2)
    straight.save_checkpoint(str(tmp_path / "ckpt"), global_step=2)
    _train(straight, 2, seed=2)
    resumed = trainer(tiny_model_dir, LORA)
    resumed.load_checkpoint(str(tmp_path / "ckpt"), load_optimizer=True)
    _train(resumed, 2, seed=2)
    a, b = _base_and_adapter(straight)[1], _base_and_adapter(resumed)[1]
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_full_checkpoint_does_not_load_into_a_lora_policy(tiny_model_dir: str, tmp_path: Path) -> None:
    full = trainer(tiny_model_dir)
    full.save_checkpoint(str(tmp_path / "full"), global_step=1)
    eng = trainer(tiny_model_dir, LORA)
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        eng.load_checkpoint(str(tmp_path / "full"), load_optimizer=True)


def test_the_merge_command_exports_a_plain_model_with_the_adapted_log_probs(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    eng = trainer(tiny_model_dir, LORA)
    _train(eng, 2)
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=2)
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "launch.merge_lora", str(tmp_path / "ckpt"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / ADAPTER_CONFIG).exists() and (out / "config.json").exists()
    batch = make_batch(8, seed=4)
    expected = eng.compute_log_prob({"batch": batch})["batch"]["old_log_probs"] * batch["response_mask"]
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.allclose(_log_probs(merged, batch), expected, atol=1e-5)
    # a directory without an adapter is refused by name
    bad = subprocess.run(
        [sys.executable, "-m", "launch.merge_lora", tiny_model_dir, str(tmp_path / "x")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and ADAPTER_CONFIG in bad.stderr
