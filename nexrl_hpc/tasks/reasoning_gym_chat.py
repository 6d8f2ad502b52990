"""A reasoning-gym task for a small chat model built offline (``task=rg_aiw``).

Two hooks of ``model.tiny`` for ``data.type=reasoning_gym`` with ChatML prompts:

* ``chat_corpus``: the text the byte-level BPE is trained on: the questions and answers the dataset
  generates, so the tokenizer fits the task's words (a name or a number is one or a few tokens).
* ``answer_format_warmup``: a short syntax warm-up (SFT) so RL starts from a model that answers
  in the format (an answer token, then ``<|im_end|>``) but does not know which answer is right.
"""

from __future__ import annotations

import random
from typing import Any

from nexrl_hpc.data.prompts import engine_prompt
from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_rows

ROLES = ("system", "user", "assistant")


def chat_corpus(dataset: str, config: dict[str, Any], size: int, seed: int) -> list[str]:
    """Questions and answers of ``size`` generated rows, plus the chat roles (template words)."""
    rows = reasoning_gym_rows({"dataset": dataset, "config": config, "size": size, "seed": seed})
    return [*ROLES, *(row["prompt"] for row in rows), *(str(row["answer"]) for row in rows)]


def answer_format_warmup(
    model: Any,
    tokenizer: Any,
    seed: int,
    dataset: str,
    config: dict[str, Any],
    size: int,
    steps: int,
    batch_size: int,
    lr: float,
    spread: float,
) -> None:
    """Teach the fresh model the answer SYNTAX on ``size`` generated questions, not the answers.

    Each question goes through the chat template exactly as the rollout sends it (one user message
    and the generation prompt). The answer's first token is trained only to be *some* answer token
    (loss ``-log P(any first token of an answer)``, plus ``spread`` times the members' mean
    log-probability relative to the set, which keeps the choice spread out instead of collapsing
    on one answer: a GRPO group whose samples all agree has no signal); the answer's other tokens
    and ``<|im_end|>`` are trained as they are. So the warmed-up model answers at about chance and
    RL has to learn which answer the question asks for.
    """
    import torch

    rows = reasoning_gym_rows({"dataset": dataset, "config": config, "size": size, "seed": seed})
    examples: list[tuple[list[int], list[int]]] = []  # (prompt ids, answer ids + EOS)
    for row in rows:
        prompt = engine_prompt(tokenizer, str(row["prompt"]), True, True)
        answer = tokenizer.encode(str(row["answer"]), add_special_tokens=False)
        assert isinstance(prompt, list)
        if answer:
            examples.append((prompt, [*answer, tokenizer.eos_token_id]))
    if not examples:
        raise ValueError(f"answer_format_warmup: dataset {dataset!r} gave no rows with an answer")
    first_tokens = torch.tensor(sorted({answer[0] for _, answer in examples}))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [rng.choice(examples) for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), int(tokenizer.pad_token_id))
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (prompt, answer) in enumerate(batch):  # right-padded: positions start at 0
            ids[b, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            mask[b, : len(prompt) + len(answer)] = 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)
        terms = []
        for b, (prompt, answer) in enumerate(batch):
            first = len(prompt) - 1  # the position whose next token is the answer's first
            member = logp[b, first, first_tokens]
            in_set = torch.logsumexp(member, dim=0)
            terms.append(in_set + spread * (member - in_set).mean())
            for k, token in enumerate(answer[1:], start=1):
                terms.append(logp[b, first + k, token])
        loss = -torch.stack(terms).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
