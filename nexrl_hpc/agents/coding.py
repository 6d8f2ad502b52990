"""Multi-turn coding: CodeAgent writes a program, CodeEnvironment runs it against the task's tests.

Each turn's response is scored by the environment's reward function, by default the sandboxed
code reward (``nexrl_hpc.agents.rewards.code:code_reward_fn``: the program, or the last fenced
block of the response, runs in the sandbox on every test). Passing every test ends the episode
with reward 1; otherwise the model is shown what failed (which test, the error or the expected
and actual output) and writes the program again, up to ``max_turns`` attempts. A task holds the
problem (``prompt``/``question``/``problem``) and ``tests`` as ``code_reward_fn`` reads them.
"""

from __future__ import annotations

from typing import Any

from nexrl_hpc.agents.agent import BaseAgent, question_text
from nexrl_hpc.agents.environments import BaseEnv, _reward_fn, _score
from nexrl_hpc.agents.rewards.types import RewardFunction
from nexrl_hpc.agents.types import ModelOutput


def failure_feedback(metadata: dict[str, Any], max_chars: int | None = None) -> str:
    """One line saying why a program failed, from the code reward's metadata (cut at ``max_chars``)."""
    line = _feedback(metadata).replace("\n", " ")
    return line if max_chars is None or len(line) <= max_chars else line[: max_chars - 3] + "..."


def _feedback(metadata: dict[str, Any]) -> str:
    error = metadata.get("error")
    if "failed_test" in metadata and "total" in metadata:
        return f"test {int(metadata['failed_test']) + 1} of {metadata['total']} failed: {error}"
    if error:
        return str(error)
    if metadata.get("reward/errors") or metadata.get("reward/timeouts"):
        return "the tests could not be run"
    return "the program failed the tests"


class CodeEnvironment(BaseEnv):
    """Up to ``max_turns`` attempts at one problem; reward 1 (and the end) when every test passes.

    ``reward_fn`` is any form of the one reward API (``rollout_worker.reward_fn`` by default: the
    config's reward runs guarded, a call that raises or times out scores 0 and is counted). The
    observation after a failed attempt is ``{"feedback": line, "attempt": k}`` (the line cut at
    ``max_feedback_chars``: an error can quote a whole garbled program); ``info`` carries
    ``is_correct`` and the reward's metadata (tests passed, the failing test, its error).
    """

    def __init__(
        self,
        task: dict[str, Any] | None = None,
        reward_fn: RewardFunction | str | None = None,
        max_turns: int = 1,
        max_feedback_chars: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if reward_fn is None:
            raise ValueError(
                "CodeEnvironment needs a reward_fn (e.g. nexrl_hpc.agents.rewards.code:code_reward_fn)"
            )
        self.reward_fn = _reward_fn(reward_fn, "env_args.reward_fn")
        self.task = task
        self.max_turns = max_turns
        if max_feedback_chars is not None and max_feedback_chars < 4:
            raise ValueError(f"max_feedback_chars must be >= 4 or None, got {max_feedback_chars}")
        self.max_feedback_chars = max_feedback_chars
        self.attempts = 0
        self.done = False

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if task is not None:
            self.task = task
        if self.task is None:
            raise ValueError("CodeEnvironment.reset needs a task (none given, none at construction)")
        if "tests" not in self.task:
            raise KeyError(f"a coding task needs 'tests'; its keys: {sorted(self.task)}")
        self.attempts = 0
        self.done = False
        return self.task, {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("CodeEnvironment.step called after the episode ended; call reset")
        self.attempts += 1
        reward, info = _score(self.reward_fn, self.task, "" if action is None else str(action))
        info["attempt"] = self.attempts
        self.done = bool(info["is_correct"]) or self.attempts >= self.max_turns
        if self.done:
            return {}, reward, True, info
        return (
            {
                "feedback": failure_feedback(info["reward_metadata"], self.max_feedback_chars),
                "attempt": self.attempts,
            },
            reward,
            False,
            info,
        )

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # state is per instance; each program runs in its own sandbox process

    @classmethod
    def from_dict(cls, env_args: dict[str, Any]) -> CodeEnvironment:
        """``reward_fn``, ``max_turns`` and ``max_feedback_chars`` are the environment's; every other key is the task."""
        args = dict(env_args)
        known = {"reward_fn", "max_turns", "max_feedback_chars"}
        task = {k: v for k, v in args.items() if k not in known}
        return cls(task=task or None, **{k: v for k, v in args.items() if k in known})


class CodeAgent(BaseAgent):
    """Shows the problem, then each failed attempt's feedback; the action is the response text.

    ``instruction`` follows the problem (e.g. "Answer with a Python program in a ```python block.");
    ``feedback_prefix`` / ``feedback_suffix`` wrap the feedback line (e.g. "Fix the program."). The
    tiny char model plays with all three empty. The whole history stays in the chat, so the model
    sees its earlier attempts and why they failed.
    """

    def __init__(
        self,
        system_prompt: str | None = None,
        instruction: str = "",
        feedback_prefix: str = "",
        feedback_suffix: str = "",
    ) -> None:
        self.instruction = instruction
        self.feedback_prefix = feedback_prefix
        self.feedback_suffix = feedback_suffix
        super().__init__(system_prompt)

    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        if first:
            return [{"role": "user", "content": question_text(observation) + self.instruction}]
        if isinstance(observation, dict) and "feedback" in observation:
            content = f"{self.feedback_prefix}{observation['feedback']}\n{self.feedback_suffix}"
            return [{"role": "user", "content": content}]
        if observation is None or observation == {} or observation == "":
            return []
        return [{"role": "user", "content": str(observation)}]

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        if output is not None and output.reasoning:
            return output.content, output.reasoning
        return text, ""
