"""The local server's side of the broadcast weight transport: join the sync's group, load every bucket.

The engine's model lock is held from the first bucket to the last, so no forward pass ever sees a
mix of two versions (a generation step waits for the sync, as it waits for a disk reload). Names
and shapes are checked against the live model bucket by bucket, from its header: a wrong sender
fails the sync with the first bad name, before that bucket is received. A weight whose dtype and
device match the wire's is received in place (no second copy of it). A tied head is the
embedding's tensor: it is refreshed with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nexrl_hpc.weight_sync.wire import BroadcastGroup, receive_buckets

if TYPE_CHECKING:
    from nexrl_hpc.inference.engine import HFEngine


def receive_into_engine(engine: HFEngine, spec: dict[str, Any], rank: int, version: int) -> str:
    """Receive version ``version`` at ``rank`` of the group ``spec``; returns a message."""
    device = next(engine.model.parameters()).device
    wire_device = str(device) if spec["backend"] == "nccl" else "cpu"
    group = BroadcastGroup(spec, rank=rank, device=wire_device)
    loaded = 0
    try:
        with engine._model_lock:
            live = engine.model.state_dict()  # detached views of the live parameters

            def checked(name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
                target = live.get(name)
                if target is None:
                    raise ValueError(f"weight broadcast: unexpected weight {name!r}")
                if tuple(target.shape) != tuple(shape):
                    raise ValueError(
                        f"weight broadcast: {name} has shape {tuple(shape)}, expected {tuple(target.shape)}"
                    )
                return target  # received in place when it fits (same dtype, on the wire's device)

            for bucket in receive_buckets(group, into=checked):
                with torch.no_grad():
                    for name, tensor in bucket:
                        if tensor is not live[name]:
                            live[name].copy_(tensor)
                loaded += len(bucket)
            engine.weight_version = version
    finally:
        group.close()
    return f"received {loaded} tensors as version {version}"
