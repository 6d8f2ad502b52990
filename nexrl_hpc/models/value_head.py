"""PPO's value head on the policy model itself (``service.train_service.critic.head_on_policy``): a
one-output linear layer over the decoder's final hidden state, registered as the submodule
``value_head`` of the causal LM, so every parallel engine shards, gathers and checkpoints it with
the policy's weights, and the actor's optimizer trains it with the trunk (TRL's
``AutoModelForCausalLMWithValueHead``).

Its tensors never go to an inference engine (the exports and broadcasts leave ``value_head.*`` out)
nor into a checkpoint's HF model directory, which stays a plain causal LM that transformers and
vLLM load; a checkpoint keeps them in ``value_head.safetensors`` beside it.
"""

from __future__ import annotations

from typing import Any

import torch

VALUE_HEAD = "value_head"  # the submodule's name: its tensors are value_head.weight, value_head.bias
VALUE_HEAD_FILE = "value_head.safetensors"  # in a checkpoint's step directory, beside model/
INIT_SEED = 0  # the head's initial weights, the same on every trainer rank


def attach_value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """Register a fresh ``value_head`` (hidden size -> 1) on ``model``, in its weights' dtype and
    device: weight ~ N(0, ``config.initializer_range``), bias 0 (transformers' init of a token
    classifier's ``score``), drawn from a generator of its own so every rank draws the same."""
    config: Any = model.config
    hidden = int(config.hidden_size)
    ref = next(model.parameters())
    head = torch.nn.Linear(hidden, 1, device=ref.device, dtype=ref.dtype)
    generator = torch.Generator().manual_seed(INIT_SEED)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=generator) * std)
        head.bias.zero_()
    model.add_module(VALUE_HEAD, head)
    return head


def is_value_head_name(name: str) -> bool:
    return name.startswith(VALUE_HEAD + ".")


def without_value_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not is_value_head_name(k)}
