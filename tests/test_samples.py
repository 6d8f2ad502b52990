"""What the model said: each step's decoded samples in ``samples/step_<N>.jsonl``, TensorBoard's text
tab, a wandb table and ``launch.status --samples``.

A hand-built batch for the edges (left padding, a multi-turn loss mask, an id the tokenizer has no
token for); a short local run checks the files against the step's rollout dump, decoded apart.
tests/test_mpi.py checks the same on an mpi-mode agent run (``assert_samples_match_dumps``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

from launch import status as status_cli
from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.models.run_tokenizer import build_tiny_tokenizer
from nexrl_hpc.rewards.match import prefix_match
from nexrl_hpc.tracking.experiment import ExperimentLogger
from nexrl_hpc.tracking.samples import (
    SAMPLES,
    VALIDATION,
    VALIDATION_SAMPLES,
    decode_samples,
    last_samples,
    sample_rows,
    samples_markdown,
    validation_samples,
    write_samples,
)
from nexrl_hpc.types import Batch
from tests.conftest import compose_config, run_train

FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


def read_rows(run_dir: Path, step: int) -> list[dict[str, Any]]:
    text = (run_dir / "samples" / f"step_{step}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def assert_samples_match_dumps(
    run_dir: Path, steps: list[int], per_step: int, model_dir: str | None = None
) -> None:
    """Every step's samples are rows of its dump (rollouts/step_N.h5, logger.dump_rollouts=true),
    their text ``tokenizer.decode`` of the dumped ids (the run's tokenizer, loaded apart: its
    ``model_dir``, by default the built model's ``base_model/``), their reward and advantage the dump's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir or str(run_dir / "base_model"))
    for step in steps:
        rows = read_rows(run_dir, step)
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            n = f["input_ids"].shape[0]
            assert [r["row"] for r in rows] == sample_rows(n, per_step) and len(rows) == min(n, per_step)
            width = f["input_ids"].shape[1] - f["responses"].shape[1]
            uids = [u.decode() if isinstance(u, bytes) else str(u) for u in f["uid"][:]]
            for row in rows:
                i = row["row"]
                attention = f["attention_mask"][i]
                prompt = [int(t) for t, a in zip(f["input_ids"][i][:width], attention[:width]) if a]
                response = [int(t) for t, a in zip(f["responses"][i], attention[width:]) if a]
                assert row["prompt"] == tokenizer.decode(prompt), (step, i)
                assert row["response"] == tokenizer.decode(response), (step, i)
                assert row["reward"] == pytest.approx(float(f["rewards"][i]), abs=1e-6)
                assert row["advantage"] == pytest.approx(float(f["advantages"][i]), abs=1e-6)
                assert (row["step"], row["uid"]) == (step, uids[i])
                assert row["response_length"] == len(response)
                assert row["loss_tokens"] == int(f["response_mask"][i].sum())


# --- the rows ---------------------------------------------------------------------------------------
def test_the_picked_rows_spread_over_the_batch() -> None:
    assert sample_rows(256, 4) == [0, 64, 128, 192]  # one per group of 64 adjacent rows
    assert sample_rows(3, 4) == [0, 1, 2] and sample_rows(8, 0) == []


def test_decoding_a_padded_multi_turn_batch_with_an_id_without_a_token() -> None:
    """Left-padded prompts, a response with environment tokens (loss mask 0) and an id past the
    tokenizer (a padded embedding): the text is what ``tokenizer.decode`` makes of the ids, the id
    counted, the advantage the mean over the model's tokens."""
    tokenizer = build_tiny_tokenizer(compose_config([])["model"]["tiny"]["tokenizer"])
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    short_prompt, long_prompt = ids(list("m7=")), ids(list("m123="))
    model_env_model = ids(list("12")) + ids(list("=9")) + [vocab + 3] + ids(list("4"))
    batch = Batch(
        values={
            "prompt_ids": [short_prompt, long_prompt],
            "response_ids": [ids(list("5")), model_env_model],
            "behaviour_log_probs": [[0.0], [0.0] * 6],
            "loss_mask": [[1], [1, 1, 0, 0, 1, 1]],
        },
        metadata={},
    )
    tensors: dict[str, Any] = dict(pack_trajectories(batch, pad_token_id=tokenizer.pad_token_id))
    per_token = torch.tensor([[0.5] * 6, [1.0, 2.0, 9.0, 9.0, 3.0, 4.0]])
    tensors["advantages"] = per_token * tensors["response_mask"]
    tensors["rewards"] = torch.tensor([0.0, 1.0])
    tensors["group_index"] = torch.tensor([0, 0])
    packed = Batch(values=tensors, metadata={"uid": ["a", "b"], "task_keys": ["a@0#0", "b@0#1"]})
    first, second = decode_samples(packed, 7, tokenizer, count=5)
    assert first["prompt"] == tokenizer.decode(short_prompt) and first["response"] == tokenizer.decode(
        ids(list("5"))
    )
    assert (first["response_length"], first["loss_tokens"], first["advantage"]) == (1, 1, 0.5)
    assert second["prompt"] == tokenizer.decode(long_prompt)
    assert second["response"] == tokenizer.decode(model_env_model)  # as decode makes of it
    assert second["response"] == tokenizer.decode(ids(list("12=94")))  # the id without a token left out
    assert second["undecodable_tokens"] == 1 and first["undecodable_tokens"] == 0
    assert (second["response_length"], second["loss_tokens"]) == (6, 4)
    assert second["advantage"] == pytest.approx((1.0 + 2.0 + 3.0 + 4.0) / 4)
    assert (second["step"], second["row"], second["uid"], second["task"], second["group"]) == (
        7,
        1,
        "b",
        "b@0#1",
        0,
    )
    assert second["reward"] == 1.0
    assert decode_samples(packed, 7, tokenizer, count=0) == []


