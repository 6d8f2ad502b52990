"""What a prompt becomes before it reaches the inference server: raw text, or chat-template token ids.

A prompt is a string or a list of chat messages ``{role, content}``. Messages (and, with
``apply_chat_template``, a string as one user message) go through the tokenizer's chat template
and are sent as token ids, so the ids the policy trains on are exactly
``tokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=True)``. A string
without templating stays raw text, tokenized by the server (TRL's "standard" format). The data
loader measures prompt lengths with the same functions the rollout workers send prompts with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
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


# --- over-long without tokenizing ------------------------------------------------------------------
# A prompt of C characters is at least C / k tokens when no token of the tokenizer covers more than
# k characters and nothing in it drops characters: then a prompt longer than max_prompt_length * k
# characters is over-long without being tokenized (a 1 MB prompt took seconds to tokenize, a
# character count takes microseconds). Which tokenizers keep every character is read from the fast
# tokenizer's own description; for any other the prompt is tokenized as before.
_COMPOSING = {"NFC", "NFKC"}  # up to 4 code points become one (the longest canonical decomposition)
_KEEPING_NORMALIZERS = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}
_KEEPING_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Split",
    "Digits",
    "Punctuation",
    "UnicodeScripts",
    "Sequence",
}


def _parts(node: Mapping[str, Any] | None, key: str) -> list[Mapping[str, Any]]:
    """``node`` and, for a Sequence, its members (``key``: where a Sequence keeps them)."""
    if node is None:
        return []
    return [node] + [part for member in node.get(key) or [] for part in _parts(member, key)]


def _keeps_every_character(spec: Mapping[str, Any]) -> bool:
    normalizers = _parts(spec.get("normalizer"), "normalizers")
    if any(
        n["type"] not in _KEEPING_NORMALIZERS or (n["type"] == "Replace" and not n["content"])
        for n in normalizers
    ):
        return False  # e.g. BERT's (drops control characters, strips accents), SentencePiece's charsmap
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if any(p["type"] not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return False  # e.g. Whitespace: spaces are dropped
    model = spec["model"]
    if model["type"] == "BPE":  # unknown characters fused into one token would cover any number
        return model.get("unk_token") is None or bool(model.get("byte_fallback")) or not model.get("fuse_unk")
    per_character = [{"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False}]
    return model["type"] == "WordLevel" and [dict(p) for p in pre] == per_character  # the char tokenizer


@dataclass(frozen=True)
class CharacterBound:
    """At most ``chars_per_token`` prompt characters per token (``composing``: NFC may join up to 4
    non-ASCII code points into one character first)."""

    chars_per_token: int
    composing: bool

    def min_tokens(self, prompt: str | list[Any]) -> int:
        """A lower bound of the prompt's tokens from its characters alone (a message list: its user
        messages, which no chat template leaves out)."""
        texts = (
            [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m.get("role") == "user"]
        )
        chars = sum(len(t) if not self.composing or t.isascii() else -(-len(t) // 4) for t in texts)
        return chars // self.chars_per_token


def prompt_chars(prompt: str | list[Any]) -> int:
    """Characters of a prompt's text (a message list: every message's content)."""
    return len(prompt) if isinstance(prompt, str) else sum(len(str(m.get("content") or "")) for m in prompt)


def character_bound(tokenizer: Any) -> CharacterBound | None:
    """The tokenizer's bound, or None when it may drop characters (or is not a fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        if not _keeps_every_character(spec):
            return None
        pieces = [*tokenizer.get_vocab(), *(t["content"] for t in spec.get("added_tokens") or [])]
    except (KeyError, TypeError, ValueError):
        return None
    composing = any(n["type"] in _COMPOSING for n in _parts(spec.get("normalizer"), "normalizers"))
    return CharacterBound(max(1, max(map(len, pieces), default=1)), composing)
