"""The user's model, data and reward, as a new user brings them: the issue's command, end to end.

A tied GQA Qwen2 with a byte-level BPE tokenizer and a ChatML template (the ``chatml_model_dir``
fixture), a verl-schema parquet pair (chat-message prompts, ``reward_model.ground_truth``), and a
file holding a verl-signature ``compute_score``: ``python -m launch.train`` with the local engine
and with vLLM. After every weight sync the engine's log-probs are the trainer's (fp32, CPU); the
prompt ids trained on are the chat-template encodings; the newest checkpoint is the user's tied
Qwen2 with its chat template.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import run_train

pytestmark = pytest.mark.e2e

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1 when the answer starts the response."""
    assert data_source == "openai/gsm8k" and extra_info["split"] in ("train", "test")
    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0
'''


def verl_rows(start: int, n: int, split: str) -> list[dict[str, Any]]:
    """Rows as verl's GSM8K preprocessing writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"what is {i} + {i % 7}? Answer with the number."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + i % 7)},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(start, start + n)
    ]


def issue_command(model: str, train: str, val: str, reward: str, run_dir: Path) -> list[str]:
    return [
        f"model.path={model}",
        "data.type=parquet",
        f"data.data_files=[{train}]",
        f"validate.data.data_files=[{val}]",
        "data.answer_key=reward_model.ground_truth",
        f"rollout_worker.reward_fn={reward}:compute_score",
        "rollout_worker.max_prompt_length=96",
        "rollout_worker.max_response_length=8",
        "data.batch_size=8",
        "data.rollout_repeat_n=4",
        "train_worker.total_train_steps=6",
        "logger.dump_rollouts=true",
        f"run_dir={run_dir}",
        "seed=7",
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("user_inputs")
    train_rows, val_rows = verl_rows(0, 40, "train"), verl_rows(100, 12, "test")
    pq.write_table(pa.Table.from_pylist(train_rows), d / "T.parquet")
    pq.write_table(pa.Table.from_pylist(val_rows), d / "V.parquet")
    (d / "R.py").write_text(textwrap.dedent(REWARD_FILE))
    return {
        "dir": d,
        "train": str(d / "T.parquet"),
        "val": str(d / "V.parquet"),
        "reward": "R.py",
        "rows": train_rows,
    }


@pytest.mark.parametrize("backend", ["local", "vllm"])
def test_the_issue_command_trains_the_users_tied_chat_model(
    backend: str, chatml_model_dir: str, inputs: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = tmp_path / "D"
    args = issue_command(chatml_model_dir, inputs["train"], inputs["val"], inputs["reward"], run_dir)
    # the reward file is named relative to the directory the command runs in, as a user types it
    proc = run_train(
        [*args, f"service.inference_service.backend={backend}", "logger.backend=[]"],
        cwd=inputs["dir"],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    mismatch = [r["train/logprob_mismatch_max"] for r in steps]
    assert max(mismatch) <= 1e-4, mismatch  # served == trained, after every one of the 5 syncs
    assert all(r["train/staleness_max"] == 0 for r in steps)  # each step's samples: the newest weights
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in steps)
    assert "val/reward" in metrics[-1]
    # your model and data, no task named: the run had task=custom's LLM-sized defaults
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["task"]["name"] == "custom" and resolved["experiment_name"] == "custom_grpo"
    assert resolved["service"]["train_service"]["actor"]["optim"]["lr"] == 1e-6
    assert resolved["service"]["train_service"]["actor"]["ppo_max_token_len_per_gpu"] == 16384

    tok = AutoTokenizer.from_pretrained(chatml_model_dir)
    encodings = {
        tuple(
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for r in inputs["rows"]
    }
    for step in range(1, 7):
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            input_ids, mask, responses = f["input_ids"][()], f["attention_mask"][()], f["responses"][()]
        width = input_ids.shape[1] - responses.shape[1]
        assert np.array_equal(input_ids[:, width:], responses)
        for ids, m in zip(input_ids[:, :width], mask[:, :width]):
            assert tuple(int(i) for i in ids[m.astype(bool)]) in encodings

    newest = max((run_dir / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))
    model = AutoModelForCausalLM.from_pretrained(str(newest / "model"))
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert AutoTokenizer.from_pretrained(str(newest / "model")).chat_template == tok.chat_template


@pytest.mark.parametrize(
    "bad,key",
    [
        ("model.path=/nonexistent/model", "model.path"),
        ("data.data_files=[/nonexistent/train.parquet]", "data.data_files[0]"),
    ],
)
def test_the_issue_command_with_a_missing_input_exits_2_naming_the_key(
    bad: str, key: str, chatml_model_dir: str, inputs: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = tmp_path / "D"
    args = issue_command(chatml_model_dir, inputs["train"], inputs["val"], inputs["reward"], run_dir)
    args = [a for a in args if a.split("=")[0] != bad.split("=")[0]] + [bad]
    t0 = time.monotonic()
    proc = run_train(args, cwd=inputs["dir"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert key in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60
    assert not run_dir.exists()  # nothing started


def test_long_variable_length_responses_train_and_are_counted(
    chatml_model_dir: str, inputs: dict[str, Any], tmp_path: Path
) -> None:
    """The untrained model rarely samples an end token: responses of a few to 384 tokens, the longest
    cut off. They train (the engine's log-probs still the trainer's over hundreds of positions), and
    the cut-off share and the lengths are logged."""
    run_dir = tmp_path / "D"
    args = issue_command(chatml_model_dir, inputs["train"], inputs["val"], inputs["reward"], run_dir)
    args = [a for a in args if not a.startswith(("rollout_worker.max_response_length", "train_worker.total"))]
    proc = run_train(
        [
            *args,
            "rollout_worker.max_response_length=384",
            "train_worker.total_train_steps=2",
            "validate.eval.validate_freq=0",
            "logger.backend=[]",
        ],
        cwd=inputs["dir"],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "train/reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["train/response_length_max"] == 384 and 0.0 < r["train/response_clip_ratio"] < 1.0, r
        assert r["train/response_length_mean"] < 384 and r["actor/entropy"] > 0.0
        assert r["train/logprob_mismatch_max"] <= 1e-4
