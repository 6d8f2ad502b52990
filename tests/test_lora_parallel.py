"""LoRA on the parallel trainer engines: FSDP2 and DeepSpeed ZeRO-2/3 on two real gloo ranks train
the same adapter as one process (≤ 1e-5), with the KL reference taken with the adapter off, and
their checkpoints (the adapter in PEFT layout, per-rank optimizer state) resume exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nexrl_hpc.checkpoint.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.test_parallel_engines import _need_deepspeed, run_engines
from tests.test_policy_trainer import make_batch

pytestmark = pytest.mark.e2e

LORA = (
    "service.train_service.actor.lora.rank=4",
    "service.train_service.actor.lora.alpha=8",
    "algorithm.kl_loss_coef=0.1",  # the reference: the base with the adapter off, on every rank
    "service.train_service.actor.lora.modules_to_save=[norm,lm_head]",  # modules trained in full, sharded too
)


@pytest.fixture(scope="module")
def single_lora(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "single"
    run_engines([(tiny_model_dir, out, "single", LORA)], 1)
    return out


def assert_same_adapter_training(ref: Path, got: Path) -> None:
    for run in (ref, got):
        assert sorted(p.name for p in (run / "weights").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        assert sorted(p.name for p in (run / "ckpt" / "model").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    a = load_file(str(ref / "weights" / ADAPTER_WEIGHTS))
    b = load_file(str(got / "weights" / ADAPTER_WEIGHTS))
    # the adapter and the saved modules: the tiny model's norms and head
    assert set(a) == set(b) and all("lora_" in k or k.endswith(("norm.weight", "lm_head.weight")) for k in a)
    assert any("lm_head" in k for k in a) and any("lora_A" in k for k in a)
    assert max(float(a[k].abs().max()) for k in a if "lora_B" in k) > 1e-3  # the adapter did train
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, worst
    mask = make_batch(13, seed=0)["response_mask"]
    lp_ref, lp_got = torch.load(ref / "logp.pt"), torch.load(got / "logp.pt")
    assert float(((lp_ref - lp_got) * mask).abs().max()) <= 1e-6
    m_ref = json.loads((ref / "metrics.json").read_text())
    m_got = json.loads((got / "metrics.json").read_text())
    assert m_ref[-1]["actor/kl_loss"] > 1e-6  # the adapter moved the policy off the base
    for x, y in zip(m_ref, m_got):
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], abs=1e-6)
        assert y["actor/kl_loss"] == pytest.approx(x["actor/kl_loss"], abs=1e-6)
        assert y["actor/grad_norm"] == pytest.approx(x["actor/grad_norm"], rel=1e-5)
    for run in (ref, got):
        resumed = json.loads((run / "resumed.json").read_text())
        assert resumed["same_logp"] and resumed["next_update_diff"] == 0.0, (run, resumed)
        assert resumed["nan_skipped"] == 2 and resumed["nan_weights_equal"], (run, resumed)


def test_fsdp2_lora_on_two_ranks_matches_one_process(
    tiny_model_dir: str, single_lora: Path, tmp_path: Path
) -> None:
    run_engines([(tiny_model_dir, tmp_path / "fsdp", "fsdp", LORA)], 2)
    assert_same_adapter_training(single_lora, tmp_path / "fsdp")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_lora_on_two_ranks_matches_one_process(
    tiny_model_dir: str, single_lora: Path, tmp_path: Path, stage: int
) -> None:
    _need_deepspeed()
    over = (*LORA, f"service.train_service.deepspeed.zero_stage={stage}")
    run_engines([(tiny_model_dir, tmp_path / "ds", "deepspeed", over)], 2)
    assert_same_adapter_training(single_lora, tmp_path / "ds")
