"""PPO's critic on two gloo ranks under FSDP2 and under DeepSpeed ZeRO-3 against the same critic
in one process.

Every critic starts from one value-model directory (its head saved, so all start equal); each
scores a batch (the values ``compute_log_prob`` answers), takes one value update on it, and scores
it again. Rank 0 writes, per engine, the largest differences and the two updates' losses.

    torchrun --nproc_per_node 2 -m tests.helpers.critic_numerics OUT.json VALUE_MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def run(model_dir: str, engine: str, world_size: int) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    from nexrl_hpc.algorithm.gae import gae_advantages, last_token_rewards
    from nexrl_hpc.trainer.critic import ValueTrainer, critic_batch, critic_service_config
    from nexrl_hpc.trainer.worker import train_service_config
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    cfg = compose_config(
        [
            "algorithm=ppo",
            f"service.train_service.critic.engine={engine}",
            "service.train_service.deepspeed.zero_stage=3",
            "service.train_service.critic.ppo_micro_batch_size=3",
            "service.train_service.critic.ppo_mini_batch_size=6",
        ]
    )
    critic = ValueTrainer(model_dir)
    config = critic_service_config(train_service_config(cfg), cfg["service"]["train_service"]["critic"])
    critic.initialize_worker(config, role="critic", world_size=world_size)
    critic.init_model()
    batch = make_batch(12, seed=5)
    mask = batch["response_mask"]
    values = critic.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"] * mask
    rewards = last_token_rewards((torch.arange(12) % 3 == 0).float(), mask)
    _, returns = gae_advantages(rewards, values, mask, 1.0, 1.0)
    metrics = critic.update_actor({"batch": critic_batch(batch, values, returns)})["meta_info"]["metrics"]
    after = critic.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"] * mask
    return values, metrics, after


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    init_trainer_process_group("gloo")
    out_path, model_dir = sys.argv[1], sys.argv[2]
    ref_values, ref_metrics, ref_after = run(model_dir, "single", 1)
    result = {}
    for engine in ("fsdp", "deepspeed"):
        values, metrics, after = run(model_dir, engine, world_size)
        result[engine] = {
            "values": float((values - ref_values).abs().max()),
            "after": float((after - ref_after).abs().max()),
            "moved": float((ref_after - ref_values).abs().max()),
            "vf_loss": [metrics["critic/vf_loss"], ref_metrics["critic/vf_loss"]],
            "grad_norm": [metrics["critic/grad_norm"], ref_metrics["critic/grad_norm"]],
        }
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
