"""A two-rank trainer group (torchrun, gloo) that trains one step and broadcasts its weights to a
sync's group, then exports them (the reference the engine must match).
    torchrun --nproc_per_node 2 -m tests.helpers.broadcast_trainer MODEL_DIR OUT_DIR ENGINE SPEC_JSON SEED
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    torch.set_num_threads(1)
    from nexrl_hpc.trainer.parallel import init_trainer_process_group
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    model_dir, out_dir, engine, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    seed = int(sys.argv[5])
    init_trainer_process_group("gloo")
    cfg = compose_config(
        [f"service.train_service.engine={engine}", "service.train_service.actor.optim.lr=0.05"]
    )
    trainer = PolicyTrainer(model_dir)
    trainer.initialize_worker(TrainWorker(cfg, trainer).train_service_config(), world_size=2)
    trainer.init_model()
    trainer.update_actor({"batch": dict(make_batch(13, seed=seed))})  # sharded weights that moved
    sent = trainer.broadcast_weights(spec)
    trainer.export_weights(os.path.join(out_dir, "weights"))
    if trainer.parallel.rank == 0:
        with open(os.path.join(out_dir, "sent.json"), "w") as f:
            json.dump(sent, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
