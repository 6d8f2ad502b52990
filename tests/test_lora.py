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
from nexrl_hpc.models.tiny import materialize_base_model
from nexrl_hpc.trainer.logprobs import response_log_probs
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import TrainWorker
from nexrl_hpc.weight_sync.verify import FP32_TOLERANCE
from tests.conftest import REPO, compose_config, run_train
from tests.helpers.stale_engine import ADAPTER, ENV, sitecustomize_dir
from tests.test_policy_trainer import make_batch, trainer

LORA = [
    "service.train_service.actor.lora.rank=4",
    "service.train_service.actor.lora.alpha=8",
    "service.train_service.actor.lora.modules_to_save=null",  # the adapter alone
]
# the tiny model's norms and LM head trained in full beside the adapter (what auto gives a tied head)
LORA_SAVED = [*LORA[:2], "service.train_service.actor.lora.modules_to_save=[norm,lm_head]"]
LORA_AUTO = LORA[:2]  # modules_to_save: auto


def _base_and_adapter(eng: PolicyTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    adapter = {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}
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
    assert eng.optimizer.param_groups[0]["lr"] == 1.5e-3  # actor.lora.lr, not actor.optim.lr (1e-3)
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


def test_auto_trains_the_adapter_alone_but_a_tied_tiny_heads_norms_and_head_in_full(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """modules_to_save: auto. The tiny model's untied head (the default): the adapter alone, on the
    linear layers. A tied head (its embedding): the head and norms trained in full beside the
    adapter. A model at model.path: the adapter alone."""
    untied = trainer(tiny_model_dir, LORA_AUTO)
    trainable = [n for n, p in untied.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and not any("lm_head" in n for n in trainable)

    tie = "model.tiny.tie_word_embeddings=true"
    tied_dir = materialize_base_model(compose_config([tie])["model"], str(tmp_path / "tied"))
    tied = trainer(tied_dir, [*LORA_AUTO, tie])
    trainable = [n for n, p in tied.model.named_parameters() if p.requires_grad]
    saved = sorted({n.split(".modules_to_save")[0] for n in trainable if "modules_to_save" in n})
    # peft matches modules_to_save by name suffix: "norm" is every RMSNorm (the layers' and the final one)
    norms = ["input_layernorm", "post_attention_layernorm"]
    layers = [f"base_model.model.model.layers.{i}.{n}" for i in range(2) for n in norms]
    assert saved == sorted(["base_model.model.lm_head", "base_model.model.model.norm", *layers])
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert not any("lm_head.lora_" in n for n in trainable)
    base0, _ = _base_and_adapter(tied)
    _train(tied, 1)
    base1, _ = _base_and_adapter(tied)
    assert all(torch.equal(base0[k], base1[k]) for k in base0)  # the originals stay: the copies train

    with_path = trainer(tiny_model_dir, [*LORA_AUTO, f"model.path={tiny_model_dir}"])
    trainable = [n for n, p in with_path.model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) and not any("lm_head" in n for n in trainable)


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
    eng = trainer(tiny_model_dir, LORA_SAVED)
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
    straight = trainer(tiny_model_dir, LORA_SAVED)
    _train(straight, 2)
    straight.save_checkpoint(str(tmp_path / "ckpt"), global_step=2)
    _train(straight, 2, seed=2)
    resumed = trainer(tiny_model_dir, LORA_SAVED)
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
    eng = trainer(tiny_model_dir, LORA_SAVED)
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


FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


def _sync_rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "weight_sync/seconds" in r}


def test_a_lora_run_ships_only_the_adapter_and_every_engine_serves_it(tmp_path: Path) -> None:
    """weight.transport=broadcast (the default) with LoRA: each version's adapter goes by disk in
    PEFT layout, the local engine applies it, and verification finds the trainer's adapted model."""
    run_dir = tmp_path / "run"
    lora = ["service.train_service.actor.lora.rank=8", "weight.keep_versions=2"]
    proc = run_train([f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=3", *lora, *FAST])
    assert proc.returncode == 0, proc.stderr[-3000:]
    exports = sorted(os.listdir(run_dir / "weights"))
    assert exports == ["version_2", "version_3"]
    assert sorted(os.listdir(run_dir / "weights" / "version_3")) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    adapter_bytes = (run_dir / "weights" / "version_3" / ADAPTER_WEIGHTS).stat().st_size
    syncs = _sync_rows(run_dir)
    assert sorted(syncs) == [0, 1, 2, 3]
    for step, row in syncs.items():
        assert row["weight_sync/verify_max_abs_diff"] <= FP32_TOLERANCE, (step, row)
        assert 0 < row["weight_sync/bytes"] <= adapter_bytes + 4096, (step, row)
    # every trajectory of step s was sampled with version s - 1's adapter (the engine's version)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 3 and all(r["train/staleness_max"] == 0 for r in trained)


def test_an_engine_that_never_applies_the_adapter_fails_the_first_step(tmp_path: Path) -> None:
    """The engine labels each version but keeps serving the base model: version 0 (the adapter's
    zero update) agrees, version 1 — the first trained adapter — stops the run, exit 1, naming the
    server and the version."""
    run_dir = tmp_path / "run"
    site = sitecustomize_dir(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), ENV: ADAPTER}
    lora = ["service.train_service.actor.lora.rank=8"]
    proc = run_train(
        [f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=4", *lora, *FAST], env=env
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1, status
    reason = str(status["reason"])
    assert "weight version 1 failed verification" in reason, reason
    assert "inference_service (http://127.0.0.1:" in reason, reason
    assert sorted(_sync_rows(run_dir)) == [0]


def test_the_local_engine_holds_one_adapter_after_many_syncs_and_scores_like_peft(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from nexrl_hpc.inference.engine import HFEngine
    from nexrl_hpc.inference.lora_adapter import adapter_names

    eng = trainer(tiny_model_dir, LORA)
    engine = HFEngine(tiny_model_dir, max_batch_size=4, batch_wait_ms=0.0, seed=0, stop_timeout_s=10.0)
    try:
        prompt = [[1, 5, 7, 9, 4, 6, 8, 5, 11]]
        base_scores = engine.prompt_log_probs(prompt)[0]
        for version in range(1, 8):
            _train(eng, 1, seed=version)
            path = str(tmp_path / f"version_{version}")
            eng.export_weights(path)
            engine.load_weights_from_disk(path, version)
            assert adapter_names(engine.model) == [f"version_{version}"]
            assert engine.weight_version == version
        engine.load_weights_from_disk(path, 7)  # the same version again: still one adapter
        assert len(adapter_names(engine.model)) == 1
        scores = torch.tensor(engine.prompt_log_probs(prompt)[0])
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, path).eval()
        ids = torch.tensor(prompt)
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        expected = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert torch.allclose(scores, expected, atol=1e-5)
        assert not torch.allclose(scores, torch.tensor(base_scores), atol=1e-4)  # the adapter is applied
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["service.train_service.actor.lora.target_modules=[nope_proj]"], "lora.target_modules", "no module"),
        (["service.train_service.actor.lora.target_modules=.*nope.*"], "lora.target_modules", "no module"),
        (["service.train_service.actor.lora.modules_to_save=[zzz]"], "lora.modules_to_save", "'zzz'"),
        (
            ["service.train_service.actor.lora.target_modules=[q_proj,lm_head]"],
            "lora.target_modules",
            "set service.train_service.logprob_chunk_tokens=0",
        ),
        (
            [
                "service.inference_service.backend=sglang",
                "service.inference_service.base_url=http://127.0.0.1:9",
            ],
            "service.inference_service.backend",
            "cannot serve a LoRA adapter",
        ),
    ],
)
def test_preflight_refuses_what_lora_cannot_run(overrides: list[str], key: str, words: str) -> None:
    from nexrl_hpc.config.validate import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_config(["service.train_service.actor.lora.rank=8", *overrides])
    assert key in str(err.value) and words in str(err.value)
    compose_config(overrides)  # rank 0 (full fine-tuning): the same settings are fine


def test_an_adapter_on_the_lm_head_trains_with_unchunked_log_probs_and_is_refused_with_chunked(
    tiny_model_dir: str,
) -> None:
    """The chunked log-probs score through the head's weight: with a LoRA layer there, that weight is
    the base's and the adapter would be left out. Unchunked, the head's own forward applies it."""
    head = ["service.train_service.actor.lora.target_modules=[q_proj,lm_head]", *LORA]
    eng = trainer(tiny_model_dir, [*head, "service.train_service.logprob_chunk_tokens=0"])
    _train(eng, 2)
    grads = {n: p.grad for n, p in eng.model.named_parameters() if "lm_head.lora_" in n}
    assert len(grads) == 2 and all(g is not None and float(g.abs().max()) > 0 for g in grads.values())
    # past the pre-flight (a config built by hand), the trainer refuses rather than skip the adapter
    cfg = compose_config(LORA)
    cfg["service"]["train_service"]["actor"]["lora"]["target_modules"] = ["q_proj", "lm_head"]
    chunked = PolicyTrainer(tiny_model_dir)
    chunked.initialize_worker(TrainWorker(cfg, chunked).train_service_config())
    chunked.init_model()
    with pytest.raises(ValueError, match="leaves out a LoRA adapter on the head"):
        chunked.compute_log_prob({"batch": make_batch(4, seed=1)})


def test_preflight_accepts_named_modules_and_exits_2_from_the_command_line(tmp_path: Path) -> None:
    compose_config(
        [
            "service.train_service.actor.lora.rank=8",
            "service.train_service.actor.lora.target_modules=[q_proj,v_proj]",
            "service.train_service.actor.lora.modules_to_save=[lm_head]",
        ]
    )
    args = [f"run_dir={tmp_path / 'run'}", "service.train_service.actor.lora.rank=8"]
    proc = run_train([*args, "service.train_service.actor.lora.target_modules=[qq_proj]"], timeout=120)
    assert proc.returncode == 2 and "service.train_service.actor.lora.target_modules" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_fully_async_lora_run_resumes_and_the_engine_serves_the_resumed_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "seed=3", "train_worker.save_freq=2", "weight.sync_mode=fully-async"]
    args += ["service.train_service.actor.lora.rank=8", *FAST]
    first = run_train([*args, "train_worker.total_train_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train([*args, "train_worker.total_train_steps=4"])
    assert second.returncode == 0, second.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    resumed = log[log.index("resumed at step 2") - 400 :]
    assert "weight version 2 verified" in resumed  # the resumed adapter, checked on the engine
    syncs = _sync_rows(run_dir)
    assert sorted(syncs) == [0, 1, 2, 3, 4]
    assert all(r["weight_sync/verify_max_abs_diff"] <= FP32_TOLERANCE for r in syncs.values())
    adapter = run_dir / "checkpoints" / "global_step_4" / "model"
    assert sorted(os.listdir(adapter)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
