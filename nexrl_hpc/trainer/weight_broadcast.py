"""The trainer's side of the broadcast weight transport: its weights, bucket by bucket, to the engines.

Every trainer rank runs ``broadcast_weights`` (gathering a bucket is a collective among them); rank 0
alone joins the sync's group (``weight_sync/wire.py``) as its rank 0 and sends. A failure to send
(an engine that died, a group that never formed) is kept, the gathering goes on to the end so every
trainer rank leaves the same collectives, and then every rank raises it (``agree``): the trainer
group stays usable and the publisher fails the sync naming what broke.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nexrl_hpc.trainer.parallel import ParallelStrategy
from nexrl_hpc.weight_sync.wire import BroadcastGroup, send_bucket, send_end


def broadcast_weights(
    par: ParallelStrategy, model: torch.nn.Module, spec: dict[str, Any], skip: set[str]
) -> dict[str, Any]:
    """Send the full weights (``skip`` left out) to ranks 1.. of the group ``spec`` describes;
    returns ``{"bytes", "buckets", "seconds"}`` (rank 0's count; 0 elsewhere)."""
    started = time.monotonic()
    group: BroadcastGroup | None = None
    error: Exception | None = None
    if par.rank == 0:
        try:
            group = BroadcastGroup(spec, rank=0, device=_wire_device(spec, model))
        except Exception as exc:
            error = RuntimeError(f"weight broadcast group {spec['host']}:{spec['port']} did not form: {exc}")
    par.agree(error)
    sent = buckets = 0
    try:
        for bucket in par.weight_buckets(model, int(spec["bucket_bytes"]), skip):
            if group is not None and error is None:
                try:
                    sent += send_bucket(group, bucket)
                    buckets += 1
                except Exception as exc:
                    error = RuntimeError(f"weight broadcast failed after {sent} bytes: {exc}")
            del bucket
        if group is not None and error is None:
            try:
                send_end(group)
            except Exception as exc:
                error = RuntimeError(f"weight broadcast failed at its end marker: {exc}")
    finally:
        if group is not None:
            group.close()
    par.agree(error)
    return {"bytes": sent, "buckets": buckets, "seconds": time.monotonic() - started}


def _wire_device(spec: dict[str, Any], model: torch.nn.Module) -> str:
    """NCCL sends from the model's GPU; gloo from host memory."""
    if spec["backend"] == "nccl":
        return str(next(model.parameters()).device)
    return "cpu"
