"""``<run_dir>/rollouts/step_<N>.h5``: the batch a step trained on, for audits and exactly-once checks."""

from __future__ import annotations

import os

import h5py
import numpy as np
import torch

from nexrl_hpc.types import Batch


def dump_rollouts(run_dir: str, step: int, batch: Batch) -> str:
    values, meta = batch.values, batch.metadata
    out_dir = os.path.join(run_dir, "rollouts")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"step_{step}.h5")
    tmp = f"{path}.tmp-{os.getpid()}"
    mask = values["response_mask"]
    with h5py.File(tmp, "w") as f:
        f.attrs["step"] = step
        f.attrs["model_tag"] = str(meta.get("model_tag", "default"))
        f.create_dataset(
            "uid", data=np.array([str(u) for u in meta.get("uid", [])], dtype=h5py.string_dtype())
        )
        f.create_dataset("epoch", data=np.array(meta.get("epoch", []), dtype=np.int64))
        f.create_dataset("input_ids", data=values["input_ids"].numpy())
        f.create_dataset("attention_mask", data=values["attention_mask"].numpy().astype(np.int8))
        f.create_dataset("responses", data=values["responses"].numpy())
        f.create_dataset("response_mask", data=mask.numpy().astype(np.int8))
        f.create_dataset("rewards", data=values["rewards"].numpy())
        adv = values["advantages"]
        seq_adv = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        f.create_dataset("advantages", data=seq_adv.numpy())
        f.create_dataset("behaviour_log_probs", data=values["behaviour_log_probs"].numpy())
        wv = values.get("weight_version")
        f.create_dataset(
            "weight_version", data=(wv if isinstance(wv, torch.Tensor) else torch.tensor(wv)).numpy()
        )
    os.replace(tmp, path)
    return path
