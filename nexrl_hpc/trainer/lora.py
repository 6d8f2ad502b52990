"""LoRA on the policy through peft (``service.train_service.actor.lora``, rank > 0).

The HF model is wrapped by ``peft.get_peft_model`` before the parallel strategy sees it: only the
adapter (and ``modules_to_save``) require grad, so the optimizer is built over them alone. The KL
reference is the same base with the adapter switched off (``reference_log_probs``): no second copy
of the base model. Weight syncs and checkpoints carry the adapter in PEFT layout
(``checkpoint.adapter``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

ADAPTER_INIT_SEED = 0


# the random-init tiny model with a tied head: its RMSNorms (peft matches "norm" as a name suffix)
# and the head, which is its embedding, trained in full (the local engine serves them)
TINY_MODEL_SAVED_MODULES = ["norm", "lm_head"]


def resolved_actor(actor: Mapping[str, Any], model: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """``actor`` with ``lora.modules_to_save: auto`` resolved: the adapter alone, except for the
    built-in tiny model with a tied head on the local engine: its head (the random embedding) and
    norms trained in full beside it (vLLM serves no module trained in full)."""
    lora = actor["lora"]
    if lora["modules_to_save"] != "auto":
        return dict(actor)
    tied_tiny = model["path"] is None and model["tiny"]["tie_word_embeddings"]
    saved = list(TINY_MODEL_SAVED_MODULES) if tied_tiny and backend != "vllm" else None
    return dict(actor, lora=dict(lora, modules_to_save=saved))


def lora_enabled(actor: dict[str, Any]) -> bool:
    """Whether ``actor.lora.rank`` asks for LoRA (0: full fine-tuning). A critic's section has no
    ``lora``: it trains its whole value model."""
    lora = actor.get("lora")
    return lora is not None and int(lora["rank"]) > 0


def learning_rate(actor: dict[str, Any]) -> float:
    """The optimizer's base LR: ``actor.lora.lr`` with LoRA, ``actor.optim.lr`` otherwise."""
    return float(actor["lora"]["lr"] if lora_enabled(actor) else actor["optim"]["lr"])


def peft_config(lora: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` from ``actor.lora`` (a causal LM's task type: saved adapters load with
    ``PeftModel.from_pretrained`` / ``AutoPeftModelForCausalLM``)."""
    from peft import LoraConfig, TaskType

    target = lora["target_modules"]
    return LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=int(lora["alpha"]),
        lora_dropout=float(lora["dropout"]),
        target_modules=target if isinstance(target, str) else list(target),
        modules_to_save=list(lora["modules_to_save"]) if lora["modules_to_save"] else None,
        task_type=TaskType.CAUSAL_LM,
    )


def wrap_with_lora(model: torch.nn.Module, lora: dict[str, Any]) -> torch.nn.Module:
    """The model with a LoRA adapter (named ``default``); raises ValueError naming
    ``actor.lora.target_modules`` when they match no module of the model."""
    from peft import get_peft_model

    try:
        # lora_A's random init drawn from a fixed seed: every trainer rank starts from the same
        # adapter (sharding takes each rank's copy), and runs match whatever the engine
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ADAPTER_INIT_SEED)
            return get_peft_model(model, peft_config(lora))
    except ValueError as exc:
        if "target" in str(exc).lower():
            raise ValueError(
                f"service.train_service.actor.lora.target_modules={lora['target_modules']!r}: {exc}"
            ) from exc
        raise


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer holds: the parameters that require grad (all of them without LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def peft_model_of(model: torch.nn.Module) -> Any:
    """The ``PeftModel`` inside ``model`` (itself, or a DeepSpeed engine's ``module``), or None."""
    from peft import PeftModel

    inner = getattr(model, "module", model)
    return inner if isinstance(inner, PeftModel) else None


@contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward passes: peft's ``disable_adapter`` on the wrapped policy."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise RuntimeError("adapter_disabled: the policy has no LoRA adapter")
    with peft_model.disable_adapter():
        yield


def reference_log_probs(
    model: torch.nn.Module, compute: Callable[..., torch.Tensor], *args: Any
) -> torch.Tensor:
    """``compute(model, *args)`` with the adapter off and no gradient: the frozen reference's
    log-probs (the KL reference is the base model; no copy of it is kept)."""
    with torch.no_grad(), adapter_disabled(model):
        return compute(model, *args)
