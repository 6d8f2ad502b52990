"""DeepSpeed ZeRO-3's optimizer state keyed by parameter name: what ``checkpoint.reshard`` reads and
writes for engine=deepspeed at stage 3.

For each trainable parameter (its name in the unwrapped module's ``named_parameters``) this rank's
partition as a flat 1-D tensor of its valid elements: AdamW's ``exp_avg`` and ``exp_avg_sq``, the
fp32 master (``reshard.MASTER``) and ``step``. ZeRO-3 partitions each flattened parameter into
``ds_tensor.numel()`` = ``ceil(numel / world)`` elements per rank; the last rank's padding is not
saved and is zero-filled on load. The values go through DeepSpeed's local API
(``deepspeed.utils.safe_{get,set}_local_*``); a fresh engine, before its first step, has no AdamW
state yet: it is created as DeepSpeed's universal-checkpoint loader creates it (zeros the size of
the sub-group's flat fp32 partition, then each parameter's range written).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nexrl_hpc.checkpoint.reshard import FLAT_BY_NAME, MASTER

MOMENTS = ("exp_avg", "exp_avg_sq")


def _trainable(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _sub_group(opt: Any, param: torch.nn.Parameter) -> int:
    """The ZeRO-3 sub-group whose flat fp32 partition holds ``param``'s."""
    return int(opt.grad_position[opt.get_param_id(param)][0])


def _valid(param: Any) -> int:
    """How many of this rank's ``ds_tensor`` elements are the parameter's (the rest: padding)."""
    part = param.ds_tensor.numel()
    rank = dist.get_rank() if dist.is_initialized() else 0
    return max(0, min(part, int(param.ds_numel) - part * rank))


def zero3_state(engine: Any) -> dict[str, Any]:
    """This rank's partitions, keyed by parameter name (the optimizer file's ``optimizer``)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    opt = engine.optimizer
    groups: list[list[str]] = [[] for _ in opt.optimizer.param_groups]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in _trainable(engine):
        sub = _sub_group(opt, p)
        groups[opt.sub_group_to_group_id[sub]].append(name)
        valid = _valid(p)
        entry = {MASTER: safe_get_local_fp32_param(p)[:valid].detach().cpu().clone()}
        moments = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[sub]) or {}
        if all(k in moments for k in MOMENTS):  # none before the first step
            for key in MOMENTS:
                entry[key] = safe_get_local_optimizer_state(p, key)[:valid].detach().cpu().clone()
            step = moments["step"]
            entry["step"] = step.detach().cpu().clone() if isinstance(step, torch.Tensor) else step
        state[name] = entry
    param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(opt.optimizer.param_groups, groups)
    ]
    return {"state": state, "param_groups": param_groups, "zero_stage": 3, "layout": FLAT_BY_NAME}


def is_by_name(state: dict[str, Any]) -> bool:
    """Whether a ZeRO-3 optimizer file holds this module's layout (else DeepSpeed's own state_dict,
    as files written before it: loaded at the same layout by DeepSpeed)."""
    return state.get("layout") == FLAT_BY_NAME


def load_zero3_state(engine: Any, saved: dict[str, Any]) -> None:
    """``zero3_state``'s result (from this layout or resharded from another) into the engine: the
    moments, step and fp32 masters of each parameter's partition, the module's partition from the
    masters, the param groups' hyperparameters."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    opt = engine.optimizer
    by_name = saved["state"]
    touched = []
    for name, p in _trainable(engine):
        entry = by_name.get(name)
        if not entry:
            continue
        flat = opt.fp32_partitioned_groups_flat[_sub_group(opt, p)]
        moments = opt.optimizer.state[flat]
        if any(k in entry for k in MOMENTS) and not all(k in moments for k in MOMENTS):
            for key in MOMENTS:  # a fresh engine: the state DeepSpeed's universal loader creates
                moments[key] = torch.zeros_like(flat)
        for key in MOMENTS:
            if key in entry:
                safe_set_local_optimizer_state(p, _padded(entry[key], p), key)
        if "step" in entry:
            step = entry["step"]
            moments["step"] = step.clone() if isinstance(step, torch.Tensor) else step
        if MASTER in entry:
            master = _padded(entry[MASTER], p)
            safe_set_local_fp32_param(p, master)
            p.ds_tensor.data.copy_(master.to(p.ds_tensor.dtype))  # type: ignore[attr-defined]
            touched.append(p)
    for group, saved_group in zip(opt.optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    # a persistent parameter is held whole on every rank: gathered again from the new partitions
    # (as DeepSpeed's own load, then its checkpoint epilogue, do)
    persistent = [p for p in touched if getattr(p, "ds_persist", False)]
    if persistent:
        persistent[0].partition(persistent)  # type: ignore[attr-defined]
        persistent[0].all_gather(persistent)  # type: ignore[attr-defined]


def _padded(value: torch.Tensor, param: Any) -> torch.Tensor:
    """A partition's valid elements padded with zeros to ``ds_tensor``'s size, as fp32 on its device."""
    part = param.ds_tensor
    if value.numel() != _valid(param):
        raise ValueError(
            f"ZeRO-3 partition of {value.numel()} elements; this rank holds {_valid(param)} of the "
            f"parameter's {int(param.ds_numel)}"
        )
    out = torch.zeros(part.numel(), dtype=torch.float32, device=part.device)
    out[: value.numel()] = value.reshape(-1)
    return out
