"""The run's side of a verifiers environment: its worker process, and its episodes as trajectories.

verifiers pins ``openai<3`` and brings ~95 packages, so it lives in a venv of its own
(``scripts/install_verifiers.sh``), as vLLM does. ``VerifiersEnvProcess`` starts
``verifiers_venv/worker.py`` with that venv's python and speaks JSON lines to it over pipes (private to
the two processes: nothing listens on a port). The worker's episodes call the run's engine through
verifiers' own training client, which renders each conversation to token ids and calls the engine's
token-in/token-out route, so a trace's token ids and log-probs are what the engine sampled.

``episode_trajectory`` turns an episode into one training sequence, as the agent worker does: the
first trainable branch (prompt, then every token the model sampled trained, the environment's tokens
masked), the trace's reward. A trace that split into several branches (a turn whose re-rendered
context does not extend the tokens sampled before it) trains its first, exact, branch and counts
``context_mismatch``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from nexrl_hpc.config.schema import RLTrainConfig, VerifiersRolloutConfig
from nexrl_hpc.rewards.runner import ERRORS

logger = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parent / "verifiers_venv" / "worker.py"
API_KEY_ENV = "NEXRL_VERIFIERS_ENGINE_KEY"  # the engine's bearer key, in the worker's environment only
KEY = "rollout_worker.verifiers"
TASK_INDEX = "verifiers_task"  # a row's task: its index in the taskset (data.type=verifiers)


class VerifiersEnvError(RuntimeError):
    """The worker could not load the environment, died, or answered a request with an error."""


class VerifiersEnvProcess:
    """One worker process serving one environment. ``request`` and ``tasks`` may be called from any
    thread, ``aepisode`` from an event loop; answers are matched to requests by id. The worker ends
    when its stdin closes (``close``, or this process's death): it finishes what it was asked and
    exits."""

    def __init__(
        self, cfg: VerifiersRolloutConfig, init: dict[str, Any], log_path: str, api_key: str | None = None
    ) -> None:
        self.python = verifiers_python(cfg["python"])
        self.start_timeout_s = cfg["start_timeout_s"]
        self.init = {**init, "api_key_env": API_KEY_ENV}
        self.log_path = log_path
        self.api_key = api_key
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._dead: str | None = None

    def start(self) -> dict[str, Any]:
        """Start the worker and wait for it to load the environment; its ``ready`` message."""
        timeout_s = self.start_timeout_s
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 (held by the process until close)
        env = {**os.environ, API_KEY_ENV: self.api_key or "unused", "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # the run's packages are not the worker's (python_path adds the user's)
        self._proc = subprocess.Popen(
            [self.python, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(self.init) + "\n")
        self._proc.stdin.flush()
        first: Future[dict[str, Any]] = Future()
        reader = threading.Thread(
            target=self._read, args=(self._proc, first), name="verifiers-env-reader", daemon=True
        )
        reader.start()
        try:
            message = first.result(timeout=timeout_s)
        except TimeoutError:
            self.close()
            raise VerifiersEnvError(
                f"the verifiers worker did not load the environment within {timeout_s:.0f} s "
                f"({KEY}.start_timeout_s); its log: {self.log_path}"
            ) from None
        if "ready" not in message:
            self.close()
            raise VerifiersEnvError(self._failure(message.get("fatal") or str(message)))
        self.ready = message["ready"]
        return self.ready

    def _failure(self, detail: str) -> str:
        last = detail.strip().splitlines()[-1] if detail.strip() else "no message"
        return (
            f"the verifiers environment {self.init['taskset'].get('id')!r} failed in its worker "
            f"({self.python}): {last}\n{detail}\n(log: {self.log_path})"
        )

    def _read(self, proc: subprocess.Popen[str], first: Future[dict[str, Any]]) -> None:
        """Answers from the worker's stdout, each to the future of its request id."""
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("verifiers worker wrote a line that is not JSON: %.200s", line)
                continue
            if not first.done():
                first.set_result(message)
                continue
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = proc.wait()
        self._dead = f"the verifiers worker exited with code {code} (log: {self.log_path})"
        if not first.done():
            first.set_result({"fatal": self._dead})
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(VerifiersEnvError(self._dead))

    def request(self, op: str, **fields: Any) -> Future[dict[str, Any]]:
        """Send one request; a future of its answer (VerifiersEnvError for an error answer)."""
        answer: Future[dict[str, Any]] = Future()
        if self._dead is not None or self._proc is None or self._proc.stdin is None:
            answer.set_exception(VerifiersEnvError(self._dead or "the verifiers worker is not running"))
            return answer
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            raw: Future[dict[str, Any]] = Future()
            self._pending[request_id] = raw
            try:
                self._proc.stdin.write(json.dumps({"id": request_id, "op": op, **fields}) + "\n")
                self._proc.stdin.flush()
            except OSError as exc:  # the worker is gone (its reader reports how it ended)
                self._pending.pop(request_id, None)
                answer.set_exception(VerifiersEnvError(f"the verifiers worker is not reading: {exc}"))
                return answer

        def done(f: Future[dict[str, Any]]) -> None:
            exc = f.exception()
            if exc is not None:
                answer.set_exception(exc)
            elif "error" in f.result():
                answer.set_exception(VerifiersEnvError(f"{op}: {f.result()['error']}"))
            else:
                answer.set_result(f.result())

        raw.add_done_callback(done)
        return answer

    async def aepisode(self, task_index: int, sampling: dict[str, Any]) -> dict[str, Any]:
        """One episode of task ``task_index`` (the worker's ``episode_record``)."""
        answer = await asyncio.wrap_future(self.request("episode", task_index=task_index, sampling=sampling))
        return dict(answer["episode"])

    def tasks(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every task of the taskset: ``task_index``, ``prompt`` (text) and its ``data``."""
        return list(self.request("tasks").result(timeout=timeout_s)["tasks"])

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()  # the worker finishes what it was asked, then exits
                except OSError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


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
    if configured:
        return configured
    venv = os.environ.get("NEXRL_VERIFIERS_VENV") or os.path.expanduser("~/.cache/nexrl_hpc/verifiers-venv")
    return os.path.join(venv, "bin", "python")


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