def test_validation_samples_pick_by_uid_and_show_chat_prompts_as_lines() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    trajectories = [
        {"uid": f"v-{i}", "prompt": chat if i == 0 else f"q{i}", "response": f"a{i}", "reward": i / 4}
        | {"response_ids": [7] * i, "scores": {"accuracy": 1.0, "note": "text"}}
        for i in (3, 0, 2, 1)  # in the order they arrived
    ]
    rows = validation_samples(trajectories, 5, count=2)
    assert [(r["uid"], r["prompt"], r["response"], r["reward"]) for r in rows] == [
        ("v-0", "system: be brief\nuser: 2+2?", "a0", 0.0),
        ("v-2", "q2", "a2", 0.5),
    ]
    assert rows[1]["response_length"] == 2 and rows[1]["scores"] == {"accuracy": 1.0} and rows[1]["step"] == 5


def test_a_response_holding_backticks_stays_inside_its_code_block() -> None:
    row = {"row": 0, "uid": "u", "group": 0, "reward": 1.0, "advantage": 0.5, "response_length": 3}
    text = samples_markdown([{**row, "prompt": "p", "response": "```python\nx\n```"}])
    assert "````\n```python\nx\n```\n````" in text
    validation_row = {"uid": "v", "reward": 0.0, "response_length": 1, "prompt": "p", "response": "r"}
    assert samples_markdown([validation_row]).startswith("uid `v`: reward 0, 1 response tokens")


