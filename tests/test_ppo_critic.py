"""PPO with a learned critic: GAE and the value loss against hand-computed numbers and verl's
formulas, the processor's token rewards, the critic's update and warm-up, exact resume, and a
default-task run that learns (held-out accuracy by the independent evaluation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.algorithm.gae import gae_advantages, last_token_rewards, masked_whiten, value_loss
from nexrl_hpc.trainer.factory import create_train_service_client
from nexrl_hpc.trainer.ppo_backend import PPOBackend
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import REPO, compose_config, independent_eval, run_train
from tests.test_policy_trainer import make_batch


def verl_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """verl's compute_gae_advantage_return, as written there (masked tokens pass values through)."""
    nextvalues: Any = 0
    lastgaelam: Any = 0
    advantages_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    mean = (advantages * mask).sum() / mask.sum()
    var = ((advantages - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def test_gae_hand_computed() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.9]])
    mask = torch.ones(1, 3)
    _, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # A2 = 1 - 0.9; A1 = 0.9*0.9 - 0.2 + 0.72*A2; A0 = 0.9*0.2 - 0.5 + 0.72*A1
    raw = [0.17104, 0.682, 0.1]
    assert (returns - values)[0].tolist() == pytest.approx(raw, abs=1e-6)
    # a tool's token (mask 0) has no TD error: V and the running advantage pass through it
    masked = torch.tensor([[1.0, 0.0, 1.0]])
    _, returns = gae_advantages(rewards, torch.tensor([[0.5, 7.0, 0.9]]), masked, 0.9, 0.8)
    assert returns[0, 0] - 0.5 == pytest.approx(0.9 * 0.9 - 0.5 + 0.72 * 0.1, abs=1e-6)
    assert returns[0, 1] == 0.0  # off the mask


