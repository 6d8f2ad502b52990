"""The coding task: small stdin/stdout problems, solved as Python programs scored in the sandbox.

A problem is a family and a constant, e.g. ``mul`` with k = 3::

    Read an integer n. Print n*3.        (the prompt)
    print(int(input())*3)                (a solution: one line)

with tests ``{"input": "7\\n", "output": "21\\n"}`` whose outputs are computed here in Python (no
program runs to make them). Validation holds out whole problems: for each family with a constant,
``params.val_per_family`` of its constants appear only in validation. Episodes run with
``nexrl_hpc.agents.coding`` (CodeAgent, CodeEnvironment): the program runs against the tests in
the sandbox (``code_reward_fn``), a failed attempt shows the model which test failed and why,
and it tries again within ``max_turns``.

The tiny char model cannot write Python from nothing, so ``solution_warmup`` fine-tunes the fresh
model on the TRAINING problems' solutions (the response format: one program, then EOS). It then
writes programs, right for some training problems and mostly wrong for held-out ones, so a run
exercises both rewards through the real sandbox; what RL adds on top is measured, not promised.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # ASCII printable + newline


@dataclass(frozen=True)
class Family:
    """A kind of problem: statement and solution templates over the constant ``{k}``."""

    statement: str
    solution: str
    answer: Callable[[str, int], str]  # (one input line, k) -> the expected output line
    inputs: Callable[[random.Random], str]  # a random input line
    takes_k: bool


def _integer(rng: random.Random) -> str:
    return str(rng.randint(-50, 99))


def _integers(rng: random.Random) -> str:
    return " ".join(str(rng.randint(-9, 30)) for _ in range(rng.randint(2, 5)))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))


# a table, one family per row: formatted one argument a line it would take three times the lines
FAMILIES: dict[str, Family] = {
    "add": Family("Read an integer n. Print n+{k}.", "print(int(input())+{k})",
                  lambda s, k: str(int(s) + k), _integer, True),
    "mul": Family("Read an integer n. Print n*{k}.", "print(int(input())*{k})",
                  lambda s, k: str(int(s) * k), _integer, True),
    "mod": Family("Read an integer n. Print n%{k}.", "print(int(input())%{k})",
                  lambda s, k: str(int(s) % k), _integer, True),
    "repeat": Family("Read a word. Print it {k} times.", "print(input()*{k})",
                     lambda s, k: s * k, _word, True),
    "sum": Family("Read integers on one line. Print their sum.", "print(sum(map(int,input().split())))",
                  lambda s, k: str(sum(map(int, s.split()))), _integers, False),
    "max": Family("Read integers on one line. Print the largest.", "print(max(map(int,input().split())))",
                  lambda s, k: str(max(map(int, s.split()))), _integers, False),
    "reverse": Family("Read a word. Print it reversed.", "print(input()[::-1])",
                      lambda s, k: s[::-1], _word, False),
    "upper": Family("Read a word. Print it in upper case.", "print(input().upper())",
                    lambda s, k: s.upper(), _word, False),
    "length": Family("Read a word. Print its length.", "print(len(input()))",
                     lambda s, k: str(len(s)), _word, False),
}  # fmt: skip


def problem_row(family: str, k: int, num_tests: int, rng: random.Random) -> dict[str, Any]:
    """One task row: ``prompt``, ``tests`` (distinct inputs), ``answer`` (a solution), ``family``, ``k``."""
    fam = FAMILIES[family]
    inputs: list[str] = []
    for _ in range(100 * num_tests):  # distinct inputs when the family has that many
        line = fam.inputs(rng)
        if line not in inputs:
            inputs.append(line)
        if len(inputs) == num_tests:
            break
    return {
        "prompt": fam.statement.format(k=k) + "\n",
        "tests": [{"input": line + "\n", "output": fam.answer(line, k) + "\n"} for line in inputs],
        "answer": fam.solution.format(k=k),
        "family": family,
        "k": k,
    }


def split_problems(params: dict[str, Any], seed: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(training problems, held-out problems) as (family, k); families without a constant train only."""
    ks = [int(k) for k in params["ks"]]
    per_family = int(params["val_per_family"])
    if not ks or per_family >= len(ks):
        raise ValueError(f"task.params.ks needs more than val_per_family ({per_family}) constants, got {ks}")
    rng = random.Random(seed)
    train: list[tuple[str, int]] = []
    held_out: list[tuple[str, int]] = []
    for name, fam in FAMILIES.items():
        if not fam.takes_k:
            train.append((name, 0))
            continue
        usable = [k for k in ks if not (name == "mod" and k == 0)]
        rng.shuffle(usable)
        held_out += [(name, k) for k in usable[:per_family]]
        train += [(name, k) for k in usable[per_family:]]
    return train, held_out


def generate_splits(params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "validation": rows}``: training rows draw training problems (fresh test
    inputs each), validation has each held-out problem ``val_repeats`` times (other inputs)."""
    train_problems, held_out = split_problems(params, seed)
    rng = random.Random(seed + 1)
    num_tests = int(params["num_tests"])
    train = [
        problem_row(*rng.choice(train_problems), num_tests, rng) for _ in range(int(params["train_size"]))
    ]
    validation = [
        problem_row(f, k, num_tests, rng) for f, k in held_out for _ in range(int(params["val_repeats"]))
    ]
    return {"train": train, "validation": validation}


def solution_warmup(
    model: Any,
    tokenizer: Any,
    seed: int,
    ks: list[int],
    val_per_family: int,
    split_seed: int,
    steps: int,
    batch_size: int,
    lr: float,
) -> None:
    """Fine-tune the fresh model on the training problems' solutions (problem, program, EOS).

    Why: a randomly initialised model never writes a program that runs, and RL from reward 0
    everywhere has no signal. Only training problems are shown (``split_problems`` with the data's
    seed ``split_seed``): the held-out problems stay held out. Laid out as the rollout's chat
    template lays out the first turn (content only, EOS after the program).
    """
    import torch

    train_problems, _ = split_problems({"ks": ks, "val_per_family": val_per_family}, split_seed)
    vocab = tokenizer.get_vocab()
    examples: list[tuple[list[int], list[int]]] = []
    for family, k in train_problems:
        fam = FAMILIES[family]
        text, program = fam.statement.format(k=k) + "\n", fam.solution.format(k=k)
        missing = sorted(set(text + program) - set(vocab))
        if missing:
            raise ValueError(f"the tokenizer has no token for {missing} (task.alphabet must hold them)")
        examples.append(
            ([vocab[c] for c in text], [vocab[c] for c in program] + [int(tokenizer.eos_token_id)])
        )
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # a tiny model trains as fast on one thread, and one thread does not stall when the machine's
    # cores are shared (two threads stall each other under load)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        model.train()
        for _ in range(steps):
            batch = [rng.choice(examples) for _ in range(batch_size)]
            width = max(len(p) + len(a) for p, a in batch)
            ids = torch.full((batch_size, width), int(tokenizer.pad_token_id))
            mask = torch.zeros((batch_size, width), dtype=torch.long)
            labels = torch.full((batch_size, width), -100)
            for b, (prompt, answer) in enumerate(batch):  # right-padded: positions start at 0
                ids[b, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                mask[b, : len(prompt) + len(answer)] = 1
                labels[b, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