# --- the loggers ----------------------------------------------------------------------------------
def test_samples_go_to_tensorboard_text_and_a_wandb_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger_ = ExperimentLogger(compose_config(["logger.backend=[wandb]"]), str(tmp_path), None)
    row = {
        "step": 2,
        "row": 0,
        "uid": "u",
        "task": None,
        "group": 1,
        "prompt": "m7=",
        "response": "7",
        "reward": 1.0,
        "advantage": 0.25,
        "response_length": 1,
        "loss_tokens": 1,
        "undecodable_tokens": 0,
    }
    logger_.post("all", {"train/reward_mean": 1.0}, 2)
    logger_.post_samples(2, [row, {**row, "row": 5, "response": "3", "reward": 0.0}])
    logger_.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors(f"{SAMPLES}/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "**row 0**" in shown and "**row 5**" in shown and "```\n3\n```" in shown
    (table_file,) = (tmp_path / "wandb" / "latest-run" / "files" / "media" / "table").glob("samples_2_*.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(row)
    assert [r[table["columns"].index("response")] for r in table["data"]] == ["7", "3"]
    assert [r[table["columns"].index("reward")] for r in table["data"]] == [1.0, 0.0]


def test_a_resumed_run_drops_the_samples_of_the_steps_it_redoes(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        write_samples(str(tmp_path), step, [{"step": step}])
    write_samples(str(tmp_path), 2, [{"step": 2}], prefix=VALIDATION)
    write_samples(str(tmp_path), 4, [{"step": 4}], prefix=VALIDATION)
    ExperimentLogger(compose_config(["logger.backend=[]"]), str(tmp_path), 2).close()
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "step_1.jsonl",
        "step_2.jsonl",
        "validation_step_2.jsonl",
    ]
    assert last_samples(str(tmp_path), validation=True) == (2, [{"step": 2}])
    assert last_samples(str(tmp_path)) == (2, [{"step": 2}])
    ExperimentLogger(compose_config(["logger.backend=[]"]), str(tmp_path), None).close()  # a fresh run
    assert last_samples(str(tmp_path)) is None


# --- a run ----------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_run_writes_decoded_samples_and_status_prints_the_last_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=3", "logger.dump_rollouts=true"]
    no_validation_but_at_end = [a for a in FAST if not a.startswith("validate.validate_at_end")]
    proc = run_train([*args, "logger.samples_per_step=3", *no_validation_but_at_end], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [
        *(f"step_{s}.jsonl" for s in (1, 2, 3)),
        "validation_step_3.jsonl",
    ]
    assert_samples_match_dumps(run_dir, [1, 2, 3], per_step=3)
    # the validation's: the dataset's prompt, the engine's answer, the task's reward of it
    validation = [
        json.loads(line) for line in (run_dir / "data" / "validation.jsonl").read_text().splitlines()
    ]
    val_rows = [
        json.loads(line)
        for line in (run_dir / "samples" / "validation_step_3.jsonl").read_text().splitlines()
    ]
    assert len(val_rows) == 3 and len({r["uid"] for r in val_rows}) == 3
    for r in val_rows:
        task = validation[int(r["uid"].removeprefix("validation-"))]
        assert r["step"] == 3 and r["prompt"] == task["prompt"]
        assert r["reward"] == r["scores"]["accuracy"] == prefix_match(task, r["response"])["reward"]
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors(f"{SAMPLES}/text_summary")
    assert [t.step for t in texts] == [1, 2, 3]
    assert [t.step for t in events.Tensors(f"{VALIDATION_SAMPLES}/text_summary")] == [3]
    last = read_rows(run_dir, 3)
    shown = texts[-1].tensor_proto.string_val[0].decode()
    assert all(f"**row {r['row']}** uid `{r['uid']}`" in shown for r in last)

    assert status_cli.main([str(run_dir), "--samples"]) == 0
    out = capsys.readouterr().out
    assert "samples of step 3 (3 rows)" in out
    for r in last:
        header = f"--- row {r['row']}  uid {r['uid']}  group {r['group']}  reward {r['reward']:.4f}"
        assert header in out and f"    {r['prompt']}\nresponse:\n    {r['response']}" in out
    assert "validation samples of step 3 (3 rows)" in out
    assert all(f"--- uid {r['uid']}  reward {r['reward']:.4f}" in out for r in val_rows)
    assert status_cli.main([str(run_dir), "--samples", "--json"]) == 0
    shown_json = json.loads(capsys.readouterr().out)
    assert shown_json["samples"] == {"step": 3, "rows": last}
    assert shown_json["validation_samples"] == {"step": 3, "rows": val_rows}


@pytest.mark.e2e
def test_samples_per_step_0_writes_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", "train_worker.total_train_steps=1", "logger.samples_per_step=0", *FAST]
    proc = run_train(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / "samples").exists()
    assert status_cli.main([str(run_dir), "--samples"]) == 0
    assert "samples: none (logger.samples_per_step=0, or no step trained yet)" in capsys.readouterr().out


def test_a_negative_samples_per_step_is_refused_naming_the_key(tmp_path: Path) -> None:
    proc = run_train([f"run_dir={tmp_path / 'run'}", "logger.samples_per_step=-1"], timeout=120)
    assert proc.returncode == 2 and "logger.samples_per_step" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.e2e
def test_ids_past_a_padded_vocabulary_are_left_out_of_the_text_and_counted(
    chatml_padded_model_dir: str, tmp_path: Path
) -> None:
    """A Qwen2 model whose embedding is larger than its tokenizer, random weights: padded ids are
    sampled often. Every row is a sample here: their counts add up to the step's
    ``rollout/undecodable_tokens``, and the text is what ``tokenizer.decode`` makes of the ids."""
    rows = [
        {"prompt": [{"role": "user", "content": f"what is {i} + 1?"}], "answer": str(i + 1)} for i in range(8)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"model.path={chatml_padded_model_dir}",
            "data.type=jsonl",
            f"data.data_files=[{data}]",
            f"validate.data.data_files=[{data}]",
            "rollout_worker.reward_fn=nexrl_hpc.rewards.match:prefix_match",
            "rollout_worker.max_prompt_length=64",
            "rollout_worker.max_response_length=8",
            "data.batch_size=2",
            "data.rollout_repeat_n=4",
            "train_worker.total_train_steps=2",
            "logger.dump_rollouts=true",
            "logger.samples_per_step=8",
            f"run_dir={run_dir}",
            "seed=3",
            *FAST,
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_samples_match_dumps(run_dir, [1, 2], per_step=8, model_dir=chatml_padded_model_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counted = {r["step"]: r["rollout/undecodable_tokens"] for r in metrics if "train/reward_mean" in r}
    shown = {step: sum(r["undecodable_tokens"] for r in read_rows(run_dir, step)) for step in (1, 2)}
    assert shown == counted and sum(shown.values()) > 0
