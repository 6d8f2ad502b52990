"""TRL's and verl's reward functions, unchanged, in whole runs: ``python -m launch.train`` and
``nexrl_hpc.train`` with the user's tied Qwen2 (ChatML) on conversational and plain-text rows; a
reward that raises every time stops the run with exit 1 and its traceback on the console."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_train

pytestmark = pytest.mark.e2e

HELPERS = "tests.helpers.user_rewards"
SMALL = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
    "rollout_worker.max_prompt_length=96",
    "rollout_worker.max_response_length=8",
    "data.batch_size=4",
    "data.rollout_repeat_n=4",
    "train_worker.total_train_steps=2",
    "seed=5",
]


def chat_rows(n: int, unparseable_every: int = 0) -> list[dict[str, Any]]:
    """TRL's conversational form: ``prompt`` as chat messages, a ``solution`` column (every
    ``unparseable_every``-th one empty: accuracy_reward returns None for it)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"what is {i} + {i % 5}?"}],
            "solution": "" if unparseable_every and i % unparseable_every == 0 else f"${i + i % 5}$",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/reward_mean" in r]


def test_trls_reward_functions_train_through_the_cli_with_weights(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(32))
    run_dir = tmp_path / "cli"
    functions = [
        "trl.rewards:accuracy_reward",
        "trl.rewards:think_format_reward",
        f"{HELPERS}:reward_num_unique_letters",
    ]
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"model.path={chatml_model_dir}",
            "data.type=jsonl",
            f"data.data_files=[{data}]",
            f"validate.data.data_files=[{data}]",
            "data.answer_key=solution",
            f"rollout_worker.reward_fn=[{','.join(functions)}]",
            "rollout_worker.reward_weights=[1.0,0.5,0.25]",
            *SMALL,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["reward/errors"], r["reward/timeouts"], r["reward/skipped"]) == (0, 0, 0)
        per_function = [r[f"train/rewards/{name}"] for name in ("accuracy_reward", "think_format_reward")]
        letters = r["train/rewards/reward_num_unique_letters"]
        assert letters > 0  # chat-form completions: [{"role": "assistant", "content": ...}]
        expected = per_function[0] + 0.5 * per_function[1] + 0.25 * letters
        assert r["train/reward_mean"] == pytest.approx(expected, rel=1e-5)


API_SCRIPT = """
import json, sys
import nexrl_hpc
from trl.rewards import accuracy_reward
from tests.helpers.user_rewards import compute_score, reward_len, always_raises

rows = json.loads(open(sys.argv[2]).read())
choice = sys.argv[3]
from trl.rewards import think_format_reward

reward = {
    "trl": [accuracy_reward, think_format_reward],
    "plain": [reward_len, compute_score],
    "raises": always_raises,
}[choice]
overrides = ["model.path=" + sys.argv[1], *json.loads(sys.argv[5])]
if choice == "plain":
    overrides.append("rollout_worker.reward_weights=[0.1,1.0]")
result = nexrl_hpc.train(
    overrides, train_dataset=rows, val_dataset=rows[:4], reward_fn=reward, run_dir=sys.argv[6]
)
print(json.dumps({"exit_code": result.exit_code}))
"""


def run_api(
    choice: str, rows: list[dict[str, Any]], overrides: list[str], model: str, tmp_path: Path
) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "my_run.py"
    script.write_text(textwrap.dedent(API_SCRIPT))
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    run_dir = tmp_path / f"api_{choice}"
    args = [
        str(script),
        model,
        str(tmp_path / "rows.json"),
        choice,
        str(REPO),
        json.dumps(overrides),
        str(run_dir),
    ]
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return proc, run_dir


def test_trls_rewards_through_the_api(chatml_model_dir: str, tmp_path: Path) -> None:
    rows = chat_rows(32, unparseable_every=2)
    proc, run_dir = run_api("trl", rows, ["data.answer_key=solution", *SMALL], chatml_model_dir, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"exit_code": 0}
    steps = train_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert (r["reward/errors"], r["reward/skipped"]) == (0, 0)  # think_format_reward scores every one
        assert 0.0 <= r["train/rewards/accuracy_reward"] <= 1.0  # over the rows with a gold answer
        assert 0.0 <= r["train/rewards/think_format_reward"] <= 1.0


def test_accuracy_reward_skips_samples_without_a_gold_answer(chatml_model_dir: str, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(32, unparseable_every=2))
    run_dir = tmp_path / "skips"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"model.path={chatml_model_dir}",
            "data.type=jsonl",
            f"data.data_files=[{data}]",
            f"validate.data.data_files=[{data}]",
            "data.answer_key=solution",
            "rollout_worker.reward_fn=trl.rewards:accuracy_reward",
            *SMALL,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = train_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["reward/skipped"] for r in steps) > 0  # TRL's None: counted, trained on by nobody
    assert all(r["reward/errors"] == 0 for r in steps)


def test_trls_docs_reward_and_verls_gsm8k_scorer_through_the_api_on_plain_text(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    rows = [{"prompt": f"{i} + {i % 3} =", "answer": str(i + i % 3)} for i in range(32)]  # string prompts
    proc, run_dir = run_api("plain", rows, SMALL, chatml_model_dir, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = train_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/errors"] == 0
        length, gsm8k = r["train/rewards/reward_len"], r["train/rewards/compute_score"]
        assert length < 0  # -|20 - len(text)|: plain-text completions of at most 8 tokens
        assert r["train/reward_mean"] == pytest.approx(0.1 * length + gsm8k, rel=1e-5)


def test_a_reward_that_always_raises_stops_the_run_with_its_traceback(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(16))
    run_dir = tmp_path / "cli_raises"
    common = [
        f"model.path={chatml_model_dir}",
        "data.type=jsonl",
        f"data.data_files=[{data}]",
        f"validate.data.data_files=[{data}]",
        "data.answer_key=solution",
        *SMALL,
    ]
    proc = run_train([f"run_dir={run_dir}", f"rollout_worker.reward_fn={HELPERS}:always_raises", *common])
    assert proc.returncode == 1, proc.stderr[-3000:]
    for text in (proc.stderr, json.loads((run_dir / "status.json").read_text())["reason"]):
        assert "rollout_worker.max_reward_error_frac=0.5" in text
        assert f"{HELPERS}:always_raises: Traceback (most recent call last)" in text
        assert "ConnectionError: the judge at http://judge.invalid is down" in text
    assert not (run_dir / "metrics.jsonl").exists() or train_rows(run_dir) == []  # no step trained

    api, api_dir = run_api(
        "raises", chat_rows(16), ["data.answer_key=solution", *SMALL], chatml_model_dir, tmp_path
    )
    assert api.returncode == 0 and json.loads(api.stdout.strip().splitlines()[-1]) == {"exit_code": 1}
    assert "ConnectionError: the judge at http://judge.invalid is down" in api.stderr  # on the console
    assert "Traceback (most recent call last)" in api.stderr
    assert json.loads((api_dir / "status.json").read_text())["state"] == "failed"
