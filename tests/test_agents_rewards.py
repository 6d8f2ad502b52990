"""Reward functions: math by math-verify, code by running it in the sandbox, custom ones by import path."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from nexrl_hpc.agents.rewards import (
    RewardOutput,
    code_reward_fn,
    load_reward_fn,
    math_reward_fn,
    zero_reward,
)
from nexrl_hpc.agents.rewards.code import extract_code
from nexrl_hpc.agents.sandbox import SandboxLimits
from nexrl_hpc.config.validate import ConfigError

LIMITS = SandboxLimits(wall_time_s=10.0, cpu_time_s=5, memory_mb=256)  # generous: the machine is shared
SHORT = SandboxLimits(wall_time_s=2.0, cpu_time_s=5, memory_mb=256)


@pytest.mark.parametrize(
    ("answer", "response", "correct"),
    [
        ("1/2", "so the result is \\boxed{0.5}", True),
        ("\\frac{1}{2}", "The answer is $\\frac{2}{4}$", True),
        ("7", "3+4 = 7", True),
        ("7", "\\boxed{8}", False),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
        ("7", "I do not know", False),
    ],
)
def test_math_reward(answer: str, response: str, correct: bool) -> None:
    out = math_reward_fn({"answer": answer}, response)
    assert isinstance(out, RewardOutput)
    assert out.is_correct is correct
    assert out.reward == (1.0 if correct else 0.0)
    assert out.metadata["reference"] == answer


def test_math_reward_reports_what_it_extracted_and_bad_references() -> None:
    out = math_reward_fn({"ground_truth": "42", "answer": "ignored"}, "\\boxed{41}")
    assert out.metadata == {"extracted": "41", "reference": "42"}
    nothing = math_reward_fn({"answer": "42"}, "no idea")
    assert nothing.metadata["extracted"] is None and nothing.reward == 0.0
    with pytest.raises(
        KeyError, match=r"needs task_info\['ground_truth'\] or \['answer'\]; keys: \['question'\]"
    ):
        math_reward_fn({"question": "?"}, "1")


def test_math_reward_works_off_the_main_thread() -> None:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(math_reward_fn({"answer": "3"}, "\\boxed{3}")))
    thread.start()
    thread.join(timeout=60)
    assert [r.is_correct for r in results] == [True]  # no SIGALRM use outside the main thread


STDIN_TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]


def test_code_reward_passes_a_correct_solution() -> None:
    response = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    out = code_reward_fn({"tests": STDIN_TESTS}, response, limits=LIMITS)
    assert (out.reward, out.is_correct) == (1.0, True)
    assert out.metadata == {"passed": 2, "total": 2}


def test_code_reward_names_the_failing_test() -> None:
    response = "```python\na, b = map(int, input().split())\nprint(a * b if a == 10 else a + b)\n```"
    out = code_reward_fn({"tests": STDIN_TESTS}, response, limits=LIMITS)
    assert (out.reward, out.is_correct) == (0.0, False)
    assert out.metadata["failed_test"] == 1 and out.metadata["passed"] == 1
    assert out.metadata["error"] == "wrong output: expected '8', got '-20\\n'"


def test_code_reward_survives_hostile_solutions() -> None:
    loop = code_reward_fn({"tests": STDIN_TESTS}, "while True: pass", limits=SHORT)
    assert loop.reward == 0.0 and loop.metadata["status"] == "timeout"
    bomb = code_reward_fn({"tests": STDIN_TESTS}, "x = bytearray(4 << 30)", limits=LIMITS)
    assert bomb.reward == 0.0 and bomb.metadata["status"] == "memory_limit"
    net = code_reward_fn(
        {"tests": "pass"},
        "import socket\nsocket.create_connection(('151.101.0.223', 443), timeout=2)",
        limits=LIMITS,
    )
    assert net.reward == 0.0 and "Network is unreachable" in net.metadata["error"]


def test_code_reward_with_assert_tests() -> None:
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    good = code_reward_fn({"tests": tests}, "def add(a, b):\n    return a + b\n", limits=LIMITS)
    assert (good.reward, good.is_correct, good.metadata["status"]) == (1.0, True, "ok")
    bad = code_reward_fn({"tests": tests}, "def add(a, b):\n    return a - b\n", limits=LIMITS)
    assert bad.reward == 0.0 and bad.metadata["error"] == "exited with code 1: AssertionError"


def test_code_reward_rejects_bad_tasks_by_name() -> None:
    with pytest.raises(KeyError, match=r"needs task_info\['tests'\]"):
        code_reward_fn({}, "print(1)")
    with pytest.raises(
        ValueError, match=r"task_info\['tests'\]\[0\] must be a dict with 'input' and 'output'"
    ):
        code_reward_fn({"tests": [{"input": "1"}]}, "print(1)", limits=LIMITS)
    assert code_reward_fn({"tests": STDIN_TESTS}, "   ").metadata == {"error": "no code in the response"}


def test_extract_code_takes_the_last_block() -> None:
    assert extract_code("```py\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def reward_with_wrong_signature(task: dict[str, Any]) -> RewardOutput:
    return RewardOutput(0.0)


NOT_CALLABLE = 3


def test_load_reward_fn_by_import_path() -> None:
    loaded = load_reward_fn("nexrl_hpc.agents.rewards:math_reward_fn")
    assert loaded({"answer": "3"}, "\\boxed{3}") == math_reward_fn({"answer": "3"}, "\\boxed{3}")
    assert load_reward_fn("nexrl_hpc.agents.rewards.types:zero_reward")({}, "x") == RewardOutput(
        0.0, {}, None
    )
    assert zero_reward({}, "x") == RewardOutput(0.0, {}, None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:fn", "env.reward_fn: cannot import reward function 'no_such_module_xyz:fn'"),
        (
            "nexrl_hpc.agents.rewards:nope",
            "env.reward_fn: cannot import reward function 'nexrl_hpc.agents.rewards:nope'",
        ),
        ("nexrl_hpc.agents.rewards", "is not of the form 'package.module:name'"),
        (
            "tests.test_agents_rewards:NOT_CALLABLE",
            "env.reward_fn: 'tests.test_agents_rewards:NOT_CALLABLE' is a int",
        ),
        (
            "tests.test_agents_rewards:reward_with_wrong_signature",
            "env.reward_fn: 'tests.test_agents_rewards:reward_with_wrong_signature' has the signature (task: "
            "'dict[str, Any]') -> 'RewardOutput'; a reward function takes",
        ),
    ],
)
def test_load_reward_fn_errors_name_the_key(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_reward_fn(spec, key="env.reward_fn")
    assert message in str(info.value)
