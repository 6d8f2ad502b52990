"""code_reward_fn: run the model's program against the task's tests inside the sandbox."""

from __future__ import annotations

import re
from typing import Any

from nexrl_hpc.agents.rewards.types import RewardOutput
from nexrl_hpc.agents.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response`` (what chat models emit), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _outputs_match(actual: str, expected: str) -> bool:
    """Line by line, ignoring trailing whitespace: the usual judge for stdin/stdout problems."""
    a = [line.rstrip() for line in actual.strip().splitlines()]
    e = [line.rstrip() for line in expected.strip().splitlines()]
    return a == e


def code_reward_fn(
    task_info: dict[str, Any],
    action: Any,
    limits: SandboxLimits | None = None,
    max_tests: int = 32,
) -> RewardOutput:
    """1.0 when the code in ``action`` passes every test of ``task_info["tests"]``, else 0.0.

    ``tests`` is either a list of ``{"input": stdin, "output": expected_stdout}`` (each run in its
    own sandbox) or a string of Python (asserts) run after the solution in one sandbox. The
    metadata names the first failing test and why it failed.
    """
    if "tests" not in task_info:
        raise KeyError(f"code_reward_fn needs task_info['tests']; keys: {sorted(task_info)}")
    tests = task_info["tests"]
    code = extract_code(str(action if action is not None else ""))
    if not code.strip():
        return RewardOutput(0.0, {"error": "no code in the response"}, False)
    if isinstance(tests, str):
        result = run_python(f"{code}\n\n{tests}\n", "", limits)
        passed = result.ok
        metadata: dict[str, Any] = {"passed": int(passed), "total": 1, "status": result.status}
        if not passed:
            metadata["error"] = result.error_message()
        return RewardOutput(1.0 if passed else 0.0, metadata, passed)
    if not isinstance(tests, list) or not tests:
        raise ValueError(
            f"task_info['tests'] must be a non-empty list of {{input, output}} or a string, got {tests!r:.80}"
        )
    for i, test in enumerate(tests[:max_tests]):
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            raise ValueError(
                f"task_info['tests'][{i}] must be a dict with 'input' and 'output', got {test!r:.80}"
            )
        result = run_python(code, str(test["input"]), limits)
        if not result.ok:
            error = result.error_message()
        elif not _outputs_match(result.stdout, str(test["output"])):
            error = f"wrong output: expected {str(test['output'])[:80]!r}, got {result.stdout[:80]!r}"
        else:
            continue
        meta = {
            "passed": i,
            "total": len(tests[:max_tests]),
            "failed_test": i,
            "status": result.status,
            "error": error,
        }
        return RewardOutput(0.0, meta, False)
    return RewardOutput(1.0, {"passed": len(tests[:max_tests]), "total": len(tests[:max_tests])}, True)
