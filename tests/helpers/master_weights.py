"""Train the tiny model a few steps at a small LR and report how many weights moved and in what
dtype the parameters and the optimizer state are held (one process, or every torchrun rank).

    python -m tests.helpers.master_weights MODEL_DIR OUT_DIR single service.train_service.dtype=bfloat16
    torchrun --nproc_per_node 2 -m tests.helpers.master_weights MODEL_DIR OUT_DIR fsdp \
        service.train_service.dtype=bfloat16 :: MODEL_DIR OUT_DIR2 fsdp     # cases split by ``::``

Each case writes ``rank_<r>.json``: ``changed_frac`` (rank 0: the share of weight elements that
differ element-wise from before the updates), ``param_dtypes`` and ``optimizer_dtypes`` (the dtypes
of this rank's trainable parameters and of its optimizer state's floating tensors) and
``compute_dtypes`` (what its linear layers but the LM head output in a forward pass).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

UPDATES = 3
SMALL_LR = (
    "service.train_service.actor.optim.lr=1.0e-6",
    "service.train_service.actor.optim.lr_warmup_steps=0",
)


def measure(model_dir: str, engine_name: str, overrides: list[str], world_size: int) -> dict[str, Any]:
    """``UPDATES`` updates on fixed batches; what moved and the dtypes (this rank's)."""
    from nexrl_hpc.trainer.logprobs import output_head
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config
    from tests.test_policy_trainer import make_batch

    cfg = compose_config([f"service.train_service.engine={engine_name}", *SMALL_LR, *overrides])
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(cfg, eng).train_service_config(), world_size=world_size)
    eng.init_model()
    par = eng.parallel
    assert par is not None and eng.optimizer is not None
    before = {k: v.clone() for k, v in par.full_state_dict(eng.model).items()}  # may be the live tensors
    masters_before = [m.clone() for m in _masters(eng)]
    compute_dtypes: set[str] = set()  # what the linear layers compute in (old-policy log-probs)
    # the LM head's module answers the bounded path's fp32 log-probs (logprob_chunk_tokens), not logits
    head = output_head(eng.model)
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: compute_dtypes.add(str(out.dtype)))
        for m in eng.model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    ]
    eng.compute_log_prob({"batch": make_batch(13, seed=0)})
    for hook in hooks:
        hook.remove()
    for seed in range(UPDATES):
        eng.update_actor({"batch": make_batch(13, seed=seed)})
    after = par.full_state_dict(eng.model)
    changed = sum(int((before[k] != after[k]).sum()) for k in before if before[k].is_floating_point())
    total = sum(before[k].numel() for k in before if before[k].is_floating_point())
    masters = _masters(eng)
    masters_changed = sum(int((a != b).sum()) for a, b in zip(masters_before, masters))
    optimizer_tensors = [
        t for state in eng.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    return {
        "changed_frac": changed / total if total else None,
        "masters_changed_frac": masters_changed / sum(m.numel() for m in masters),
        "master_dtypes": sorted({str(m.dtype) for m in masters}),
        "compute_dtypes": sorted(compute_dtypes),
        "param_dtypes": sorted({str(p.dtype) for p in eng.model.parameters() if p.requires_grad}),
        "optimizer_dtypes": sorted({str(t.dtype) for t in optimizer_tensors if t.dim() > 0}),
    }


def _masters(eng: Any) -> list[torch.Tensor]:
    """What the optimizer updates, on this rank: the parameters (FSDP2: their local shards), or
    DeepSpeed's fp32 copies (in the client optimizer's groups; ZeRO-3 puts them there only while
    it steps)."""
    engine = getattr(eng.parallel, "engine", None)
    zero3_flat = getattr(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat", None)
    if zero3_flat:
        return [t.detach() for t in zero3_flat]
    params = [p for group in eng.optimizer.param_groups for p in group["params"]]
    return [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in params]


def main() -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from nexrl_hpc.trainer.parallel import init_trainer_process_group

    if world_size > 1:
        init_trainer_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    args = sys.argv[1:]
    while args:
        case, args = (args[: args.index("::")], args[args.index("::") + 1 :]) if "::" in args else (args, [])
        model_dir, out_dir, engine_name = case[:3]
        result = measure(model_dir, engine_name, case[3:], world_size)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    from nexrl_hpc.trainer.parallel import close_trainer_process_group, exit_trainer_process

    close_trainer_process_group()
    exit_trainer_process(0)
