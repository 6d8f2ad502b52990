"""Train, checkpoint and resume the train engine on fixed batches, on any number of torchrun ranks:
what a resume on another shape is compared against (tests/test_reshard.py).

    torchrun --nproc_per_node 2 -m tests.helpers.reshard_numerics MODEL_DIR OUT_DIR fsdp through
    torchrun --nproc_per_node 4 -m tests.helpers.reshard_numerics MODEL_DIR OUT_DIR fsdp resume CKPT

``through``: ``SAVED_AT`` updates, a checkpoint (``OUT_DIR/ckpt``), ``AFTER`` more updates, with no
break (the uninterrupted run). ``resume``: a fresh engine loads ``CKPT`` and saves it again at once
in its own layout (``OUT_DIR/resaved``: what it holds after the load), then the same ``AFTER``
updates. Both write every update's metrics and the final weights. Several cases, separated by
``::``, run one after another in the same processes. An engine name ``<engine>+lora`` trains a
rank-4 LoRA adapter (its optimizer state is the adapter's) instead of the whole model;
``deepspeed+state_dict`` saves ZeRO-3's optimizer files as DeepSpeed's own ``state_dict`` (the
files of checkpoints written before they were keyed by parameter name); ``<engine>+bf16`` computes
in bf16 (``dtype=bfloat16``: ZeRO-3's module weights bf16 beside its fp32 masters).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

SAVED_AT, AFTER = 2, 2  # updates before the checkpoint, and after it


def main() -> None:
    torch.set_num_threads(1)
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    init_trainer_process_group("gloo")
    world_size = int(os.environ["WORLD_SIZE"])
    args = sys.argv[1:]
    while args:
        case, args = (args[: args.index("::")], args[args.index("::") + 1 :]) if "::" in args else (args, [])
        model_dir, out_dir, engine_name, mode = case[:4]
        run_case(model_dir, out_dir, engine_name, mode, case[4] if len(case) > 4 else "", world_size)


def run_case(model_dir: str, out_dir: str, engine_name: str, mode: str, ckpt: str, world_size: int) -> None:
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    engine_name, _, variant = engine_name.partition("+")
    lora = [
        "service.train_service.actor.lora.rank=4",
        "service.train_service.actor.lora.alpha=8",
        "service.train_service.actor.lora.modules_to_save=[norm,lm_head]",  # modules in full reshard too
    ]
    cfg = compose_config(
        [
            *(lora if variant == "lora" else []),
            *(["service.train_service.dtype=bfloat16"] if variant == "bf16" else []),
            f"service.train_service.engine={engine_name}",
            "service.train_service.actor.ppo_mini_batch_size=8",  # 13 rows: mini-batches of 8 and 5
            "service.train_service.actor.ppo_micro_batch_size=3",
            "service.train_service.actor.optim.lr_warmup_steps=3",  # the LR schedule crosses the checkpoint
            "service.train_service.actor.share_prompt=false",
        ]
    )
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config(), world_size=world_size)  # type: ignore[arg-type]
    eng.init_model()
    if variant == "state_dict":  # this engine's files as before: DeepSpeed's own optimizer state_dict
        from nexrl_hpc.trainer.deepspeed_strategy import _plain

        strategy: Any = eng.parallel
        strategy.optimizer_state = lambda model, optimizer: _plain(strategy.engine.optimizer.state_dict())
    batches = [make_batch(13, seed=s) for s in range(SAVED_AT + AFTER)]
    metrics = []
    if mode == "through":
        metrics += [eng.update_actor({"batch": dict(b)})["meta_info"]["metrics"] for b in batches[:SAVED_AT]]
        eng.save_checkpoint(os.path.join(out_dir, "ckpt"), global_step=SAVED_AT)
    else:
        eng.load_checkpoint(ckpt)
        eng.save_checkpoint(os.path.join(out_dir, "resaved"), global_step=SAVED_AT)
    metrics += [eng.update_actor({"batch": dict(b)})["meta_info"]["metrics"] for b in batches[SAVED_AT:]]
    eng.export_weights(os.path.join(out_dir, "weights"))
    if eng.parallel is not None and eng.parallel.rank == 0:
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
