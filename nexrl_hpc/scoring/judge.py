"""An LLM judge: an OpenAI-compatible chat endpoint grades each response with a rubric.

TRL's judges and verl's / NeMo RL's generative reward models are this: the rubric
(``reward_model.judge.prompt_template``, ``str.format`` fields ``{prompt}``, ``{response}``,
``{answer}``) goes to the judge as a user message, its answer is read by ``parse_judge_score``.
Requests run ``concurrency`` at a time through the ``openai`` client with ``request_timeout_s`` and
``max_retries``. A judge's failures never end the run: a request that fails (server gone, refused,
timed out) or an answer without a score makes that sample *skipped* (``reward/skipped``: it trains
nothing) and is counted, ``reward/judge_errors`` or ``reward/judge_parse_errors`` (summed per step);
a warning names the first of each kind every ``WARN_EVERY_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nexrl_hpc.config.reward_model_schema import JudgeConfig
from nexrl_hpc.rewards.loader import SKIPPED
from nexrl_hpc.scoring.judge_parse import JudgeParseError, parse_judge_score

logger = logging.getLogger(__name__)

JUDGE_ERRORS = "reward/judge_errors"
JUDGE_PARSE_ERRORS = "reward/judge_parse_errors"
WARN_EVERY_S = 30.0


def prompt_text(prompt: Any) -> str:
    """A row's prompt as text for the rubric: chat messages as ``role: content`` lines."""
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)
        )
    return str(prompt)


class JudgeScorer:
    """``score_batch(prompts, responses, answers) -> [scores, ...]``, each with both judge counters."""

    def __init__(self, cfg: JudgeConfig, base_url: str, api_key: str | None) -> None:
        import openai

        self._cfg = cfg
        self.base_url = base_url
        self._client = openai.OpenAI(
            base_url=f"{base_url.rstrip('/')}/v1",
            api_key=api_key or "none",
            timeout=cfg["request_timeout_s"],
            max_retries=cfg["max_retries"],
        )
        self._pool = ThreadPoolExecutor(cfg["concurrency"], thread_name_prefix="judge")
        self._warned: dict[str, float] = {}
        self._lock = threading.Lock()
        self.num_errors = 0
        self.num_parse_errors = 0

    def messages(self, prompt: Any, response: str, answer: Any) -> list[dict[str, str]]:
        rubric = self._cfg["prompt_template"].format(
            prompt=prompt_text(prompt), response=response, answer="" if answer is None else answer
        )
        system = self._cfg["system_prompt"]
        return [
            *([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": rubric},
        ]

    def judge_text(self, prompt: Any, response: str, answer: Any) -> str:
        """The judge's answer for one sample (raises the client's errors)."""
        out = self._client.chat.completions.create(
            model=self._cfg["model"],
            messages=self.messages(prompt, response, answer),  # type: ignore[arg-type]
            max_tokens=self._cfg["max_tokens"],
            temperature=self._cfg["temperature"],
        )
        return out.choices[0].message.content or ""

    def score_one(self, prompt: Any, response: str, answer: Any) -> dict[str, float]:
        try:
            text = self.judge_text(prompt, response, answer)
        except Exception as exc:  # the server is gone, refused, timed out: counted, never raised
            return self._failed(JUDGE_ERRORS, f"{type(exc).__name__}: {exc}")
        try:
            score = parse_judge_score(text, self._cfg["score_max"])
        except JudgeParseError as exc:
            return self._failed(JUDGE_PARSE_ERRORS, str(exc))
        return {"reward": score, SKIPPED: 0.0, JUDGE_ERRORS: 0.0, JUDGE_PARSE_ERRORS: 0.0}

    def score_batch(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> list[dict[str, float]]:
        return list(self._pool.map(self.score_one, prompts, responses, answers))

    def _failed(self, kind: str, message: str) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            if kind == JUDGE_ERRORS:
                self.num_errors += 1
            else:
                self.num_parse_errors += 1
            due = now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S
            if due:
                self._warned[kind] = now
        if due:
            logger.warning(
                "judge at %s: %s (sample skipped, counted as %s)", self.base_url, message[:300], kind
            )
        return {
            "reward": 0.0,
            SKIPPED: 1.0,
            JUDGE_ERRORS: float(kind == JUDGE_ERRORS),
            JUDGE_PARSE_ERRORS: float(kind == JUDGE_PARSE_ERRORS),
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
