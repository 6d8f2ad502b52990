"""The embedded default task: "m372=" -> "7", the largest of a few digits.

A random model already scores above zero (it emits a digit now and then), so GRPO has signal from
step one. Validation holds out whole digit tuples, stratified by answer so that a model that always
prints one digit cannot score high; training rows are drawn with the answer uniform over 0-9.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from typing import Any


def format_prompt(digits: tuple[int, ...]) -> str:
    return "m" + "".join(str(d) for d in digits) + "="


def generate_splits(params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "validation": rows}``; rows are ``{"prompt", "answer"}``, disjoint by prompt."""
    num_digits = int(params["num_digits"])
    rng = random.Random(seed)
    tuples = list(itertools.product(range(10), repeat=num_digits))
    rng.shuffle(tuples)
    by_answer: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for t in tuples:
        by_answer[max(t)].append(t)
    validation: list[dict[str, Any]] = []
    train_pool: dict[int, list[tuple[int, ...]]] = {}
    for answer in sorted(by_answer):
        group = by_answer[answer]
        n_val = min(int(params["val_per_answer"]), len(group) // 3)
        validation += [{"prompt": format_prompt(t), "answer": str(answer)} for t in group[:n_val]]
        train_pool[answer] = group[n_val:]
    answers = sorted(train_pool)
    train = []
    for _ in range(int(params["train_size"])):
        answer = rng.choice(answers)
        t = rng.choice(train_pool[answer])
        train.append({"prompt": format_prompt(t), "answer": str(answer)})
    return {"train": train, "validation": validation}
