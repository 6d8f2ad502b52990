"""Which ParallelStrategy the policy trainer gets: chosen by ``service.train_service.engine``.

Kept apart from the interface (``parallel``) because it imports the DeepSpeed strategy, which
imports the interface.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nexrl_hpc.trainer.parallel import FSDP2, ParallelStrategy, SingleProcess


def create_parallel_strategy(
    engine: str, cfg: dict[str, Any], device: torch.device, world_size: int
) -> ParallelStrategy:
    if engine == "single":
        return SingleProcess()
    if engine == "fsdp":
        if not dist.is_initialized() and world_size == 1:
            # one trainer rank (local mode, or one trainer rank in an MPI job): a 1-rank group
            dist.init_process_group(cfg["dist_backend"], store=dist.HashStore(), rank=0, world_size=1)
        fsdp = cfg["fsdp"]
        return FSDP2(device, fsdp["param_dtype"], fsdp["reduce_dtype"])
    if engine == "deepspeed":
        from nexrl_hpc.trainer.deepspeed_strategy import DeepSpeedZeRO

        if not dist.is_initialized() and world_size == 1:
            dist.init_process_group(cfg["dist_backend"], store=dist.HashStore(), rank=0, world_size=1)
        return DeepSpeedZeRO(cfg)
    raise ValueError(f"service.train_service.engine={engine!r} is not available")
