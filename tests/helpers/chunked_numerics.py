"""The chunked LM-head path against the materialised one on a parallel engine, in the same ranks.

For each case two trainers of one engine are built from one model directory, one with
``service.train_service.logprob_chunk_tokens=0`` and one with a small chunk; both score a batch
(``compute_log_prob``) and run one ``update_actor`` whose accumulated gradient is caught just
before the optimizer step (the strategy's ``step`` wrapped) and gathered whole (FSDP2:
``full_tensor``; DeepSpeed: ``safe_get_full_grad``). Rank 0 writes the largest differences.

    torchrun --nproc_per_node 2 -m tests.helpers.chunked_numerics OUT.json fsdp MODEL_DIR [overrides] :: ...
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def full_grads(eng: Any, engine: str) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on every rank (a collective: all ranks call it)."""
    out: dict[str, torch.Tensor] = {}
    if engine == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        for name, p in eng.parallel.unwrap(eng.model).named_parameters():
            grad = safe_get_full_grad(p)
            if grad is not None:
                out[name] = grad.detach().float().cpu().clone()
        return out
    for name, p in eng.model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = grad.detach().float().cpu().clone()
    return out


def run(engine: str, model_dir: str, overrides: list[str], chunk: int, world_size: int) -> tuple[Any, Any]:
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    cfg = compose_config(
        [
            f"service.train_service.engine={engine}",
            f"service.train_service.logprob_chunk_tokens={chunk}",
            "service.train_service.actor.ppo_micro_batch_size=3",
            "service.train_service.actor.entropy_coeff=0.01",
            "algorithm.kl_loss_coef=0.1",
            *overrides,
        ]
    )
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config(), world_size=world_size)
    eng.init_model()
    batch = make_batch(10, seed=7)
    logp = eng.compute_log_prob({"batch": dict(batch)})["batch"]["old_log_probs"]
    caught: dict[str, torch.Tensor] = {}
    par = eng.parallel
    assert par is not None
    original_step = par.step

    def step_catching_grads(model: Any, optimizer: Any, max_norm: float) -> tuple[float, bool]:
        caught.update(full_grads(eng, engine))
        return original_step(model, optimizer, max_norm)

    par.step = step_catching_grads  # type: ignore[method-assign]
    eng.update_actor({"batch": dict(batch)})
    return logp, caught


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    if world_size > 1:
        init_trainer_process_group("gloo")
    out_path, args = sys.argv[1], sys.argv[2:]
    results = []
    while args:
        case, args = (args[: args.index("::")], args[args.index("::") + 1 :]) if "::" in args else (args, [])
        engine, model_dir, overrides = case[0], case[1], case[2:]
        ref_logp, ref_grads = run(engine, model_dir, overrides, 0, world_size)
        logp, grads = run(engine, model_dir, overrides, 5, world_size)
        results.append(
            {
                "engine": engine,
                "overrides": overrides,
                "logp": float((logp - ref_logp).abs().max()),
                "grad": max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
                "grad_tensors": len(ref_grads),
                "same_names": sorted(grads) == sorted(ref_grads),
                "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
            }
        )
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
