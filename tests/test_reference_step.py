"""The reference step (nexrl_hpc/reference_step.py) computes the loss the framework computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexrl_hpc.algorithm.advantage_processor import AdvantageProcessor
from nexrl_hpc.models.tiny import load_tokenizer
from nexrl_hpc.reference_step import reference_step
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import compose_config


def test_the_reference_steps_loss_is_the_frameworks_on_the_same_trajectories(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    cfg = compose_config([f"run_dir={tmp_path}", "data.batch_size=4", "data.rollout_repeat_n=4"])
    step = reference_step(cfg, model_dir=tiny_model_dir)
    assert len(step.trajectories) == 16 and step.metrics["actor/optimizer_steps"] >= 1

    # the framework's path on the same trajectories: the advantage processor builds the training
    # batch, the train worker sends it to a trainer that starts from the same weights
    pad_token_id = load_tokenizer(tiny_model_dir).pad_token_id
    processed = AdvantageProcessor(cfg, pad_token_id=pad_token_id).compute(step.trajectories)
    worker = TrainWorker(cfg, PolicyTrainer(tiny_model_dir))
    worker.initialize_workers()
    worker.set_module_references(train_batch_pool=None, weight_sync_controller=object())  # type: ignore[arg-type]
    started = worker._start_step(processed, step=1)
    assert started is not None
    framework = started.update.result()["meta_info"]["metrics"]

    for key in ("input_ids", "response_mask", "behaviour_log_probs", "advantages"):
        assert torch.allclose(processed.values[key], step.tensors[key], rtol=1e-6, atol=1e-7), key
    for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert framework[key] == pytest.approx(step.metrics[key], rel=1e-6, abs=1e-7), key
