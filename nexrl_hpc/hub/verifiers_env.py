"""The run's side of a verifiers environment: its worker process, and its episodes as trajectories.

verifiers pins ``openai<3`` and brings ~95 packages, so it lives in a venv of its own
(``scripts/install_verifiers.sh``), as vLLM does. ``VerifiersEnvProcess`` starts
``verifiers_venv/worker.py`` with that venv's python and speaks JSON lines to it over pipes
(``nexrl_hpc.hub.venv_process``: nothing listens on a port). The worker's episodes call the run's
engine through verifiers' own training client, which renders each conversation to token ids and
calls the engine's token-in/token-out route, so a trace's token ids and log-probs are what the
engine sampled.

``episode_trajectory`` turns an episode into one training sequence, as the agent worker does: the
first trainable branch (prompt, then every token the model sampled trained, the environment's tokens
masked), the trace's reward. A trace that split into several branches (a turn whose re-rendered
context does not extend the tokens sampled before it) trains its first, exact, branch and counts
``context_mismatch``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from nexrl_hpc.config.rollout_schema import VerifiersRolloutConfig
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.hub.venv_process import VenvWorkerError, VenvWorkerProcess, venv_python
from nexrl_hpc.rewards.runner import ERRORS

WORKER = Path(__file__).resolve().parent / "verifiers_venv" / "worker.py"
API_KEY_ENV = "NEXRL_VERIFIERS_ENGINE_KEY"  # the engine's bearer key, in the worker's environment only
KEY = "rollout_worker.verifiers"
TASK_INDEX = "verifiers_task"  # a row's task: its index in the taskset (data.type=verifiers)


class VerifiersEnvError(VenvWorkerError):
    """The worker could not load the environment, died, or answered a request with an error."""


class VerifiersEnvProcess(VenvWorkerProcess):
    """One worker process serving one environment; ``aepisode`` from an event loop, ``tasks`` from
    any thread."""

    what = "verifiers"
    key = KEY
    error = VerifiersEnvError

    def __init__(
        self, cfg: VerifiersRolloutConfig, init: dict[str, Any], log_path: str, api_key: str | None = None
    ) -> None:
        super().__init__(
            verifiers_python(cfg["python"]),
            str(WORKER),
            {**init, "api_key_env": API_KEY_ENV},
            log_path,
            cfg["start_timeout_s"],
            env={API_KEY_ENV: api_key or "unused"},
        )

    def environment_name(self) -> str:
        return f"the verifiers environment {self.init['taskset'].get('id')!r}"

    async def aepisode(self, task_index: int, sampling: dict[str, Any]) -> dict[str, Any]:
        """One episode of task ``task_index`` (the worker's ``episode_record``)."""
        answer = await asyncio.wrap_future(self.request("episode", task_index=task_index, sampling=sampling))
        return dict(answer["episode"])

    def tasks(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every task of the taskset: ``task_index``, ``prompt`` (text) and its ``data``."""
        return list(self.request("tasks").result(timeout=timeout_s)["tasks"])


def episode_trajectory(record: dict[str, Any]) -> dict[str, Any] | None:
    """An episode record as trajectory fields (prompt/response ids, loss mask, behaviour log-probs,
    reward, scores), or None when there is nothing to train on (no trace, or the model sampled
    nothing: the caller logs the episode's errors). An episode that failed after the model sampled
    (its rubric raised, a tool server died) counts as a failed reward (``reward/errors``, scored
    by the trace: 0), with its first error as ``reward_error``: a run whose episodes fail stops at
    ``rollout_worker.max_reward_error_frac`` with that error, as one whose reward function fails."""
    if not record.get("traces"):
        return None
    if len(record["traces"]) != 1:
        raise VerifiersEnvError(
            f"the episode has {len(record['traces'])} agents' traces; {KEY} trains single-agent environments"
        )
    (trace,) = record["traces"]
    branches = [b for b in trace["branches"] if b["trainable"] and any(b["sampled_mask"])]
    if not branches:
        return None
    branch = branches[0]
    ids, sampled, logprobs = branch["token_ids"], branch["sampled_mask"], branch["logprobs"]
    if not len(ids) == len(sampled) == len(logprobs):
        raise VerifiersEnvError(
            f"a branch's token ids ({len(ids)}), sampled mask ({len(sampled)}) and log-probs "
            f"({len(logprobs)}) differ in length"
        )
    start = sampled.index(True)
    reward = float(trace["reward"])
    scores = {"reward": reward, "context_mismatch": float(len(branches) > 1)}
    scores.update({f"verifiers/reward/{k}": float(v) for k, v in trace["rewards"].items()})
    scores.update({f"verifiers/metric/{k}": float(v) for k, v in trace["metrics"].items()})
    errors = episode_errors(record)
    scores[ERRORS] = float(bool(errors) or not record.get("ok", False) or not trace["ok"])
    finish = trace["finish_reasons"][-1] if trace["finish_reasons"] else None
    failed = {"reward_error": f"the verifiers episode failed: {errors[0] if errors else 'not ok'}"}
    return {
        **(failed if scores[ERRORS] else {}),
        "prompt_ids": list(ids[:start]),
        "response_ids": list(ids[start:]),
        "loss_mask": [int(m) for m in sampled[start:]],
        "behaviour_log_probs": [float(x) for x in logprobs[start:]],
        "finish_reason": finish,
        "reward": reward,
        "scores": scores,
        "termination_reason": trace["stop_condition"],
    }


def episode_errors(record: dict[str, Any]) -> list[str]:
    """The episode's errors and each trace's."""
    return [*record.get("errors", []), *(e for t in record.get("traces", []) for e in t.get("errors", []))]


def verifiers_python(configured: str | None) -> str:
    """``rollout_worker.verifiers.python``, else where ``scripts/install_verifiers.sh`` puts the
    venv's python (``$NEXRL_VERIFIERS_VENV``, else ``~/.cache/nexrl_hpc/verifiers-venv``)."""
    return venv_python(configured, "NEXRL_VERIFIERS_VENV", "~/.cache/nexrl_hpc/verifiers-venv")


def worker_init(config: RLTrainConfig, base_url: str | None) -> dict[str, Any]:
    """The worker's init message: the environment, and the engine its episodes call (``base_url``:
    the served model's OpenAI root; None for a worker that only lists the tasks)."""
    cfg = config["rollout_worker"]["verifiers"]
    model = config["model"]
    return {
        "taskset": dict(cfg["taskset"]),
        "harness": dict(cfg["harness"]),
        # a null field is left out: renderers' config of another family may not have it
        "renderer": None
        if cfg["renderer"] is None
        else {k: v for k, v in cfg["renderer"].items() if v is not None},
        "python_path": [os.path.abspath(p) for p in cfg["python_path"]],
        "max_concurrent": cfg["max_concurrent"],
        "model": config["service"]["inference_service"]["model"],
        "base_url": f"{base_url.rstrip('/')}/v1" if base_url else "http://127.0.0.1:9/v1",
        # the renderer's tokenizer: the policy's own directory (the tiny model's, saved by the run)
        "tokenizer": model["path"] or os.path.join(os.path.abspath(config["run_dir"]), "base_model"),
    }


def taskset_rows(config: RLTrainConfig, log_path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, validation rows) of ``data.type=verifiers``: one row per task of the taskset,
    in its order, the last ``val_size`` for validation. A row holds the task's index
    (``verifiers_task``), its prompt as text and its ``answer`` when the task has one (for logs and
    the validation file; the environment scores with its own data)."""
    cfg = config["rollout_worker"]["verifiers"]
    env = VerifiersEnvProcess(cfg, worker_init(config, None), log_path)
    try:
        env.start()
        tasks = env.tasks(cfg["start_timeout_s"])
    finally:
        env.close()
    rows = [
        {TASK_INDEX: t["task_index"], "prompt": t["prompt"], "answer": t["data"].get("answer")} for t in tasks
    ]
    val_size = cfg["val_size"]
    if val_size >= len(rows):
        raise VerifiersEnvError(
            f"{KEY}.val_size={val_size} leaves no training task: the taskset has {len(rows)} tasks"
        )
    return rows[: len(rows) - val_size], rows[len(rows) - val_size :]
