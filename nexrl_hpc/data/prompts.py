"""What a prompt becomes before it reaches the inference server: raw text, or chat-template token ids.

A prompt is a string or a list of chat messages ``{role, content}``. Messages (and, with
``apply_chat_template``, a string as one user message) go through the tokenizer's chat template
and are sent as token ids, so the ids the policy trains on are exactly
``tokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=True)``. A string
without templating stays raw text, tokenized by the server (TRL's "standard" format). The data
loader measures prompt lengths with the same functions the rollout workers send prompts with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_messages(prompt: Any) -> bool:
    """A non-empty list of chat messages, each with a string ``role`` and string ``content``."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    )


def needs_chat_template(prompt: Any, apply_chat_template: bool) -> bool:
    return isinstance(prompt, list) or apply_chat_template


def chat_template_problem(tokenizer: Any, model_path: str | None, key_prefix: str = "data") -> str:
    """Why chat prompts cannot be templated with ``tokenizer`` ('' if they can)."""
    if getattr(tokenizer, "chat_template", None):
        return ""
    where = (
        "the tiny char model (model.path null) has no chat template: set model.tiny.tokenizer.chat_template"
        if model_path is None
        else f"the tokenizer of model.path={model_path!r} has no chat template"
    )
    return (
        f"the prompts are chat messages (or {key_prefix}.apply_chat_template is true), "
        f"but {where}; or use string prompts with {key_prefix}.apply_chat_template=false"
    )


def chat_template_ids(tokenizer: Any, prompt: str | list[Any], add_generation_prompt: bool) -> list[int]:
    """``prompt`` (messages, or a string as one user message) through the chat template, as token ids."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def engine_prompt(
    tokenizer: Any, prompt: str | list[Any], apply_chat_template: bool, add_generation_prompt: bool
) -> str | list[int]:
    """What the rollout worker sends: chat-template ids, or the raw string."""
    if needs_chat_template(prompt, apply_chat_template):
        return chat_template_ids(tokenizer, prompt, add_generation_prompt)
    assert isinstance(prompt, str)
    return prompt


def prompt_length(
    tokenizer: Any, prompt: str | list[Any], apply_chat_template: bool, add_generation_prompt: bool
) -> int:
    """Prompt tokens the server will see (a raw string as the server tokenizes it, special tokens included)."""
    sent = engine_prompt(tokenizer, prompt, apply_chat_template, add_generation_prompt)
    return len(sent) if isinstance(sent, list) else len(tokenizer(sent).input_ids)
