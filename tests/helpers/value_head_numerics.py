"""PPO's value head on the policy on two gloo ranks under FSDP2 and under DeepSpeed ZeRO-3 against
the same trainer in one process.

Every trainer starts from one model directory and the value head's fixed initial draw; each takes
a warm-up update (the head alone; FSDP2 and its reference only: ZeRO-3 refuses it), then scores a batch's values (``compute_log_prob`` with the
``VALUE_QUERY`` column), takes one actor update with the values and GAE's returns (the shared loss:
policy loss + vf_coef x value loss), and scores the values again. Rank 0 writes, per engine, the largest differences and the two updates' metrics.

    torchrun --nproc_per_node 2 -m tests.helpers.value_head_numerics OUT.json MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def run(
    model_dir: str, engine: str, world_size: int, warm_up: bool
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    from nexrl_hpc.algorithm.gae import gae_advantages, last_token_rewards
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.value_head import VALUE_QUERY, VALUE_WARMUP
    from nexrl_hpc.trainer.worker import train_service_config
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    cfg = compose_config(
        [
            "algorithm=ppo",
            "service.train_service.critic.head_on_policy=true",
            "service.train_service.critic.warmup_steps=0",  # the warm-up update is asked for by its column
            f"service.train_service.engine={engine}",
            "service.train_service.deepspeed.zero_stage=3",
            "service.train_service.actor.ppo_micro_batch_size=2",
            "service.train_service.actor.ppo_mini_batch_size=4",
        ]
    )
    trainer = PolicyTrainer(model_dir)
    trainer.initialize_worker(train_service_config(cfg), world_size=world_size)
    trainer.init_model()
    batch = make_batch(12, seed=5)
    mask = batch["response_mask"]

    def values_now() -> torch.Tensor:
        query = {**batch, VALUE_QUERY: torch.ones(12)}
        return trainer.compute_log_prob({"batch": query})["batch"]["old_log_probs"] * mask

    rewards = last_token_rewards((torch.arange(12) % 3 == 0).float(), mask)

    def update(warm_up: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        values = values_now()
        advantages, returns = gae_advantages(rewards, values, mask, 1.0, 1.0)
        update = {**batch, "advantages": advantages, "values": values, "returns": returns}
        if warm_up:
            update[VALUE_WARMUP] = torch.ones(12)
        return values, trainer.update_actor({"batch": update})["meta_info"]["metrics"]

    if warm_up:  # the head alone (PPO's critic warm-up): the trunk's gradients are None
        update(warm_up=True)
    values, metrics = update(warm_up=False)
    return values, metrics, values_now()


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    init_trainer_process_group("gloo")
    out_path, model_dir = sys.argv[1], sys.argv[2]
    result = {}
    for engine, warm_up in (("fsdp", True), ("deepspeed", False)):  # ZeRO-3 refuses the warm-up
        ref_values, ref_metrics, ref_after = run(model_dir, "single", 1, warm_up)
        values, metrics, after = run(model_dir, engine, world_size, warm_up)
        result[engine] = {
            "values": float((values - ref_values).abs().max()),
            "after": float((after - ref_after).abs().max()),
            "moved": float((ref_after - ref_values).abs().max()),
            **{key: [metrics[key], ref_metrics[key]] for key in ("critic/vf_loss", "actor/grad_norm")},
        }
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