def test_gae_advantages_are_whitened_over_the_batchs_tokens() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4], [0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, returns = gae_advantages(rewards, values, mask, 1.0, 1.0)
    raw = torch.tensor([1.0 - 0.2, 1.0 - 0.4, -0.1])  # lam = gamma = 1: R - V
    mean, var = raw.mean(), raw.var()  # unbiased over the 3 tokens
    want = (raw - mean) / torch.sqrt(var + 1e-8)
    assert adv[mask.bool()].tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert adv[1, 1] == 0.0
    assert masked_whiten(raw[None], torch.ones(1, 3))[0].tolist() == pytest.approx(want.tolist(), abs=1e-6)


@pytest.mark.parametrize("seed", range(10))
def test_gae_equals_verls_on_random_masked_batches(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    values = torch.randn(b, t, generator=g)
    rewards = last_token_rewards(torch.rand(b, generator=g), mask)
    gamma, lam = 0.99, 0.95
    adv, returns = gae_advantages(rewards, values, mask, gamma, lam)
    want_adv, want_returns = verl_gae(rewards, values, mask, gamma, lam)
    on = mask.bool()
    assert torch.allclose(adv[on], want_adv[on], atol=1e-5)
    assert torch.allclose(returns[on], want_returns[on], atol=1e-6)


def test_last_token_rewards_sit_on_each_responses_last_trained_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = last_token_rewards(torch.tensor([0.7, -1.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 0.7, 0.0], [0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]))


def test_value_loss_hand_computed_and_verls_formula() -> None:
    predicted = torch.tensor([[1.0, 0.0, 0.6]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = value_loss(predicted, old, returns, mask, 0.2, "token-mean")
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0, 0.3^2) = 0.09; token 2: 0.16 either way
    assert float(loss.detach()) == pytest.approx(0.5 * (1.69 + 0.09 + 0.16) / 3, abs=1e-6)
    assert float(stats["vf_clipfrac_sum"]) == 2.0
    (grad,) = torch.autograd.grad(loss, predicted)
    # the clipped branch wins on tokens 0 and 1: no gradient through V there; token 2: (V - R) / 3
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, (0.6 - 1.0) / 3], abs=1e-6)
    # verl's compute_value_loss: 0.5 * agg(max(l1, l2)), clip_by_value(v, old - c, old + c)
    clipped = torch.max(torch.min(predicted, old + 0.2), old - 0.2)
    verl = 0.5 * torch.max((predicted - returns) ** 2, (clipped - returns) ** 2).mean()
    assert float(loss.detach()) == pytest.approx(float(verl.detach()), abs=1e-7)
    unclipped, _ = value_loss(predicted, old, returns, mask, None, "token-mean")
    assert float(unclipped.detach()) == pytest.approx(0.5 * (1.0 + 0.0 + 0.16) / 3, abs=1e-6)


def test_the_ppo_preset_picks_gae_and_needs_no_groups() -> None:
    cfg = compose_config(["algorithm=ppo", "data.rollout_repeat_n=1"])
    assert cfg["algorithm"]["adv_estimator"] == "gae"
    assert (cfg["algorithm"]["gamma"], cfg["algorithm"]["lam"]) == (1.0, 1.0)
    assert cfg["service"]["train_service"]["critic"]["cliprange_value"] == 0.5
    assert cfg["service"]["train_service"]["critic"]["warmup_steps"] == 5  # the preset's (verl's default: 0)


def test_a_critic_model_path_that_does_not_load_is_refused_naming_the_key(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    from tests.test_advantage_oracles import _problems

    assert _problems(["algorithm=ppo", f"service.train_service.critic.model_path={tiny_model_dir}"]) == {}

    missing = str(tmp_path / "no_model")
    problems = _problems(["algorithm=ppo", f"service.train_service.critic.model_path={missing}"])
    assert list(problems) == ["service.train_service.critic.model_path"]
    assert problems["service.train_service.critic.model_path"].startswith(repr(missing))


def test_the_processor_puts_each_reward_on_the_last_token_and_leaves_the_advantage_to_the_critic() -> None:
    from nexrl_hpc.algorithm.advantage_processor import AdvantageProcessor
    from nexrl_hpc.types import Batch

    cfg = compose_config(["algorithm=ppo"])
    rows = [
        {"prompt_ids": [1, 5], "response_ids": [6, 7], "behaviour_log_probs": [-1.0, -1.0], "reward": 0.7},
        {"prompt_ids": [1, 5], "response_ids": [8], "behaviour_log_probs": [-1.0], "reward": 0.2},
    ]
    out = AdvantageProcessor(cfg, pad_token_id=0).compute(Batch.from_trajectories(rows))
    assert torch.equal(out.values["token_level_rewards"], torch.tensor([[0.0, 0.7], [0.2, 0.0]]))
    assert out.values["advantages"].abs().sum() == 0.0


def ppo_backend(model_dir: str, overrides: list[str]) -> PPOBackend:
    cfg = compose_config(["algorithm=ppo", *overrides])
    backend = create_train_service_client(cfg, model_dir)
    assert isinstance(backend, PPOBackend)
    backend.initialize_worker(TrainWorker(cfg, backend).train_service_config())
    backend.init_model()
    return backend


def ppo_batch(seed: int) -> dict[str, torch.Tensor]:
    batch = make_batch(12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(12, generator=g) > 0.5).float()
    batch["token_level_rewards"] = last_token_rewards(rewards, batch["response_mask"])
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    return batch


def snapshot(backend: PPOBackend) -> dict[str, torch.Tensor]:
    actor = backend.actor.model.state_dict()  # type: ignore[attr-defined]
    critic = backend.critic.model.state_dict()
    return {
        **{f"actor.{k}": v.clone() for k, v in actor.items()},
        **{f"critic.{k}": v.clone() for k, v in critic.items()},
    }


def test_critic_warm_up_trains_only_the_critic_then_both(tiny_model_dir: str, tmp_path: Path) -> None:
    backend = ppo_backend(tiny_model_dir, ["service.train_service.critic.warmup_steps=1"])
    before = snapshot(backend)
    answer = backend.start_update_actor({"batch": ppo_batch(1), "meta_info": {}}, str(tmp_path / "v1"))
    metrics = answer.result()["meta_info"]["metrics"]
    after = snapshot(backend)
    assert metrics["critic/warmup"] == 1.0 and metrics["critic/vf_loss"] > 0
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("actor."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("critic."))
    assert (tmp_path / "v1" / "config.json").exists()  # the engines still get a version to serve
    metrics = backend.update_actor({"batch": ppo_batch(2), "meta_info": {}})["meta_info"]["metrics"]
    assert "critic/warmup" not in metrics and metrics["actor/optimizer_steps"] == 1
    assert any(not torch.equal(after[k], v) for k, v in snapshot(backend).items() if k.startswith("actor."))


def test_a_resumed_critic_continues_exactly(tiny_model_dir: str, tmp_path: Path) -> None:
    overrides = [
        "service.train_service.critic.warmup_steps=2",
        "service.train_service.critic.optim.lr_warmup_steps=3",
    ]
    first = ppo_backend(tiny_model_dir, overrides)
    first.update_actor({"batch": ppo_batch(1), "meta_info": {}})
    first.save_checkpoint(str(tmp_path / "ckpt"), 1)
    want = first.update_actor({"batch": ppo_batch(2), "meta_info": {}})["meta_info"]["metrics"]
    want_state = snapshot(first)

    resumed = ppo_backend(tiny_model_dir, overrides)
    assert not torch.equal(resumed.critic.model.score.weight, first.critic.model.score.weight)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.update_actor({"batch": ppo_batch(2), "meta_info": {}})["meta_info"]["metrics"]
    assert got["critic/warmup"] == 1.0  # the second warm-up update, not the first again
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/lr", "critic/values_mean"):
        assert got[key] == want[key], key
    state = snapshot(resumed)
    assert all(torch.equal(state[k], v) for k, v in want_state.items())


def test_a_checkpoint_without_a_critic_is_refused_naming_the_directory(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    backend = ppo_backend(tiny_model_dir, [])
    backend.actor.save_checkpoint(str(tmp_path / "grpo"), 1)
    with pytest.raises(FileNotFoundError, match="grpo/critic: no critic in this checkpoint"):
        backend.load_checkpoint(str(tmp_path / "grpo"))


@pytest.mark.e2e
def test_ppo_learns_the_default_task_and_resumes(tmp_path: Path) -> None:
    """algorithm=ppo, local mode: held-out accuracy >= 0.9 by the independent evaluation; the run
    stopped at step 40 resumes from its checkpoint with the critic (steps 41-50 trained once)."""
    run_dir = tmp_path / "run"
    common = [f"run_dir={run_dir}", "seed=1", "algorithm=ppo", "train_worker.save_freq=20"]
    first = run_train([*common, "train_worker.total_train_steps=40"], timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "global_step_40" / "critic" / "model").is_dir()
    proc = run_train([*common, "train_worker.total_train_steps=50"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed at step 40" in (run_dir / "train.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    assert all(r["critic/vf_loss"] >= 0.0 for r in steps)
    result = independent_eval(run_dir)
    assert result["checkpoint"].endswith("global_step_50") and result["accuracy"] >= 0.9, result


@pytest.mark.e2e
# one critic rank ("single") is the same group with one member: the local PPO run covers that engine
@pytest.mark.parametrize(("critic_ranks", "critic_engine"), [(2, "fsdp")])
def test_ppo_under_mpirun_with_a_critic_group_at_temperature_07(
    tmp_path: Path, critic_ranks: int, critic_engine: str
) -> None:
    """mpirun: the actor on 2 FSDP2 trainer ranks, the critic on a group of its own (1 rank, or 2
    under FSDP2), sampling at T=0.7: every sync's canary verified (temperature 1 on both sides),
    trainer and engine log-probs agree, the run learns (held-out from 0.14 to >= 0.6 at step 50),
    and its checkpoint holds the critic's weights and one optimizer file per critic rank."""
    import shutil

    from tests.test_mpi import mpirun

    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: install the dev extra (bash scripts/install.sh --dev: mpi4py + mpich)")
    run_dir = tmp_path / "mpi"
    args = [
        f"run_dir={run_dir}",
        "seed=1",
        "algorithm=ppo",
        "rollout_worker.temperature=0.7",
        "service.train_service.engine=fsdp",
        "service.train_service.world_size=2",
        f"service.train_service.critic.world_size={critic_ranks}",
        f"service.train_service.critic.engine={critic_engine}",
    ]
    n = 1 + 2 + critic_ranks + 1
    proc = subprocess.run(mpirun(n, args), cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert [r["group"] for r in ranks] == [
        "driver",
        "trainer",
        "trainer",
        *["critic"] * critic_ranks,
        "rollout",
    ]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    assert all(r["critic/vf_loss"] >= 0.0 for r in steps)
    warm_up = [r["step"] for r in steps if r.get("critic/warmup") == 1.0]
    assert warm_up == [1, 2, 3, 4, 5]  # the preset's: the actor trains (and is compared) from step 6
    assert max(r["train/logprob_mismatch_max"] for r in steps if r["step"] > 5) <= 1e-4
    verified = [r["weight_sync/verify_max_abs_diff"] for r in rows if "weight_sync/verify_max_abs_diff" in r]
    assert len(verified) >= 50 and max(verified) <= 1e-4
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    # An mpirun run is not reproducible token for token (the rollout rank's engine batches
    # requests as they arrive, and its sampler draws for a batch), and PPO at T=0.7 ends this
    # task's 50 steps anywhere in 0.71-0.99 (six runs of this test, one stuck at 0.714 from step
    # 30; 0.77-1.0 over local-mode seeds). This bar says it learns; the accuracy PPO reaches is
    # the local PPO test's (>= 0.9, reproducible), and 0.9 under mpirun is not met (issue 39).
    assert val[-1][0] == 50 and val[0][1] < 0.2 and val[-1][1] >= 0.6, val
    critic = run_dir / "checkpoints" / "global_step_50" / "critic"
    assert (critic / "model" / "model.safetensors").exists()
    assert sorted(p.name for p in (critic / "optimizer").iterdir() if p.suffix == ".safetensors") == [
        f"rank_{r}.safetensors" for r in range(critic_ranks)
    ]


@pytest.mark.e2e
def test_the_critic_on_two_fsdp2_or_zero3_ranks_equals_the_critic_in_one_process(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """torchrun, two gloo ranks: FSDP2's and DeepSpeed ZeRO-3's values, value loss, gradient norm
    and the values after one update are the single process's (micro-batches of 3, mini-batches of
    6: two optimizer steps)."""
    import os
    import shutil

    from nexrl_hpc.trainer.critic import load_value_model

    value_dir = tmp_path / "value_model"
    torch.manual_seed(0)
    load_value_model(tiny_model_dir, torch.device("cpu")).save_pretrained(value_dir)
    for name in os.listdir(tiny_model_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_model_dir, name), value_dir / name)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [*cmd, "-m", "tests.helpers.critic_numerics", str(out), str(value_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert list(results) == ["fsdp", "deepspeed"]
    for result in results.values():
        assert result["values"] <= 1e-5 and result["after"] <= 1e-5, results
        assert result["moved"] > 1e-3, results  # the update changed the values
        assert result["vf_loss"][0] == pytest.approx(result["vf_loss"][1], rel=1e-5), results
        assert result["grad_norm"][0] == pytest.approx(result["grad_norm"][1], rel=1e-4), results


def test_mpi_mode_places_the_critic_on_its_own_group_and_says_what_fits() -> None:
    from nexrl_hpc.runtime.placement import PlacementError, plan_placement, trainer_group

    cfg = compose_config(
        [
            "launch_mode=mpi",
            "algorithm=ppo",
            "service.train_service.critic.world_size=2",
            "service.train_service.critic.engine=fsdp",
            "placement.resources.critic={cpus_per_rank: 3, gpus_per_rank: 1}",
        ]
    )
    placement = plan_placement(cfg, 5)
    assert [r.group for r in placement.ranks] == ["driver", "trainer", "critic", "critic", "rollout"]
    assert all(not r.module_names for r in placement.ranks if r.group == "critic")
    critic = [g for g in trainer_group(cfg) if g.name == "critic"]
    assert [(g.count, g.cpus_per_rank, g.gpus_per_rank) for g in critic] == [(2, 3, 1)]
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, 4)
    assert "2 critic (service.train_service.critic.world_size)" in str(err.value)
    grpo = compose_config(["launch_mode=mpi", "service.train_service.critic.world_size=2"])
    assert [r.group for r in plan_placement(grpo, 3).ranks] == ["driver", "trainer", "rollout"]


def test_critic_ranks_and_engine_are_checked() -> None:
    from tests.test_advantage_oracles import _problems

    problems = _problems(["algorithm=ppo", "service.train_service.critic.world_size=2"])
    assert set(problems) == {"service.train_service.critic.world_size", "service.train_service.critic.engine"}
    assert "launch_mode=mpi" in problems["service.train_service.critic.world_size"]
