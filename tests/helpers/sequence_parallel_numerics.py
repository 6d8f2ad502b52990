"""One training step of the FSDP2 engine on every torchrun rank, writing what it computed: the
log-probs of ``compute_log_prob``, the step's metrics and the whole gradient of its one mini-batch.

    torchrun --nproc_per_node 2 -m tests.helpers.sequence_parallel_numerics \\
        MODEL_DIR OUT.pt SP [overrides...] [:: MODEL_DIR OUT.pt SP [overrides...]]...

SP is the trainer payload's ``sequence_parallel_size``. The config is composed with the default
(1) and the payload set afterwards: the config check asks for a world_size the MPI launch owns.
"""

from __future__ import annotations

import sys

import torch


def make_long_batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of 4-11 prompt and 1-7 response tokens: uneven, odd lengths (padding to a multiple of
    the sequence-parallel size is exercised)."""
    from nexrl_hpc.algorithm.batching import pack_trajectories
    from nexrl_hpc.types import Batch

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        p_len, r_len = 3 + (i * 5) % 8, 1 + (i * 3) % 7
        trajs.append(
            {
                "prompt_ids": [1] + torch.randint(4, 16, (p_len,), generator=g).tolist(),
                "response_ids": torch.randint(4, 16, (r_len,), generator=g).tolist(),
                "behaviour_log_probs": [-2.5] * r_len,
            }
        )
    t = pack_trajectories(Batch.from_trajectories(trajs), pad_token_id=0)
    t["old_log_probs"] = t["behaviour_log_probs"].clone() + 0.1 * torch.randn(
        t["response_mask"].shape, generator=g
    )
    t["advantages"] = torch.randn(n, 1, generator=g) * t["response_mask"]
    return t


def run_case(model_dir: str, out: str, sequence_parallel: int, extra: list[str]) -> None:
    import torch.distributed as dist

    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config

    cfg = compose_config(
        [
            "service.train_service.engine=fsdp",
            "trajectory_pool.batch_size=16",
            "service.train_service.actor.ppo_mini_batch_size=16",  # 11 rows: one optimizer step, its gradient stays
            "service.train_service.actor.ppo_micro_batch_size=3",
            "service.train_service.actor.grad_clip=1e9",  # the gradient as computed, not clipped
            "service.train_service.actor.share_prompt=false",
            *extra,
        ]
    )
    eng = PolicyTrainer(model_dir)
    payload = dict(TrainWorker(cfg, eng).train_service_config(), sequence_parallel_size=sequence_parallel)
    eng.initialize_worker(payload, world_size=dist.get_world_size())
    eng.init_model()
    batch = make_long_batch(11, seed=3)
    logp = eng.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"]
    metrics = eng.update_actor({"batch": dict(batch)})["meta_info"]["metrics"]
    trained = [
        (name, p) for name, p in eng.model.named_parameters() if p.requires_grad
    ]  # LoRA: the adapter's
    grads = {name: p.grad.full_tensor() for name, p in trained}  # collective
    if dist.get_rank() == 0:
        mask = batch["response_mask"].bool()
        torch.save({"logp": logp[mask], "metrics": metrics, "grads": grads}, out)


def main() -> None:
    torch.set_num_threads(1)
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    init_trainer_process_group("gloo")
    args = sys.argv[1:]
    while args:
        case, args = (args[: args.index("::")], args[args.index("::") + 1 :]) if "::" in args else (args, [])
        run_case(case[0], case[1], int(case[2]), case[3:])


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
