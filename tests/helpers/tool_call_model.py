"""A tiny chat model that calls a tool in Qwen's (Hermes) format, for multi-turn verifiers tests.

A char-level tokenizer with ``<tool_call>`` / ``</tool_call>`` as special tokens (what renderers'
``qwen3`` tool parser looks for), a chat template that renders an assistant turn's tool calls as
``<tool_call>{json}</tool_call>`` and ends it with EOS, and a tool result as ``=VALUE``; the model
is taught by a short supervised warm-up to answer a key ``c`` with the call
``<tool_call>{"name":"lookup","arguments":{"key":"c"}}</tool_call>`` and a result ``=1`` with ``1``.
The template writes the call's JSON itself, compact, not through ``tojson``: the worker's venv
re-renders the call for the next turn, whose prompt must extend the tokens the model sampled, and
there ``AutoTokenizer`` loads this char vocabulary as Qwen2's byte-level tokenizer, which drops
spaces, and another transformers' ``tojson`` spaces differently.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nexrl_hpc.models.tiny import ARCHITECTURES
from nexrl_hpc.models.tokenizer import build_char_tokenizer

TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] -%}"
    '<tool_call>{"name":"{{ c[\'function\'][\'name\'] }}","arguments":{{ "{" }}'
    "{%- for k, v in c['function']['arguments'].items() -%}"
    '{{ "," if not loop.first }}"{{ k }}":"{{ v }}"'
    "{%- endfor -%}"
    "}}</tool_call>"
    "{%- endfor -%}</s>"
    "{%- elif m['role'] == 'tool' -%}={{ m['content'] }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
ALPHABET = 'abcdefghijklmnopqrstuvwxyz0123456789{}":,=?'


def call_text(key: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "lookup", "arguments": {"key": key}}, separators=(",", ":"))
        + "</tool_call>"
    )


def build_tool_call_model(out: Path, table: dict[str, str], steps: int = 150, seed: int = 0) -> Path:
    """Save the warmed-up model and its tokenizer to ``out`` (an HF model directory)."""
    tokenizer = build_char_tokenizer(ALPHABET, TOOL_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    config_cls, model_cls = ARCHITECTURES["qwen2"]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    rows = []
    for key, value in table.items():
        turns = [
            {"role": "user", "content": key},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
                ],
            },
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
        ids = list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"])
        prompt1 = len(tokenizer.apply_chat_template(turns[:1], tokenize=True, return_dict=True)["input_ids"])
        prompt2 = len(tokenizer.apply_chat_template(turns[:3], tokenize=True, return_dict=True)["input_ids"])
        call_end = prompt2 - len(f"={value}")  # the call and its EOS are the model's, the result is not
        labels = [-100] * prompt1 + ids[prompt1:call_end] + [-100] * (prompt2 - call_end) + ids[prompt2:]
        rows.append((ids, labels))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention = (torch.arange(width)[None, :] < torch.tensor([len(i) for i, _ in rows])[:, None]).long()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
