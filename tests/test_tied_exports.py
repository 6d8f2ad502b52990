"""A tied model (embedding = lm_head) is written with the embedding once, as ``save_pretrained``
writes it, and every reader re-ties it: transformers, the local inference engine, a resumed
trainer. Only the weight exports a vLLM server reloads also carry ``lm_head.weight`` (its in-place
reload refreshes the head from that entry alone: tests/test_vllm.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nexrl_hpc.checkpoint.hf import peek_safetensors_dir, read_safetensors_dir
from nexrl_hpc.inference.engine import HFEngine
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import compose_config
from tests.test_policy_trainer import make_batch

EMBEDDING = "model.embed_tokens.weight"


def _trained(model_dir: str, overrides: tuple[str, ...] = ()) -> PolicyTrainer:
    """The single engine on the tied model after one update (the embedding has moved)."""
    cfg = compose_config(["service.train_service.actor.optim.lr=1.0e-2", *overrides])
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config())
    eng.init_model()
    eng.update_actor({"batch": make_batch(8, seed=0)})
    return eng


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 12, 7, 30, 2]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.name.endswith(".safetensors"))


def test_checkpoint_and_export_of_a_tied_model_hold_the_embedding_once(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    eng = _trained(chatml_model_dir)
    assert eng.model.lm_head.weight.data_ptr() == eng.model.model.embed_tokens.weight.data_ptr()
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    eng.export_weights(str(tmp_path / "export"))
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in eng.model.parameters()}
    for model_dir in (tmp_path / "ckpt" / "model", tmp_path / "export"):
        entries = peek_safetensors_dir(str(model_dir))
        assert EMBEDDING in entries and "lm_head.weight" not in entries, model_dir
        # nothing else holds a copy either: the files are the model's distinct parameters (+ headers)
        assert _weight_bytes(model_dir) < sum(unique.values()) + 64_000, model_dir
        loaded = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch.float32,
            attn_implementation="eager",  # the trainer's (hardware=cpu)
        ).eval()
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        assert torch.equal(_logits(loaded), _logits(eng.model.eval())), model_dir


def test_a_resumed_trainer_and_the_local_engine_re_tie_the_head(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    eng = _trained(chatml_model_dir)
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    eng.export_weights(str(tmp_path / "export"))
    expected = _logits(eng.model.eval())

    fresh = _trained(chatml_model_dir)  # other weights until the checkpoint loads
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.model.lm_head.weight.data_ptr() == fresh.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(fresh.model.eval()), expected)

    engine = HFEngine(chatml_model_dir, 2, 1.0, seed=0, attn_implementation="eager", stop_timeout_s=10.0)
    try:
        engine.load_weights_from_disk(str(tmp_path / "export"), weight_version=1)
        assert torch.equal(_logits(engine.model), expected)
    finally:
        engine.stop()


def test_exports_for_a_vllm_server_also_carry_the_tied_head(chatml_model_dir: str, tmp_path: Path) -> None:
    eng = _trained(chatml_model_dir, ("service.inference_service.backend=vllm",))
    eng.export_weights(str(tmp_path / "export"))
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    weights = read_safetensors_dir(str(tmp_path / "export"))
    assert torch.equal(weights["lm_head.weight"], weights[EMBEDDING])
    assert "lm_head.weight" not in peek_safetensors_dir(os.path.join(tmp_path, "ckpt", "model"))
