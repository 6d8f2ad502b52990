"""math_reward_fn: is the model's final answer mathematically equal to the reference? (math-verify).

GSM8K writes its final answer after ``####`` (``... so she has 72 left. #### 72``); a reference or a
response holding ``####`` is judged by what follows its last ``####``. Everything else (``\\boxed{}``,
``$...$``, plain expressions) goes to math-verify as is.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from nexrl_hpc.rewards.types import RewardOutput

# The tail of a long response is where the final answer is; math-verify's parser is slow on long
# inputs and has no timeout outside the main thread (it uses SIGALRM), so inputs are bounded.
MAX_ANSWER_CHARS = 4000


_GSM8K_MARK = "####"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_LEADING_NUMBER = re.compile(r"\$?\s*(-?\d+(?:\.\d+)?)")


def gsm8k_final_answer(text: str) -> str | None:
    """The answer after the last ``####`` (its leading number when it has one, thousands separators
    dropped; else its first line), or None when ``text`` has no ``####``."""
    if _GSM8K_MARK not in text:
        return None
    tail = text.rsplit(_GSM8K_MARK, 1)[1].strip()
    line = _THOUSANDS.sub("", tail.splitlines()[0].strip()) if tail else ""
    number = _LEADING_NUMBER.match(line)
    return number.group(1) if number else line


def _reference(task_info: dict[str, Any]) -> str:
    for key in ("ground_truth", "answer"):
        if task_info.get(key) is not None:
            return str(task_info[key])
    raise KeyError(f"math_reward_fn needs task_info['ground_truth'] or ['answer']; keys: {sorted(task_info)}")


def math_reward_fn(
    task_info: dict[str, Any],
    action: Any,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
) -> RewardOutput:
    """1.0 when math-verify finds the response's answer equal to ``ground_truth``/``answer``, else 0.0.

    Accepts LaTeX (``\\boxed{1/2}``, ``\\frac12``), plain expressions and GSM8K's ``#### N``; a
    reference that does not parse is an error in the data, reported in metadata with reward 0.
    """
    from math_verify import parse, verify  # heavy (sympy); imported when first used

    reference = _reference(task_info)
    reference = gsm8k_final_answer(reference) or reference
    response = str(action if action is not None else "")[-MAX_ANSWER_CHARS:]
    gsm8k_answer = gsm8k_final_answer(response)
    if gsm8k_answer is not None:  # "#### 72": the number after the mark, read as one expression
        response = f"${gsm8k_answer}$" if gsm8k_answer else ""
    # signal-based timeouts only work in the main thread; elsewhere inputs are bounded instead
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # a bare reference ("1/2", "\\sqrt{2}") is read as one math expression
    ref_text = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
    gold = parse(ref_text, parsing_timeout=timeout)
    if not gold:
        return RewardOutput(
            incorrect_reward, {"error": f"reference answer {reference!r} does not parse"}, False
        )
    pred = parse(response, parsing_timeout=timeout)
    if not pred:
        return RewardOutput(incorrect_reward, {"extracted": None, "reference": reference}, False)
    correct = bool(verify(gold, pred, timeout_seconds=timeout))
    metadata = {"extracted": str(pred[-1]), "reference": reference}
    return RewardOutput(correct_reward if correct else incorrect_reward, metadata, correct)
