"""A LoRA policy's weights on disk: the adapter in PEFT layout, nothing of the base model.

``adapter_config.json`` + ``adapter_model.safetensors`` (a few MB), as ``PeftModel.save_pretrained``
writes them, so ``PeftModel.from_pretrained(base, dir)`` loads a checkpoint's ``model/`` and an
engine loads a weight sync's ``version_<v>/``. The state handed in is the trained model's (peft's
key names, any engine's gathered full state dict); peft picks the adapter's entries and names.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nexrl_hpc.checkpoint.hf import fsync_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# an adapter on the head (or embedding) holds its low-rank factors, not a copy of the frozen base
# layer, which peft would add by default (the vocabulary is never resized here)
SAVE_EMBEDDINGS = False


def is_adapter_dir(path: str) -> bool:
    """Whether ``path`` holds a PEFT adapter (its ``adapter_config.json``)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def adapter_state(peft_model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a full state dict of ``peft_model``, under the names PEFT saves."""
    from peft import get_peft_model_state_dict

    picked = get_peft_model_state_dict(peft_model, state_dict=state, save_embedding_layers=SAVE_EMBEDDINGS)
    return {k: v.detach().to("cpu").contiguous() for k, v in picked.items()}


def write_adapter_dir(
    peft_model: Any, state: dict[str, torch.Tensor], out_dir: str, base_model_dir: str, fsync: bool
) -> int:
    """Write the adapter of ``state`` to ``out_dir`` (temp dir, then rename); its bytes."""
    adapter = adapter_state(peft_model, state)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    config = peft_model.peft_config["default"]
    base_name = config.base_model_name_or_path
    config.base_model_name_or_path = base_model_dir  # where the base the adapter was trained on lives
    try:
        config.save_pretrained(tmp)
    finally:
        config.base_model_name_or_path = base_name
    save_file(adapter, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if fsync:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return sum(t.numel() * t.element_size() for t in adapter.values())


def adapter_key_map(peft_model: Any, live_names: list[str]) -> dict[str, str]:
    """``{name in the adapter file: name in the live model's state dict}`` (peft drops the adapter
    name, ``.default``, when it saves): each live name probed through peft's own renaming."""
    from peft import get_peft_model_state_dict

    probe = {name: torch.tensor(i) for i, name in enumerate(live_names)}
    saved = get_peft_model_state_dict(peft_model, state_dict=probe, save_embedding_layers=SAVE_EMBEDDINGS)
    return {k: live_names[int(v)] for k, v in saved.items()}


def check_adapter_dir(
    model_dir: str, key_map: dict[str, str], shapes: dict[str, tuple[int, ...]]
) -> Exception | None:
    """Why ``model_dir``'s adapter cannot replace the live one (no adapter, names, shapes), from its
    header alone; None when it can."""
    path = os.path.join(model_dir, ADAPTER_WEIGHTS)
    if not is_adapter_dir(model_dir) or not os.path.isfile(path):
        return FileNotFoundError(
            f"{model_dir}: no LoRA adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}); "
            "service.train_service.actor.lora.rank > 0 resumes from a LoRA run's checkpoint"
        )
    with safe_open(path, framework="pt") as f:
        entries = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    missing, unexpected = set(key_map) - set(entries), set(entries) - set(key_map)
    if missing or unexpected:
        return ValueError(f"{path}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    wrong = [f"{k} {list(s)}" for k, s in entries.items() if s != shapes[key_map[k]]]
    return ValueError(f"{path}: shapes differ from the adapter's: {wrong[:5]}") if wrong else None


def read_adapter_dir(model_dir: str, key_map: dict[str, str]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the live model's names (``check_adapter_dir`` first)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(model_dir, ADAPTER_WEIGHTS), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is no dict
            out[key_map[k]] = f.get_tensor(k)
    return out
