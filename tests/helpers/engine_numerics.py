"""Run the train engine on fixed batches and write what it computed (one process or every
torchrun rank): ``compute_log_prob`` before training, then N ``update_actor`` calls, then the
exported weights. The FSDP test compares this against the single-process engine.

    python -m tests.helpers.engine_numerics MODEL_DIR OUT_DIR single
    torchrun --nproc_per_node 2 -m tests.helpers.engine_numerics MODEL_DIR OUT_DIR fsdp
    torchrun --nproc_per_node 2 -m tests.helpers.engine_numerics MODEL_DIR OUT_DIR deepspeed 3 \
        service.train_service.deepspeed.zero_stage=2      # UPDATES, then config overrides

Several cases, separated by ``::``, run one after another in the same processes (one start-up,
one process group: the tests' 2-rank launches cost ~10 s of start-up each).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    if world_size > 1:
        init_trainer_process_group("gloo")
    args = sys.argv[1:]
    while args:
        case, args = (args[: args.index("::")], args[args.index("::") + 1 :]) if "::" in args else (args, [])
        model_dir, out_dir, engine_name = case[:3]
        run_case(model_dir, out_dir, engine_name, int(case[3]) if len(case) > 3 else 3, case[4:], world_size)


def run_case(
    model_dir: str, out_dir: str, engine_name: str, updates: int, extra: list[str], world_size: int
) -> None:
    from nexrl_hpc.checkpoint.state_file import load_state_file
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    overrides = [
        f"service.train_service.engine={engine_name}",
        "service.train_service.actor.ppo_mini_batch_size=8",  # 13 rows: mini-batches of 8 and 5
        "service.train_service.actor.ppo_micro_batch_size=3",  # ranks get 4/4 then 3/2 rows: 2 vs 1 passes
        "service.train_service.actor.optim.lr_warmup_steps=2",  # LR x0.5 then x1: the scheduled LR must apply
        "service.train_service.actor.share_prompt=false",  # the padded reference unless a test packs
        *extra,
    ]
    cfg = compose_config(overrides)
    eng = PolicyTrainer(model_dir)
    payload = TrainWorker(cfg, eng).train_service_config()
    eng.initialize_worker(payload, world_size=world_size)
    eng.init_model()
    batches = [make_batch(13, seed=s) for s in range(updates)]
    logp = eng.compute_log_prob({"batch": dict(batches[0])})["batch"]["old_log_probs"]
    metrics = [eng.update_actor({"batch": dict(b)})["meta_info"]["metrics"] for b in batches]
    eng.export_weights(os.path.join(out_dir, "weights"))
    # a checkpoint, reloaded into a fresh engine of the same layout, gives the same log-probs and
    # the same next update (weights and optimizer state both restored)
    ckpt = os.path.join(out_dir, "ckpt")
    eng.save_checkpoint(ckpt, global_step=updates)
    fresh = PolicyTrainer(model_dir)
    fresh.initialize_worker(payload, world_size=world_size)
    fresh.init_model()
    fresh.load_checkpoint(ckpt)
    probe = make_batch(13, seed=100)
    same_logp = torch.equal(
        eng.compute_log_prob({"batch": dict(probe)})["batch"]["old_log_probs"],
        fresh.compute_log_prob({"batch": dict(probe)})["batch"]["old_log_probs"],
    )
    eng.update_actor({"batch": dict(probe)})
    fresh.update_actor({"batch": dict(probe)})
    a, b = eng.parallel.full_state_dict(eng.model), fresh.parallel.full_state_dict(fresh.model)
    # non-finite gradients in every mini-batch: both optimizer steps skipped, weights unchanged
    bad = make_batch(13, seed=101)
    bad["advantages"].fill_(float("nan"))
    skipped = fresh.update_actor({"batch": bad})["meta_info"]["metrics"]["actor/nan_skipped"]
    c = fresh.parallel.full_state_dict(fresh.model)
    next_update_diff = max(float((a[k] - b[k]).abs().max()) for k in a) if a else 0.0
    nan_weights_equal = all(torch.equal(b[k], c[k]) for k in b)  # (a, b, c may share the live memory)
    # the checkpoint again, into the engine that now has optimizer state: read in place where the
    # strategy shares its live state (single, fsdp), and equal to the file on every rank
    par = fresh.parallel
    live = par.optimizer_state_in_place(fresh.model, fresh.optimizer)
    where = [t.data_ptr() for t in tensors_of(live)]
    fresh.load_checkpoint(ckpt)
    reloaded = tensors_of(par.optimizer_state(fresh.model, fresh.optimizer))
    in_file = tensors_of(
        load_state_file(os.path.join(ckpt, "optimizer", f"rank_{par.rank}.safetensors"))["optimizer"]
    )
    if len(reloaded) != len(in_file) or not all(torch.equal(x, y) for x, y in zip(reloaded, in_file)):
        raise AssertionError(f"rank {par.rank}: optimizer state after the second load differs from the file")
    if eng.parallel.rank == 0:
        resumed = {
            "same_logp": same_logp,
            "next_update_diff": next_update_diff,
            "nan_skipped": skipped,
            "nan_weights_equal": nan_weights_equal,
            "reload_in_place": bool(where) and where == [t.data_ptr() for t in reloaded],
        }
        with open(os.path.join(out_dir, "resumed.json"), "w") as f:
            json.dump(resumed, f)
        torch.save(logp, os.path.join(out_dir, "logp.pt"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)


def tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors of a nested state, in traversal order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
