"""Engines serving a LoRA policy: each weight sync's adapter (PEFT layout) on the base model.

vLLM loads it itself (``weight_sync.transport``; its ``--max-lora-rank`` from
``vllm_max_lora_rank``). The local engine (``load_adapter``): the first adapter wraps the engine's
model in a ``PeftModel`` (the base weights stay as loaded, unmerged); each later one is loaded
beside it, made active, and the previous one deleted, so one adapter is held whatever the number of
syncs. The engine's weight version is the adapter's.
"""

from __future__ import annotations

from typing import Any

ADAPTER_PREFIX = "version_"

# vLLM's --max-lora-rank values (its LoRAConfig)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(configured: int | None, lora_rank: int) -> int:
    """vLLM's ``--max-lora-rank`` for adapters of ``lora_rank``: ``vllm.max_lora_rank``, or the
    smallest of vLLM's sizes that holds it (the largest when none does: pre-flight refuses that)."""
    if configured is not None:
        return int(configured)
    return next((r for r in VLLM_LORA_RANKS if r >= lora_rank), VLLM_LORA_RANKS[-1])


def adapter_names(model: Any) -> list[str]:
    """The adapters the engine's model holds (none before the first LoRA sync)."""
    config = getattr(model, "peft_config", None)
    return list(config) if isinstance(config, dict) else []


def load_adapter(engine: Any, model_path: str, weight_version: int | None) -> str:
    """Serve the adapter in ``model_path`` as ``weight_version`` (the engine's next version when
    None); the previous adapter is dropped. Takes the engine's model lock (between two batches)."""
    from peft import PeftModel

    with engine._model_lock:
        version = weight_version if weight_version is not None else engine.weight_version + 1
        held = adapter_names(engine.model)
        name = f"{ADAPTER_PREFIX}{version}"
        if name in held:  # the same version again: a fresh copy of its files
            name = f"{name}_{len(held)}"
        if not held:
            engine.model = PeftModel.from_pretrained(engine.model, model_path, adapter_name=name).eval()
        else:
            engine.model.load_adapter(model_path, adapter_name=name, is_trainable=False)
            engine.model.set_adapter(name)
            for old in held:
                engine.model.delete_adapter(old)
        engine.model.eval()
        engine.weight_version = version
    return f"loaded the LoRA adapter {model_path} as version {version}"
