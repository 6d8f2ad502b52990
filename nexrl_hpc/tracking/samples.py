"""``<run_dir>/samples/step_<N>.jsonl``: what the model said, decoded, for a few rows of each step.

``logger.samples_per_step`` rows of the batch a step trained on (0: none), spread evenly over the
batch (rows of a GRPO group are adjacent, so the picks come from different groups), each with its
prompt and response decoded by the run's tokenizer from the very ids the step trained on (those
``rollouts/step_<N>.h5`` holds), its reward and advantage. The train worker writes the file and
posts the rows to the experiment loggers (TensorBoard text, a wandb table); ``launch.status
--samples`` prints the last step's. Each validation writes ``samples/validation_step_<N>.jsonl``
the same way (the validator: the engine's response text, the reward and the scores; tag
``validation_samples``).

A response is everything after the prompt: in a multi-turn (agent) rollout that includes the tool
and environment turns (``loss_tokens`` counts the model's own tokens, the ones that train). Ids the
tokenizer has no token for (a model's embedding padded past its tokenizer) are left out of the text
and counted in ``undecodable_tokens``: the text is what ``tokenizer.decode`` makes of the ids.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nexrl_hpc.types import Batch

SAMPLES_DIR = "samples"
SAMPLES = "samples"  # the TensorBoard text tag and wandb key of each step's samples
VALIDATION_SAMPLES = "validation_samples"  # ... and of each validation's
VALIDATION = "validation_"  # the file prefix of a validation's samples: samples/validation_step_<N>.jsonl
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_VALIDATION_FILE = re.compile(r"^validation_step_(\d+)\.jsonl$")
_ANY_STEP_FILE = re.compile(r"^(?:validation_)?step_(\d+)\.jsonl$")


def sample_rows(batch_size: int, count: int) -> list[int]:
    """``count`` row indices spread evenly over the batch (all rows when it has fewer)."""
    count = min(count, batch_size)
    return [i * batch_size // count for i in range(count)] if count > 0 else []


def _decodable(ids: list[int], vocab_size: int) -> tuple[list[int], int]:
    """The ids the tokenizer has a token for, and how many it has none for."""
    kept = [i for i in ids if 0 <= i < vocab_size]
    return kept, len(ids) - len(kept)


def decode_samples(batch: Batch, step: int, tokenizer: Any, count: int) -> list[dict[str, Any]]:
    """The step's sample rows (see the module docstring); ``[]`` when ``count`` is 0."""
    values, meta = batch.values, batch.metadata
    input_ids, attention = values["input_ids"], values["attention_mask"]
    responses, mask = values["responses"], values["response_mask"]
    prompt_len = input_ids.shape[1] - responses.shape[1]
    advantages = (values["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    groups = values.get("group_index")
    uids, task_keys = meta.get("uid") or [], meta.get("task_keys") or []
    vocab_size = len(tokenizer)
    rows = []
    for i in sample_rows(int(input_ids.shape[0]), count):
        prompt_ids = input_ids[i, :prompt_len][attention[i, :prompt_len].bool()].tolist()
        response_ids = responses[i][attention[i, prompt_len:].bool()].tolist()
        prompt_ids, prompt_bad = _decodable(prompt_ids, vocab_size)
        kept_response, response_bad = _decodable(response_ids, vocab_size)
        rows.append(
            {
                "step": step,
                "row": i,
                "uid": str(uids[i]) if i < len(uids) else None,
                "task": str(task_keys[i]) if i < len(task_keys) else None,
                "group": int(groups[i]) if isinstance(groups, torch.Tensor) else None,
                "prompt": tokenizer.decode(prompt_ids),
                "response": tokenizer.decode(kept_response),
                "reward": float(values["rewards"][i]),
                "advantage": float(advantages[i]),
                "response_length": len(response_ids),
                "loss_tokens": int(mask[i].sum()),
                "undecodable_tokens": prompt_bad + response_bad,
            }
        )
    return rows


def validation_samples(
    trajectories: Sequence[Mapping[str, Any]], step: int, count: int
) -> list[dict[str, Any]]:
    """A validation's sample rows: ``count`` trajectories spread over them (in ``uid`` order, so a
    rerun picks the same), with the task's prompt as the dataset gave it (chat messages as
    ``role: content`` lines), the response text the engine returned, the reward and scores."""
    ordered = sorted(trajectories, key=lambda t: (str(t.get("uid")), t.get("sample_index", 0)))
    rows = []
    for i in sample_rows(len(ordered), count):
        traj = ordered[i]
        prompt = traj.get("prompt")
        if isinstance(prompt, list):
            prompt = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt if isinstance(m, dict))
        rows.append(
            {
                "step": step,
                "uid": str(traj.get("uid")),
                "prompt": str(prompt),
                "response": str(traj.get("response", "")),
                "reward": float(traj.get("reward", 0.0)),
                "response_length": len(traj.get("response_ids") or []),
                "scores": {
                    k: v for k, v in (traj.get("scores") or {}).items() if isinstance(v, (int, float))
                },
            }
        )
    return rows


def write_samples(run_dir: str, step: int, rows: list[dict[str, Any]], prefix: str = "") -> str:
    """``samples/<prefix>step_<step>.jsonl``, replaced atomically (a redone step overwrites its file)."""
    out_dir = os.path.join(run_dir, SAMPLES_DIR)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{prefix}step_{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)
    return path


def _files(run_dir: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """(step, file name) of the files matching ``pattern``, by step."""
    try:
        names = os.listdir(os.path.join(run_dir, SAMPLES_DIR))
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), n) for n in names if (m := pattern.match(n)))


def last_samples(run_dir: str, validation: bool = False) -> tuple[int, list[dict[str, Any]]] | None:
    """The last step's samples (``validation``: the last validation's), or None when there are none."""
    files = _files(run_dir, _VALIDATION_FILE if validation else _STEP_FILE)
    if not files:
        return None
    step, name = files[-1]
    with open(os.path.join(run_dir, SAMPLES_DIR, name), encoding="utf-8") as f:
        return step, [json.loads(line) for line in f if line.strip()]


def truncate_samples(run_dir: str, keep_through_step: int) -> None:
    """Remove the files (training and validation) of steps after ``keep_through_step`` (a resumed
    run redoes those steps)."""
    for step, name in _files(run_dir, _ANY_STEP_FILE):
        if step > keep_through_step:
            os.remove(os.path.join(run_dir, SAMPLES_DIR, name))


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as TensorBoard's text plugin shows them (markdown: prompt and response verbatim)."""
    parts = []
    for row in rows:
        head = (
            f"**row {row['row']}** uid `{row['uid']}` group {row['group']}"
            if "row" in row
            else f"uid `{row['uid']}`"
        )
        advantage = f"advantage {row['advantage']:.4g}, " if "advantage" in row else ""
        parts.append(
            f"{head}: reward {row['reward']:.4g}, {advantage}{row['response_length']} response tokens\n\n"
            f"prompt:\n\n{_fenced(row['prompt'])}\n\nresponse:\n\n{_fenced(row['response'])}"
        )
    return "\n\n---\n\n".join(parts)


def _fenced(text: str) -> str:
    """A code block that the text itself cannot close (a fence longer than any run of backticks in it)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"
