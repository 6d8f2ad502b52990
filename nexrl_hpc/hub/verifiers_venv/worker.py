"""A verifiers environment served to one rollout worker of the run, in verifiers' own venv.

Started by ``nexrl_hpc.hub.verifiers_env.VerifiersEnvProcess`` as ``<venv python> worker.py``; this
directory is first on ``sys.path``, so the harness ``nexrl_chat`` (next to this file) loads by its id.
It loads the environment (``load_environment``, as ``vf eval`` does), keeps ``env.serving()`` open,
and runs episodes concurrently. Each model call goes through verifiers' training client
(``TrainClientConfig``: the conversation rendered to token ids here, the run's engine called at
``/inference/v1/generate``), so the token ids and log-probs of a trace are the engine's own.

Protocol: JSON lines (``../venv_shared/jsonl_protocol.py``: a ``print`` in a taskset goes to the log,
not into the stream). A request is answered by its ``id``; answers come in completion order.

    init     {taskset, harness, model, base_url, api_key_env, tokenizer, renderer, python_path, max_concurrent}
    -> ready {num_tasks, verifiers_version, env_class}
    {"id", "op": "tasks", "start", "count"}                -> {"id", "tasks": [{task_index, prompt, data}]}
    {"id", "op": "episode", "task_index", "sampling"}      -> {"id", "episode": {...}}  (``episode_record``)
    a request that fails                                   -> {"id", "error": "<type>: <message>"}
    the environment cannot load                            -> {"fatal": "<traceback>"}, exit 1
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same module, as the type checker finds it
    from nexrl_hpc.hub.venv_shared.jsonl_protocol import Answers, add_python_path, read_requests, run_worker
else:  # the venv has no nexrl_hpc: the module is imported from its directory
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "venv_shared"))
    from jsonl_protocol import Answers, add_python_path, read_requests, run_worker


def env_config(init: dict[str, Any]) -> dict[str, Any]:
    """verifiers' env config for one agent: the taskset, the harness, a local runtime, and one
    interception server on loopback (no tunnel, no sandbox provider)."""
    return {
        "taskset": dict(init["taskset"]),
        "agent": {"runtime": {"type": "subprocess"}, "harness": dict(init["harness"])},
        "interception": {"type": "server"},
    }


def task_prompt(task: Any) -> str:
    """The task's prompt as text, for the run's logs and its rows (a chat prompt: its last message)."""
    prompt = getattr(task.data, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        last = prompt[-1]
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
        return content if isinstance(content, str) else json.dumps(content, default=str)
    return ""


def episode_record(episode: Any) -> dict[str, Any]:
    """What the run needs of an episode: per branch the token ids, which of them were sampled and
    their log-probs (exact: never rounded), and the trace's reward, its parts, metrics and errors."""
    traces = []
    for trace in episode.traces:
        traces.append(
            {
                "ok": bool(trace.ok),
                "errors": [f"{e.type}: {e.message}" for e in trace.errors],
                "reward": float(trace.reward or 0.0),
                "rewards": {k: float(v.score) for k, v in trace.rewards.items() if v is not None},
                "metrics": {k: float(v) for k, v in (trace.metrics or {}).items() if _is_number(v)},
                "stop_condition": str(trace.stop_condition) if trace.stop_condition else None,
                "finish_reasons": [c.finish_reason for c in trace.calls],
                "branches": [
                    {
                        "trainable": bool(b.trainable),
                        "token_ids": [int(t) for t in b.token_ids],
                        "sampled_mask": [bool(m) for m in b.sampled_mask],
                        "logprobs": [float(x) for x in b.logprobs],
                    }
                    for b in trace.branches
                ],
            }
        )
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    return {"ok": bool(episode.ok), "errors": errors, "traces": traces}


def accept_vllm_token_ids() -> None:
    """renderers 0.1.12 reads each log-prob's token as ``token: "token_id:N"``; vLLM 0.32's generate
    route names it ``token_id: N``. The answer is given the key renderers reads (from the id vLLM
    names) before renderers checks it, so every other check of the answer stays renderers' own."""
    import renderers.client as client

    parse = client.parse_generate_response

    def parse_with_token_names(raw: bytes) -> dict[str, Any]:
        payload = parse(raw)
        for choice in payload.get("choices") or []:
            content = (choice.get("logprobs") or {}).get("content") or []
            for entry in content:
                if (
                    isinstance(entry, dict)
                    and "token" not in entry
                    and isinstance(entry.get("token_id"), int)
                ):
                    entry["token"] = f"token_id:{entry['token_id']}"
        return payload

    client.parse_generate_response = parse_with_token_names


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


async def serve(init: dict[str, Any], answers: Answers) -> None:
    add_python_path(list(init.get("python_path") or []))
    import verifiers
    import verifiers.v1 as vf
    from pydantic import TypeAdapter
    from renderers import RendererConfig
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    accept_vllm_token_ids()
    env = load_environment(resolve_env_config(env_config(init)))
    tasks = list(env.taskset)
    renderer = init.get("renderer")
    client = vf.TrainClientConfig(
        base_url=init["base_url"],
        api_key_var=init["api_key_env"],
        renderer_model_name=init["tokenizer"],
        renderer=None if renderer is None else TypeAdapter(RendererConfig).validate_python(renderer),
    )
    limit = asyncio.Semaphore(int(init.get("max_concurrent") or 64))

    async def episode(request: dict[str, Any]) -> dict[str, Any]:
        index = int(request["task_index"])
        if not 0 <= index < len(tasks):
            raise IndexError(f"task_index {index} is outside the taskset's {len(tasks)} tasks")
        sampling = vf.SamplingConfig(**request.get("sampling", {}))
        ctx = vf.ModelContext(model=init["model"], client=client, sampling=sampling)
        async with limit:
            result = await env.run_episode(tasks[index], ctx)
        return {"episode": episode_record(result)}

    def rows(request: dict[str, Any]) -> dict[str, Any]:
        start = int(request.get("start", 0))
        chosen = tasks[start : start + int(request.get("count", len(tasks)))]
        return {
            "tasks": [
                {"task_index": start + i, "prompt": task_prompt(t), "data": t.data.model_dump(mode="json")}
                for i, t in enumerate(chosen)
            ]
        }

    async def answer(request: dict[str, Any]) -> None:
        try:
            if request.get("op") == "episode":
                result = await episode(request)
            elif request.get("op") == "tasks":
                result = rows(request)
            else:
                raise ValueError(f"unknown op {request.get('op')!r}")
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        answers.send({"id": request.get("id"), **result})

    async with env.serving():
        version = getattr(verifiers, "__version__", "unknown")
        answers.send(
            {
                "ready": {
                    "num_tasks": len(tasks),
                    "verifiers_version": version,
                    "env_class": type(env).__name__,
                }
            }
        )
        await read_requests(answer)


if __name__ == "__main__":
    sys.exit(run_worker(serve))
