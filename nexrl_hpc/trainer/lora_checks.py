"""Pre-flight checks of ``service.train_service.actor.lora`` (exit 2 naming the key): the target
and saved modules name modules of the model, an adapter on the LM head only with unchunked
log-probs, and the inference engine can serve an adapter (vLLM: a server the run starts, a rank it
takes, no module trained in full beside the adapter)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe
from nexrl_hpc.inference.lora_adapter import vllm_max_lora_rank

LORA = "service.train_service.actor.lora"
IS = "service.inference_service"
CHUNK = "service.train_service.logprob_chunk_tokens"
HEAD = "lm_head"  # the LM head of the causal LMs the trainer loads (Llama, Qwen2, ...)

# engines that serve a LoRA policy: nexrl_hpc's own server applies each version's adapter, vLLM
# loads it at run time (``/v1/load_lora_adapter``)
ADAPTER_ENGINES = ("local", "vllm")


def lora_problems(cfg: Mapping) -> list[ConfigProblem]:
    """rank > 0: every listed module exists in the model, and the engine takes adapters."""
    rank = g_safe(cfg, f"{LORA}.rank")
    if not isinstance(rank, int) or rank <= 0:
        return []
    problems: list[ConfigProblem] = []
    backend = g_safe(cfg, f"{IS}.backend")
    if backend not in ADAPTER_ENGINES:
        problems.append(
            ConfigProblem(
                f"{IS}.backend",
                f"{backend} cannot serve a LoRA adapter ({LORA}.rank={rank}): use backend=local, or "
                f"{LORA}.rank=0 (full fine-tuning)",
            )
        )
    if backend == "vllm":
        problems += _vllm_problems(cfg, rank)
    names = _module_names(cfg)
    if names is None:  # model.path's own check says why it does not load
        return problems
    target = g_safe(cfg, f"{LORA}.target_modules")
    if target != "all-linear" and not any(_matches(target, n) for n in names):
        problems.append(ConfigProblem(f"{LORA}.target_modules", f"{target!r} matches no module of the model"))
    chunk = g_safe(cfg, CHUNK)
    if target != "all-linear" and _matches(target, HEAD) and isinstance(chunk, int) and chunk > 0:
        problems.append(
            ConfigProblem(
                f"{LORA}.target_modules",
                f"{target!r} puts an adapter on the LM head ({HEAD}), which the trainer's chunked "
                f"log-probs ({CHUNK}={chunk}) score through its base weight alone: set {CHUNK}=0, or "
                f"leave {HEAD} out ({LORA}.modules_to_save=[{HEAD}] trains it in full)",
            )
        )
    saved = g_safe(cfg, f"{LORA}.modules_to_save")
    for module in [] if saved == "auto" else saved or []:
        if not any(n.endswith(str(module)) for n in names):  # peft's rule for modules_to_save
            problems.append(
                ConfigProblem(f"{LORA}.modules_to_save", f"{module!r} matches no module of the model")
            )
    return problems


def _vllm_problems(cfg: Mapping, rank: int) -> list[ConfigProblem]:
    """What vLLM's LoRA cannot take: a server the run did not start (its LoRA flags and base name
    are the run's), a rank above ``--max-lora-rank``, modules trained in full beside the adapter."""
    problems: list[ConfigProblem] = []
    if g_safe(cfg, f"{IS}.base_url"):
        problems.append(
            ConfigProblem(
                f"{IS}.base_url",
                f"a LoRA policy ({LORA}.rank={rank}) needs the vLLM server the run starts itself (with "
                "LoRA enabled, the adapter served under service.inference_service.model): unset base_url",
            )
        )
    configured = g_safe(cfg, f"{IS}.vllm.max_lora_rank")
    largest = vllm_max_lora_rank(configured if isinstance(configured, int) else None, rank)
    if rank > largest:
        key = f"{IS}.vllm.max_lora_rank" if configured is not None else f"{LORA}.rank"
        problems.append(
            ConfigProblem(key, f"{LORA}.rank={rank} is above the vLLM server's --max-lora-rank {largest}")
        )
    saved = g_safe(cfg, f"{LORA}.modules_to_save")
    if saved not in ("auto", None) and list(saved):
        problems.append(
            ConfigProblem(
                f"{LORA}.modules_to_save",
                f"vLLM serves no module trained in full beside a LoRA adapter ({list(saved)}): null "
                "(the adapter alone), or backend=local",
            )
        )
    return problems


def _matches(target: object, name: str) -> bool:
    """peft's rule: a string is a regular expression over the whole module name, a list holds
    names that a module's dotted name ends with."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    if isinstance(target, (list, tuple)) or hasattr(target, "__iter__"):
        return any(name == t or name.endswith(f".{t}") for t in target)
    return False


def _module_names(cfg: Mapping) -> list[str] | None:
    """The model's module names, from a weightless (meta-device) copy built from its config: the
    tiny model's settings or ``model.path``'s config.json (None when that does not load)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        path = g_safe(cfg, "model.path")
        if path is None:
            from nexrl_hpc.models.tiny import ARCHITECTURES

            tiny = g_safe(cfg, "model.tiny")
            assert isinstance(tiny, Mapping)
            config_cls, _ = ARCHITECTURES[tiny["architecture"]]
            keys = ("hidden_size", "intermediate_size", "num_hidden_layers")
            heads = ("num_attention_heads", "num_key_value_heads")
            config = config_cls(vocab_size=64, **{k: tiny[k] for k in (*keys, *heads)})
        else:
            config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:
        return None
    return [name for name, _ in model.named_modules() if name]
