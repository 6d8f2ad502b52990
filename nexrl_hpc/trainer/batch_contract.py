"""The training batch contract: which tensors a batch must hold, and that their rows line up.

Checked where a batch enters a trainer (``PolicyTrainer.plan_batch``, the no-op service) and on a
trainer group's client before a byte is sent (``check_batch``).
"""

from __future__ import annotations

from typing import Any

import torch

REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def check_training_batch(tensors: dict[str, Any], need: tuple[str, ...]) -> int:
    """Validate names and row counts before any work; returns the batch size."""
    missing = [k for k in need if k not in tensors]
    if missing:
        raise KeyError(f"training batch is missing {missing}")
    sizes = {k: int(v.shape[0]) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"training batch tensors have different row counts: {sizes}")
    r = tensors["responses"].shape[1]
    for k in ("response_mask", "old_log_probs", "advantages", "is_weights"):
        if k in tensors and tensors[k].shape[1] != r:
            raise ValueError(f"training batch {k!r} has {tensors[k].shape[1]} columns, responses has {r}")
    return next(iter(sizes.values()))


def check_batch(operation: str, tensors: dict[str, Any]) -> None:
    """Names and row counts checked on the client, before a byte is sent."""
    need = REQUIRED_KEYS + (("old_log_probs", "advantages") if operation == "update_actor" else ())
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{operation} batch: {bad} are not tensors")
    check_training_batch(tensors, need)
