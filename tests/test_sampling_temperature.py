"""Log-probs at the rollouts' sampling temperature, everywhere they are compared.

Rollouts sample from softmax(logits / T). The engine reports each sampled token's log-prob under
that distribution (vLLM's ``logprobs_mode=processed_logprobs``; top-p renormalised over the kept
tokens), and the trainer scores log_softmax(logits / T) in every layout (padded, packed, shared
prompts; chunked LM head and materialised), for the policy, the KL reference and the distillation
teacher. The weight-sync canary compares prompt log-probs at temperature 1 on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.inference.engine import GenerationRequest, HFEngine, SamplingParams
from nexrl_hpc.trainer.logprobs import token_log_probs_and_entropy
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.weight_sync.verify import canary_batch
from tests.conftest import compose_config, run_train
from tests.helpers.vllm_venv import vllm_config
from tests.test_policy_trainer import make_batch, trainer

T = 0.7
LAYOUTS = {
    "padded": ["service.train_service.actor.share_prompt=false"],
    "packed": ["service.train_service.actor.packing=true", "service.train_service.actor.share_prompt=false"],
    "shared": ["service.train_service.actor.share_prompt=true"],
}


def tempered_log_probs(model: Any, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one plain padded forward (the oracle)."""
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -r - 1 : -1, :]
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, batch["responses"][..., None]).squeeze(-1) * batch["response_mask"]


def test_the_chunked_head_at_a_temperature_equals_the_tempered_softmax_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(41, 16, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(53, 16, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(53, generator=g)).requires_grad_()
    tokens = torch.randint(0, 53, (41,), generator=g)
    w_logp, w_ent = torch.randn(41, generator=g), torch.randn(41, generator=g)
    log_p = torch.log_softmax((hidden @ weight.T + bias) / T, dim=-1)
    ref_logp = log_p.gather(-1, tokens[:, None]).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    ref_grads = torch.autograd.grad(
        (ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), [hidden, weight, bias]
    )
    logp, ent = token_log_probs_and_entropy(hidden, weight, bias, tokens, 7, True, True, temperature=T)
    assert ent is not None
    grads = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), [hidden, weight, bias])
    assert (logp - ref_logp).abs().max() <= 1e-6 and (ent - ref_ent).abs().max() <= 1e-5
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() <= 1e-5
    # and it is not the temperature-1 policy
    plain, _ = token_log_probs_and_entropy(hidden, weight, bias, tokens, 7, False, False)
    assert (plain - ref_logp).abs().max() > 0.1


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_trainer_scores_at_the_rollout_temperature_in_every_layout(
    tiny_model_dir: str, layout: str, chunk: int
) -> None:
    overrides = [
        *LAYOUTS[layout],
        f"rollout_worker.temperature={T}",
        f"service.train_service.logprob_chunk_tokens={chunk}",
        "algorithm.kl_loss_coef=0.1",
    ]
    eng = trainer(tiny_model_dir, overrides)
    batch = make_batch(10, seed=4)
    want = tempered_log_probs(eng.model, batch, T)
    got = eng.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"] * batch["response_mask"]
    assert (got - want).abs().max() <= 1e-5
    assert (got - tempered_log_probs(eng.model, batch, 1.0)).abs().max() > 0.05
    # the update's own log-probs (and the KL reference's, equal before the step) are tempered too
    batch["behaviour_log_probs"] = want.clone()
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    assert metrics["actor/logprob_mismatch_max"] <= 1e-5
    assert abs(metrics["actor/kl_loss"]) <= 1e-6


def test_greedy_rollouts_score_the_raw_logits_and_the_canary_asks_for_temperature_one(
    tiny_model_dir: str,
) -> None:
    greedy = trainer(tiny_model_dir, ["rollout_worker.temperature=0.0"])
    assert greedy._require_cfg()["logit_temperature"] == 1.0
    eng = trainer(tiny_model_dir, [f"rollout_worker.temperature={T}"])
    prompts = [[1, 5, 9, 4, 7], [1, 6, 6]]
    canary = canary_batch(prompts)
    got = eng.compute_log_prob({"batch": dict(canary)})["batch"]["old_log_probs"]
    want = tempered_log_probs(eng.model, {k: v for k, v in canary.items() if k != "logit_temperature"}, 1.0)
    assert (got * canary["response_mask"] - want).abs().max() <= 1e-6


def test_the_teacher_scores_at_the_students_temperature(tiny_model_dir: str) -> None:
    from nexrl_hpc.trainer.worker import TrainWorker

    cfg = compose_config([f"rollout_worker.temperature={T}"])
    teacher = TrainWorker(cfg, PolicyTrainer(tiny_model_dir)).teacher_service_config()
    assert teacher["logit_temperature"] == T


def _engine(model_dir: str) -> HFEngine:
    return HFEngine(model_dir, max_batch_size=64, batch_wait_ms=0.0, seed=5, stop_timeout_s=10.0)


