"""math_reward_fn: is the model's final answer mathematically equal to the reference? (math-verify)."""

from __future__ import annotations

import threading
from typing import Any

from nexrl_hpc.agents.rewards.types import RewardOutput

# The tail of a long response is where the final answer is; math-verify's parser is slow on long
# inputs and has no timeout outside the main thread (it uses SIGALRM), so inputs are bounded.
MAX_ANSWER_CHARS = 4000


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

    Accepts LaTeX (``\\boxed{1/2}``, ``\\frac12``) and plain expressions; a reference that does not
    parse is an error in the data, reported in metadata with reward 0.
    """
    from math_verify import parse, verify  # heavy (sympy); imported when first used

    reference = _reference(task_info)
    response = str(action if action is not None else "")[-MAX_ANSWER_CHARS:]
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
