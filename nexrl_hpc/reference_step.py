"""One synchronous GRPO step, in one process, top to bottom: the first page to read.

A run spreads this step over modules on threads or ranks: the data loader hands out prompts, rollout
workers ask the inference server for samples and score them, the trajectory pool releases complete
groups, the advantage processor turns them into a training batch, the train worker has the trainer
update the policy. Here the same step is one function calling the same pieces: the tiny model and
tokenizer the config builds, the task's rows and reward function, ``core_algos``' advantages,
``pack_trajectories`` and the ``PolicyTrainer``'s update (whose loss is ``algorithm.loss.ActorLoss``).
``tests/test_reference_step.py`` checks that its loss is the framework's on the same trajectories.
Left out: what the defaults leave off (DAPO's overlong shaping and dynamic sampling, per-turn
advantages of agents, off-policy corrections, distillation).

    python -m nexrl_hpc.reference_step            # one step of the default config
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, cast

import torch

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.algorithm.core_algos import group_index, outcome_advantages
from nexrl_hpc.config.imports import load_object
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.models.tiny import load_model, load_tokenizer, materialize_base_model, stop_token_ids
from nexrl_hpc.rewards.combined import load_rewards
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import train_service_config
from nexrl_hpc.types import Batch, Trajectory


@dataclass
class ReferenceStep:
    trajectories: Batch[list[Any]]  # what was sampled and scored, with the fields a rollout worker puts
    tensors: dict[str, torch.Tensor]  # the training batch the trainer got
    metrics: dict[str, Any]  # the trainer's actor/* metrics (actor/loss: the step's loss)


@torch.no_grad()
def sample(
    model: Any, prompt_ids: list[int], n: int, max_tokens: int, temperature: float, stop_ids: tuple[int, ...]
) -> list[tuple[list[int], list[float], str]]:
    """``n`` responses to one prompt, a token at a time: (token ids, each token's log-prob under the
    policy, finish reason). The log-probs are the behaviour policy's, as the engine reports them."""
    sequences = torch.tensor([prompt_ids] * n)
    tokens: list[list[int]] = [[] for _ in range(n)]
    log_probs: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_tokens):
        logits = model(input_ids=sequences).logits[:, -1, :].float()
        log_p = torch.log_softmax(logits, dim=-1)
        chosen = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(-1)
        for i, token in enumerate(chosen.tolist()):
            if not done[i]:  # a finished response ignores what its row samples after the stop token
                tokens[i].append(token)
                log_probs[i].append(float(log_p[i, token]))
                done[i] = token in stop_ids
        if all(done):
            break
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
    return [(t, lp, "stop" if d else "length") for t, lp, d in zip(tokens, log_probs, done)]


def reference_step(config: RLTrainConfig, model_dir: str | None = None) -> ReferenceStep:
    """One GRPO step of ``config`` (sync mode's step: sampled by the weights it trains)."""
    data, rollout, algo = config["data"], config["rollout_worker"], config["algorithm"]
    torch.manual_seed(config["seed"])

    # 1. The policy: the tiny model the config builds (or model.path), a trainer over it, and the
    #    sampler's own copy of the same weights (the inference server's, in a run).
    if model_dir is None:
        model_dir = materialize_base_model(config["model"], os.path.join(config["run_dir"], "base_model"))
    tokenizer = load_tokenizer(model_dir)
    trainer = PolicyTrainer(model_dir)
    trainer.initialize_worker(train_service_config(config))
    trainer.init_model()
    sampler = load_model(model_dir).eval()

    # 2. A batch of prompts: the task's first training rows (data.type=task; a run shuffles them).
    assert config["task"]["generator"] is not None, "the reference step reads the task's generator"
    rows = load_object(config["task"]["generator"])(config["task"]["params"], data["seed"])["train"]
    rows = rows[: data["batch_size"]]

    # 3. Sample a group of rollout_repeat_n responses per prompt and score each with the task's reward.
    assert rollout["reward_fn"] is not None, "the reference step scores with the task's reward"
    reward = load_rewards(
        rollout["reward_fn"],
        rollout["reward_weights"],
        "rollout_worker.reward_fn",
        "rollout_worker.reward_weights",
    )
    stop_ids = stop_token_ids(model_dir, tokenizer)
    trajectories: list[Trajectory] = []
    for index, row in enumerate(rows):
        prompt_ids = tokenizer(row["prompt"]).input_ids
        group = sample(
            sampler,
            prompt_ids,
            data["rollout_repeat_n"],
            rollout["max_response_length"],
            rollout["temperature"],
            stop_ids,
        )
        for sample_index, (response_ids, log_probs, finish_reason) in enumerate(group):
            scores = reward(row, tokenizer.decode(response_ids, skip_special_tokens=True))
            trajectory = {
                **row,  # the task's own fields ride along (the reward reads the answer)
                "uid": str(index),
                "group_id": f"{index}@0",
                "sample_index": sample_index,
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
                "behaviour_log_probs": log_probs,
                "finish_reason": finish_reason,
                "weight_version": 0,
                "scores": scores,
                "reward": float(scores["reward"]),
            }
            trajectories.append(cast(Trajectory, trajectory))
    batch = Batch.from_trajectories(trajectories)

    # 4. Advantages: each response's reward against its group's (GRPO: (r - mean) / (std + eps)),
    #    broadcast over the response's tokens.
    tensors = pack_trajectories(batch, tokenizer.pad_token_id)
    rewards = torch.tensor(batch.values["reward"], dtype=torch.float32)
    groups = group_index(batch.values["group_id"])
    advantages, _ = outcome_advantages(
        algo["adv_estimator"],
        rewards,
        groups,
        tensors["response_mask"],
        algo["norm_adv_by_std"],
        algo["adv_epsilon"],
    )
    tensors["advantages"] = advantages[:, None] * tensors["response_mask"]

    # 5. The update: PPO-clip against the sampling policy's log-probs (on-policy: the ratio starts
    #    at 1), one optimizer step per mini-batch of the trainer's config.
    tensors["old_log_probs"] = tensors["behaviour_log_probs"]
    answer = trainer.update_actor(
        {"batch": dict(tensors), "meta_info": {"global_token_num": int(tensors["attention_mask"].sum())}}
    )
    return ReferenceStep(batch, tensors, answer["meta_info"]["metrics"])


def main() -> None:
    """One step of the default config (``run_dir``: a temporary directory), its loss and reward."""
    from hydra import compose, initialize_config_dir

    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config import register_resolvers
    from nexrl_hpc.config.location import CONFIG_NAME, config_dir

    register_resolvers()
    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="reference_step"):
            config = validate_config(compose(CONFIG_NAME, overrides=[f"run_dir={run_dir}"]))
        step = reference_step(config)
    reward = sum(step.trajectories.values["reward"]) / len(step.trajectories)
    print(
        f"reward {reward:.3f}  loss {step.metrics['actor/loss']:.5f}  grad_norm {step.metrics['actor/grad_norm']:.4f}"
    )


if __name__ == "__main__":
    main()