def _oracle_row(
    model: Any, prompt: list[int], tokens: list[int], temperature: float, top_p: float
) -> list[float]:
    """Each sampled token's log-prob under softmax(logits / T) restricted to top-p's kept set."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    out = []
    for row, t in zip(logits, tokens):
        probs = torch.softmax(row / temperature, -1)
        sorted_probs, order = probs.sort(descending=True)
        keep = order[(sorted_probs.cumsum(0) - sorted_probs) <= top_p]
        kept = torch.log_softmax(row[keep] / temperature, -1)
        out.append(float(kept[(keep == t).nonzero()[0, 0]]))
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_the_local_engine_reports_the_log_probs_of_the_distribution_it_sampled(
    tiny_model_dir: str, top_p: float
) -> None:
    engine = _engine(tiny_model_dir)
    try:
        prompt = [1, 5, 9, 4]
        params = SamplingParams(max_tokens=6, temperature=T, top_p=top_p, n=8, stop_token_ids=(10**6,))
        outs = engine.submit(GenerationRequest([prompt], params)).result(timeout=60)
        for out in outs:
            want = _oracle_row(engine.model, prompt, out.token_ids, T, top_p)
            assert out.logprobs == pytest.approx(want, abs=1e-5)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(10**6,))
        (out,) = engine.submit(GenerationRequest([prompt], greedy)).result(timeout=60)
        assert out.logprobs == pytest.approx(
            _oracle_row(engine.model, prompt, out.token_ids, 1.0, 1.0), abs=1e-5
        )
    finally:
        engine.stop()


def test_a_seeded_request_draws_its_own_tokens_whatever_shares_its_batch_or_how_it_is_split(
    tiny_model_dir: str,
) -> None:
    """A request with a seed samples the same tokens alone, in a batch with other requests
    (seeded or not), and split into parts of at most ``max_batch_size`` rows; unseeded rows keep
    drawing from the engine's own generator."""
    from dataclasses import replace

    engine = _engine(tiny_model_dir)
    small = HFEngine(tiny_model_dir, max_batch_size=2, batch_wait_ms=0.0, seed=5, stop_timeout_s=10.0)
    try:
        prompt, other = [1, 5, 9, 4], [2, 6, 3]
        seeded = SamplingParams(max_tokens=8, temperature=T, n=4, stop_token_ids=(10**6,), seed=11)

        def tokens(outs: list[Any]) -> list[list[int]]:
            return [o.token_ids for o in outs]

        alone = tokens(engine._generate([GenerationRequest([prompt], seeded)])[0])
        batched = engine._generate(
            [
                GenerationRequest([other], replace(seeded, seed=None, n=5)),
                GenerationRequest([prompt], seeded),
                GenerationRequest([other, prompt], replace(seeded, seed=12)),
            ]
        )
        assert tokens(batched[1]) == alone
        assert len({tuple(t) for t in alone}) == 4  # each sample its own stream
        assert tokens(batched[2])[4:] != alone  # another seed: other draws for the same prompt
        parts = small.split([prompt], seeded)
        assert [p.params.n for p in parts] == [2, 2]
        assert [t for part in parts for t in tokens(small._generate([part])[0])] == alone
    finally:
        engine.stop()
        small.stop()


def assert_behaviour_log_probs_are_the_sampling_distributions(run_dir: Path, tol: float) -> float:
    """Step 1 sampled with the base model (version 0): the engine's reported log-probs of the
    dumped batch are log_softmax(base logits / T) (at T=1 they would be off by far more than tol)."""
    import h5py

    from nexrl_hpc.models.tiny import load_model

    with h5py.File(run_dir / "rollouts" / "step_1.h5") as f:
        assert set(f["weight_version"][:].tolist()) == {0}
        batch = {k: torch.from_numpy(f[k][:]).long() for k in ("input_ids", "attention_mask", "responses")}
        mask = torch.from_numpy(f["response_mask"][:]).float()
        behaviour = torch.from_numpy(f["behaviour_log_probs"][:]).float()
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    batch["response_mask"] = mask
    model = load_model(str(run_dir / "base_model")).eval()
    worst = float(((tempered_log_probs(model, batch, T) - behaviour) * mask).abs().max())
    untempered = float(((tempered_log_probs(model, batch, 1.0) - behaviour) * mask).abs().max())
    assert worst <= tol and untempered > 10 * tol, (worst, untempered)
    return worst


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward_mean" in r]


@pytest.mark.e2e
def test_a_default_shape_run_at_temperature_07_has_no_logprob_mismatch(tmp_path: Path) -> None:
    """The default task and shape, sampled at T=0.7 by the local engine: trainer and engine agree."""
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "seed=3",
            f"rollout_worker.temperature={T}",
            "train_worker.total_train_steps=4",
            "logger.dump_rollouts=true",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["train/logprob_mismatch_max"] <= 1e-4, (r["step"], r["train/logprob_mismatch_max"])
    # every sync's canary verified: prompt log-probs at temperature 1 on the engine and the trainer
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    verified = {
        r["step"]: r["weight_sync/verify_max_abs_diff"]
        for r in rows
        if "weight_sync/verify_max_abs_diff" in r
    }
    assert sorted(verified) == [0, 1, 2, 3, 4] and max(verified.values()) <= 1e-4, verified
    assert_behaviour_log_probs_are_the_sampling_distributions(run_dir, 1e-4)


@pytest.mark.e2e
def test_a_vllm_run_at_temperature_07_has_no_logprob_mismatch(tmp_path: Path) -> None:
    """vLLM asked for processed log-probs: its numbers are the trainer's log_softmax(logits / T)."""
    vllm_config(["service.inference_service.backend=vllm"])
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "seed=3",
            "service.inference_service.backend=vllm",
            f"rollout_worker.temperature={T}",
            "train_worker.total_train_steps=3",
            "logger.dump_rollouts=true",
        ],
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["train/logprob_mismatch_max"] <= 1e-4, (r["step"], r["train/logprob_mismatch_max"])
    worst = assert_behaviour_log_probs_are_the_sampling_distributions(run_dir, 1e-4)
    print(f"vLLM at T={T}: behaviour vs log_softmax(logits / T) max {worst:.2e}")
