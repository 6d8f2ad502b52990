"""Model rewards' models, built offline: a tiny sequence classifier and a tiny judge that grades.

Both use the project's byte-level BPE with ChatML (``nexrl_hpc.models.chatml``). The judge is a
Qwen2 causal LM trained here, a few hundred Adam steps on the rubric the tests use, to answer every
rubric with ``JUDGE_ANSWER`` (greedy decoding repeats it exactly); its untrained twin answers
garbage, which the parser must count, not crash on.
"""

from __future__ import annotations

import random

import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from nexrl_hpc.models.chatml import IM_END, build_qwen2_model, save_model_dir, train_chatml_tokenizer

RUBRIC = "Grade the answer to {prompt} from 0 to 10. Answer: {response}. Reply as Score: N/10."
JUDGE_ANSWER = "Score: 7/10"


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs shaped like the default task's (max_digit: ``m=372=`` -> ``7``)."""
    rng = random.Random(seed)
    digits = "0123456789"
    return [
        (
            "m=" + "".join(rng.choice(digits) for _ in range(3)) + "=",
            "".join(rng.choice(digits + "m=") for _ in range(2)),
        )
        for _ in range(n)
    ]


def _corpus() -> list[str]:
    texts = [RUBRIC.format(prompt=p, response=r) + " " + JUDGE_ANSWER for p, r in _pairs(400, 0)]
    return (
        texts
        + [f"{p}{r}" for p, r in _pairs(400, 1)]
        + ["Score: 0/10 1/10 2/10 3/10 4/10 5/10 6/10 8/10 9/10"]
    )


def build_classifier_dir(out_dir: str, seed: int = 0) -> str:
    """A random-init Qwen2ForSequenceClassification (one label) with its ChatML BPE tokenizer."""
    tokenizer = train_chatml_tokenizer(_corpus(), 400)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config).float()
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores spread well apart
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_judge_dir(out_dir: str, train_steps: int = 100, seed: int = 0) -> str:
    """A tiny chat model that answers the tests' rubric with ``JUDGE_ANSWER`` (``train_steps=0``: untrained)."""
    tokenizer = train_chatml_tokenizer(_corpus(), 400)
    model = build_qwen2_model(
        tokenizer,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        seed=seed,
    )
    answer = tokenizer(JUDGE_ANSWER, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids(IM_END)
    ]
    rows = []
    for p, r in _pairs(256, seed + 2):
        messages = [{"role": "user", "content": RUBRIC.format(prompt=p, response=r)}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt_ids, list):  # a BatchEncoding in newer transformers
            prompt_ids = list(prompt_ids["input_ids"])
        rows.append((list(prompt_ids), answer))
    pad_id = int(tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = random.Random(seed)
    model.train()
    for _ in range(train_steps):
        batch = rng.sample(rows, 16)
        width = max(len(p) + len(a) for p, a in batch)
        pads = [width - len(p) - len(a) for p, a in batch]  # right-padded, masked out
        ids = torch.tensor([p + a + [pad_id] * n for (p, a), n in zip(batch, pads)])
        labels = torch.tensor([[-100] * len(p) + a + [-100] * n for (p, a), n in zip(batch, pads)])
        mask = torch.tensor([[1] * (len(p) + len(a)) + [0] * n for (p, a), n in zip(batch, pads)])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return save_model_dir(model, tokenizer, out_dir)
