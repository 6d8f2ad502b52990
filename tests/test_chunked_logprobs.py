"""Log-probs and entropy through the LM head in chunks equal the materialised log-softmax's.

``service.train_service.logprob_chunk_tokens`` > 0 never holds ``[tokens, vocabulary]`` for the
whole micro-batch; its log-probs, entropies and every parameter's gradient must be today's path's
(``logprob_chunk_tokens=0``) in fp32: log-probs within 1e-6 (entropies 1e-6 relative), gradients
within 1e-5. Checked on the
function itself and through the trainer, for every loss aggregation, padded / packed / shared
prompts, untied (tiny Llama) and tied (Qwen2 ChatML) heads, with an entropy bonus and a KL term;
and on two gloo ranks under FSDP2 and DeepSpeed ZeRO-3 (whose LM head weight exists only inside
the gathers around its module), every aggregation and layout once each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.trainer.logprobs import (
    output_head,
    response_log_probs,
    response_log_probs_and_entropy,
    token_log_probs_and_entropy,
)
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from tests.conftest import REPO
from tests.test_policy_trainer import make_batch, trainer

LOGP_TOL = 1e-6  # relative to the value (at least 1): fp32 holds ~1e-7 of it, a log-softmax sums a few ulps
ENTROPY_TOL = 5e-6  # relative: the entropy sums p log p over the vocabulary, an ulp or so a term
GRAD_TOL = 1e-5
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LAYOUTS = {
    "padded": ["service.train_service.actor.share_prompt=false"],
    "packed": ["service.train_service.actor.packing=true", "service.train_service.actor.share_prompt=false"],
    "shared": ["service.train_service.actor.share_prompt=true"],
}


def _materialised(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias).float(), dim=-1)
    return log_p.gather(-1, tokens[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_chunked_function_matches_the_materialised_log_softmax(
    chunk: int, entropy_grad: bool, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(chunk)
    n, hidden_size, vocab = 97, 32, 301  # chunks that do not divide the tokens
    hidden = torch.randn(n, hidden_size, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(vocab, generator=g)).requires_grad_() if with_bias else None
    tokens = torch.randint(0, vocab, (n,), generator=g)
    w_logp, w_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    ref_logp, ref_entropy = _materialised(hidden, weight, bias, tokens)
    ref_loss = (ref_logp * w_logp).sum() + ((ref_entropy * w_entropy).sum() if entropy_grad else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, leaves)

    logp, entropy = token_log_probs_and_entropy(hidden, weight, bias, tokens, chunk, True, entropy_grad)
    assert entropy is not None
    assert logp.dtype == entropy.dtype == torch.float32
    assert entropy.requires_grad == entropy_grad
    loss = (logp * w_logp).sum() + ((entropy * w_entropy).sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, leaves)

    assert ((logp - ref_logp).abs() / ref_logp.abs().clamp(min=1.0)).max() <= LOGP_TOL
    assert ((entropy - ref_entropy).abs() / ref_entropy.abs().clamp(min=1.0)).max() <= ENTROPY_TOL
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() <= GRAD_TOL
    only_logp, none = token_log_probs_and_entropy(hidden, weight, bias, tokens, chunk, False, False)
    assert none is None
    assert torch.equal(only_logp, logp.detach())


def test_chunk_size_below_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        token_log_probs_and_entropy(
            torch.zeros(2, 4), torch.zeros(3, 4), None, torch.zeros(2, dtype=torch.long), 0, True, False
        )


def test_a_model_without_a_linear_head_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="service.train_service.logprob_chunk_tokens"):
        output_head(torch.nn.Linear(2, 2))


def test_the_bounded_path_is_the_default(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir)
    assert eng._require_cfg()["logprob_chunk_tokens"] == 1024


def _step_grads(
    eng: PolicyTrainer, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """Log-probs before the update, then the update's gradients (kept after a single mini-batch's step)."""
    logp = eng.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"]
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    grads = {k: p.grad.detach().clone() for k, p in eng.model.named_parameters() if p.grad is not None}
    return logp, grads, metrics


def _assert_same_step(model_dir: str, overrides: list[str], batch: dict[str, torch.Tensor]) -> None:
    common = [
        *overrides,
        "service.train_service.actor.entropy_coeff=0.01",
        "algorithm.kl_loss_coef=0.1",
        "service.train_service.actor.ppo_micro_batch_size=3",
    ]
    ref = trainer(model_dir, [*common, "service.train_service.logprob_chunk_tokens=0"])
    got = trainer(model_dir, [*common, "service.train_service.logprob_chunk_tokens=5"])
    ref_logp, ref_grads, ref_metrics = _step_grads(ref, batch)
    logp, grads, metrics = _step_grads(got, batch)
    assert ((logp - ref_logp).abs() / ref_logp.abs().clamp(min=1.0)).max() <= LOGP_TOL
    assert set(grads) == set(ref_grads) and grads
    for name, want in ref_grads.items():
        assert (grads[name] - want).abs().max() <= GRAD_TOL, name
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), key


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_step_chunked_equals_materialised_untied(tiny_model_dir: str, agg: str, layout: str) -> None:
    overrides = [*LAYOUTS[layout], f"service.train_service.actor.loss_agg_mode={agg}"]
    _assert_same_step(tiny_model_dir, overrides, make_batch(10, seed=3))


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_trainer_step_chunked_equals_materialised_tied(chatml_model_dir: str, agg: str, layout: str) -> None:
    overrides = [*LAYOUTS[layout], f"service.train_service.actor.loss_agg_mode={agg}"]
    _assert_same_step(chatml_model_dir, overrides, make_batch(8, seed=4))


def test_autocast_bf16_gives_fp32_log_probs_close_to_the_materialised(tiny_model_dir: str) -> None:
    eng = trainer(tiny_model_dir, ["service.train_service.dtype=bfloat16"])
    batch = make_batch(6, seed=5)
    with eng._compute():
        ref_logp, ref_entropy = response_log_probs_and_entropy(eng.model, batch, chunk_tokens=0)
        logp, entropy = response_log_probs_and_entropy(eng.model, batch, chunk_tokens=2)
        only = response_log_probs(eng.model, batch, chunk_tokens=2)
    assert logp.dtype == entropy.dtype == only.dtype == torch.float32
    # the head's matmul in bf16 both ways: the same rows of the same product, so equal to fp32 rounding
    assert (logp - ref_logp).abs().max() <= 1e-5
    assert (entropy - ref_entropy).abs().max() <= 1e-5
    assert torch.equal(only, logp)


def _parallel_cases(engine: str, tiny: str, tied: str) -> list[str]:
    extra = ["service.train_service.deepspeed.zero_stage=3"] if engine == "deepspeed" else []
    cases = [
        (tiny, "padded", "token-mean"),
        (tied, "packed", "seq-mean-token-sum"),
        (tiny, "shared", "seq-mean-token-mean"),
        (tied, "padded", "seq-mean-token-sum-norm"),
    ]
    args: list[str] = []
    for i, (model, layout, agg) in enumerate(cases):
        args += [*(["::"] if i else []), engine, model, *LAYOUTS[layout], *extra]
        args.append(f"service.train_service.actor.loss_agg_mode={agg}")
    return args


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_two_ranks_chunked_equals_materialised(
    engine: str, tiny_model_dir: str, chatml_model_dir: str, tmp_path: Path
) -> None:
    """FSDP2 and ZeRO-3 on two gloo ranks: the whole accumulated gradient of one update (caught
    before the optimizer step) and the log-probs, chunked against materialised."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")
    out = tmp_path / "result.json"
    module = ["-m", "tests.helpers.chunked_numerics", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *module]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cases = _parallel_cases(engine, tiny_model_dir, chatml_model_dir)
    proc = subprocess.run([*cmd, *cases], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == 4
    for r in results:
        assert r["same_names"] and r["grad_tensors"] > 0 and r["grad_scale"] > 1e-4, r
        assert r["logp"] <= LOGP_TOL, r
        assert r["grad"] <= GRAD_TOL, r
