"""code_reward_fn: run the model's program against the task's tests inside the sandbox.

Assert-style tests (a string of Python) need the solution's definitions, so they run in the process
the solution ran in; that process cannot vouch for itself (the solution could ``sys.exit(0)`` or
``os._exit(0)`` before the tests, and an exit status of 0 would read as a pass). The verdict
comes from a supervisor of its own instead, a process the solution never ran in: it starts the
tests' process, waits until the solution's code has run to its end, only then hands it a fresh
nonce, and passes the solution only when the tests' process sends that nonce back after the last
test. The supervisor is not dumpable, so the tests' process cannot read its memory or its stdout
(where the verdict goes). A solution that deliberately speaks this protocol itself (it can read the
runner's source) could still forge a pass: that takes targeting the harness, not exiting early.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nexrl_hpc.agents.rewards import assert_harness
from nexrl_hpc.agents.rewards.types import RewardOutput
from nexrl_hpc.agents.sandbox import SandboxLimits, run_python

# The verdict: the only thing on the supervisor's stdout (the tests' process writes to its stderr).
_PASS = "PASS"
_SUPERVISOR = r"""
import ctypes, os, secrets, subprocess, sys
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: /proc/<this pid>/{mem,fd} closed to the tests' process
nonce = secrets.token_hex(16).encode()
down_r, down_w = os.pipe()
up_r, up_w = os.pipe()
proc = subprocess.Popen(
    [sys.executable, "-I", "-B", "runner.py", str(down_r), str(up_w)],
    pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, stdout=2, stderr=2,
)
os.close(down_r)
os.close(up_w)
def read(n):
    data = b""
    while len(data) < n:
        part = os.read(up_r, n - len(data))
        if not part:
            break
        data += part
    return data
passed = False
if read(1) == b"L":  # the solution's code has run to its end
    os.write(down_w, nonce)
    passed = read(1 + len(nonce)) == b"P" + nonce
code = proc.wait()
if passed and code == 0:
    print("PASS")
    sys.exit(0)
if code == 0:
    print("the tests did not run to their end (the solution's process exited early)", file=sys.stderr)
sys.exit(1)
"""
# The tests' process: the harness runs in a namespace of its own, with builtins copied before the
# solution's code runs (assert_harness: why).
_RUNNER = r"""
import builtins, sys
harness = {"__builtins__": dict(builtins.__dict__), "__name__": "assert_harness"}
exec(compile(open("assert_harness.py").read(), "assert_harness.py", "exec"), harness)
harness["main"](int(sys.argv[1]), int(sys.argv[2]))
"""
_HARNESS = Path(assert_harness.__file__).read_text()

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
    own sandbox) or a string of Python (asserts) run after the solution in one sandbox, judged by a
    supervisor process of its own (the module docstring: why). The metadata names the first failing
    test and why it failed.
    """
    if "tests" not in task_info:
        raise KeyError(f"code_reward_fn needs task_info['tests']; keys: {sorted(task_info)}")
    tests = task_info["tests"]
    code = extract_code(str(action if action is not None else ""))
    if not code.strip():
        return RewardOutput(0.0, {"error": "no code in the response"}, False)
    if isinstance(tests, str):
        files = {"solution.py": code, "tests.py": tests, "runner.py": _RUNNER, "assert_harness.py": _HARNESS}
        result = run_python(_SUPERVISOR, "", limits, files=files)
        passed = result.ok and result.stdout == f"{_PASS}\n"
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
