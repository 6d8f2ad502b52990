"""Your own dataset: jsonl, parquet and HF ``datasets`` sources, string and chat-message prompts,
dotted keys into nested rows (verl's and TRL's schemas), bad rows and long prompts counted, chat
prompts sent as the chat template's token ids, and the pre-flight data checks naming their keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import datasets
import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.data.rows import MISSING, get_path
from nexrl_hpc.models.run_tokenizer import load_run_tokenizer
from nexrl_hpc.rollout.single_turn import SingleTurnRolloutWorker
from nexrl_hpc.tasks.prepare import prepare_datasets
from tests.conftest import compose_config, run_train

DATA_TYPE = {"jsonl": "jsonl", "parquet": "parquet", "hf_disk": "hf", "hf_parquet": "hf", "hf_jsonl": "hf"}


def write_source(kind: str, path_stem: Path, rows: list[dict[str, Any]]) -> str:
    """``rows`` as a jsonl file, a parquet file, a save_to_disk folder, or a data file read by datasets."""
    if kind in ("jsonl", "hf_jsonl"):
        path = f"{path_stem}.jsonl"
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return path
    if kind in ("parquet", "hf_parquet"):
        path = f"{path_stem}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    datasets.Dataset.from_list(rows).save_to_disk(str(path_stem))
    return str(path_stem)


def verl_rows(n: int, messages: bool = True) -> list[dict[str, Any]]:
    """verl's row schema (its GSM8K preprocessing)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"what is {i} + 1?"}] if messages else f"what is {i} + 1?",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def make_loader(
    kind: str, files: list[str], overrides: tuple[str, ...] | list[str] = (), **kwargs: Any
) -> DatasetLoader:
    """The loader alone (the pre-flight data checks have tests of their own below)."""
    cfg = compose_config(["data.shuffle=false", *overrides])
    return DatasetLoader({**cfg["data"], "type": DATA_TYPE[kind]}, data_files=files, **kwargs)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk", "hf_parquet", "hf_jsonl"])
@pytest.mark.parametrize("messages", [False, True], ids=["string", "messages"])
def test_verl_rows_of_every_source_become_normalised_tasks(tmp_path: Path, kind: str, messages: bool) -> None:
    rows = verl_rows(3, messages)
    path = write_source(kind, tmp_path / "train", rows)
    dl = make_loader(
        kind,
        [path],
        [
            "data.answer_key=reward_model.ground_truth",
            "data.rollout_repeat_n=1",
            "algorithm.adv_estimator=reinforce_pp",  # a group estimator refuses groups of one
        ],
    )
    tasks = [dl.get_next_item() for _ in range(3)]
    assert dl.num_rows == 3 and dl.get_skipped_rows() == 0
    for i, task in enumerate(tasks):
        assert task["prompt"] == rows[i]["prompt"]
        assert task["answer"] == str(i + 1)
        assert task["data_source"] == "openai/gsm8k"
        assert task["extra_info"] == {"split": "train", "index": i}
        assert task["ability"] == "math" and task["reward_model"]["style"] == "rule"  # the row's own fields
        assert task["uid"] == f"train-{i}"


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_trl_rows_work_with_key_overrides(tmp_path: Path, kind: str) -> None:
    standard = [{"prompt": f"2*{i}=", "solution": str(2 * i)} for i in range(2)]
    conversational = [
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"2*{i}="}],
            "answer": str(2 * i),
        }
        for i in range(2)
    ]
    dl = make_loader(kind, [write_source(kind, tmp_path / "std", standard)], ["data.answer_key=solution"])
    task = dl.get_next_item()
    assert task["prompt"] == "2*0=" and task["answer"] == "0" and task["data_source"] is None
    dl = make_loader(
        kind, [write_source(kind, tmp_path / "conv", conversational)], ["data.prompt_key=messages"]
    )
    task = dl.get_next_item()
    assert (
        task["prompt"] == conversational[0]["messages"]
        and task["answer"] == "0"
        and task["extra_info"] is None
    )


def test_dotted_keys_reach_into_nested_rows(tmp_path: Path) -> None:
    row = {"q": {"text": "hi", "meta": {"id": 42}}, "a": [{"v": "x"}], "dotted.key": "literal"}
    assert get_path(row, "q.text") == "hi" and get_path(row, "q.meta.id") == 42
    assert get_path(row, "a.0.v") == "x" and get_path(row, "dotted.key") == "literal"
    assert get_path(row, "q.nope") is MISSING and get_path(row, "a.3.v") is MISSING
    path = write_source(
        "parquet", tmp_path / "nested", [row, {**row, "q": {"text": "yo", "meta": {"id": 7}}}]
    )
    dl = make_loader(
        "parquet", [path], ["data.prompt_key=q.text", "data.answer_key=a.0.v", "data.id_key=q.meta.id"]
    )
    assert [(t["prompt"], t["answer"], t["uid"]) for t in (dl[0], dl[1])] == [
        ("hi", "x", "42"),
        ("yo", "x", "7"),
    ]


def test_bad_parquet_rows_are_skipped_and_counted_with_file_and_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {"prompt": "ok", "answer": "1"},
        {"prompt": None, "answer": "2"},
        {"prompt": "", "answer": "3"},
        {"prompt": "fine", "answer": None},
    ]
    path = write_source("parquet", tmp_path / "bad", rows)
    with caplog.at_level(logging.WARNING, logger="nexrl_hpc.data.rows"):
        dl = make_loader("parquet", [path])
    assert dl.num_rows == 2 and dl.get_skipped_rows() == 2
    assert f"{path}: row 2: no 'prompt'" in caplog.text and f"{path}: row 3: 'prompt' is empty" in caplog.text
    assert dl[1]["answer"] is None  # a row without ground truth is kept


def test_messages_with_a_bad_shape_are_bad_rows(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "ok"}]},
        {"prompt": [{"role": "user"}]},
        {"prompt": []},
        {"prompt": [{"role": "user", "content": 3}]},
    ]
    dl = make_loader("jsonl", [write_source("jsonl", tmp_path / "m", rows)])
    assert dl.num_rows == 1 and dl.get_skipped_rows() == 3


def test_long_prompts_are_filtered_and_counted_after_templating(
    tmp_path: Path, chatml_model_dir: str
) -> None:
    tok = AutoTokenizer.from_pretrained(chatml_model_dir)
    rows = [{"prompt": [{"role": "user", "content": "1 + 1 " * n}], "answer": "x"} for n in (1, 30, 2, 60)]
    lengths = [
        len(
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for r in rows
    ]
    limit = sorted(lengths)[1]  # two fit, two are too long
    path = write_source("parquet", tmp_path / "long", rows)
    cfg = compose_config([f"model.path={chatml_model_dir}"])
    dl = make_loader("parquet", [path], tokenizer=load_run_tokenizer(cfg["model"]), max_prompt_length=limit)
    assert dl.num_rows == 2 and dl.get_filtered_long_prompts() == 2
    assert [dl[i]["prompt"] for i in range(2)] == [rows[0]["prompt"], rows[2]["prompt"]]
    with pytest.raises(ValueError, match="no usable rows.*4 longer than rollout_worker.max_prompt_length"):
        make_loader(
            "parquet", [path], tokenizer=load_run_tokenizer(cfg["model"]), max_prompt_length=min(lengths) - 1
        )


def test_worker_sends_chat_prompts_as_the_chat_template_ids(chatml_model_dir: str) -> None:
    cfg = compose_config([f"model.path={chatml_model_dir}"])
    worker = SingleTurnRolloutWorker(cfg)  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(chatml_model_dir)
    messages = [{"role": "system", "content": "think"}, {"role": "user", "content": "what is 3 + 4?"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert worker._engine_prompt({"prompt": messages}) == expected
    assert tok.decode(expected).endswith("<|im_start|>assistant\n")
    assert worker._engine_prompt({"prompt": "what is 3 + 4?"}) == "what is 3 + 4?"  # a string stays raw
    assert worker._engine_prompt({"prompt": ""}) is None
    templated = SingleTurnRolloutWorker(
        compose_config([f"model.path={chatml_model_dir}", "data.apply_chat_template=true"])  # type: ignore[arg-type]
    )
    assert templated._engine_prompt({"prompt": "hi"}) == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    no_gen = SingleTurnRolloutWorker(
        compose_config([f"model.path={chatml_model_dir}", "data.add_generation_prompt=false"])  # type: ignore[arg-type]
    )
    assert (
        no_gen._engine_prompt({"prompt": messages})
        == expected[: -len(tok("<|im_start|>assistant\n").input_ids)]
    )


def test_validation_copy_holds_the_filtered_rows_validation_uses(
    tmp_path: Path, chatml_model_dir: str
) -> None:
    rows = verl_rows(3)
    rows[1]["prompt"] = [{"role": "user", "content": "1 + 2 " * 80}]
    val = write_source("parquet", tmp_path / "val", rows)
    train = write_source("parquet", tmp_path / "train", verl_rows(2))
    cfg = compose_config(
        [
            f"model.path={chatml_model_dir}",
            "data.type=parquet",
            f"data.data_files=[{train}]",
            f"validate.data.data_files=[{val}]",
            "data.answer_key=reward_model.ground_truth",
            "rollout_worker.max_prompt_length=40",
            f"run_dir={tmp_path}",
        ]
    )
    train_files, val_files = prepare_datasets(cfg, str(tmp_path))  # type: ignore[arg-type]
    assert (train_files, val_files) == ([train], [val])
    copy = [json.loads(line) for line in open(tmp_path / "data" / "validation.jsonl")]
    assert copy == [{"prompt": rows[i]["prompt"], "answer": str(i + 1)} for i in (0, 2)]


def test_the_tiny_char_model_refuses_chat_prompts_naming_the_key(tmp_path: Path) -> None:
    path = write_source("parquet", tmp_path / "chat", verl_rows(2))
    overrides = [
        "data.type=parquet",
        f"data.data_files=[{path}]",
        f"validate.data.data_files=[{path}]",
        "data.answer_key=reward_model.ground_truth",
    ]
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    paths = {p.path for p in err.value.problems}
    assert paths == {
        "data.prompt_key"
    }  # validate.data.prompt_key follows it (${data.prompt_key}): one problem
    assert "model.tiny.tokenizer.chat_template" in str(err.value)
    cfg = compose_config(
        overrides + ["rollout_worker.type=simple", "data.prompt_key=ability"]
    )  # strings: fine
    with pytest.raises(
        ValueError, match="data.prompt_key: .*no chat template"
    ):  # the loader refuses them too
        DatasetLoader(
            {**cfg["data"], "prompt_key": "prompt"},
            data_files=[path],
            tokenizer=load_run_tokenizer(cfg["model"]),
            max_prompt_length=99,
        )
    chat = compose_config(overrides + ["model.tiny.tokenizer.chat_template='{{ messages[0].content }}'"])
    assert chat["data"]["type"] == "parquet"  # with a chat template the same data passes


def problems_of(overrides: list[str]) -> dict[str, str]:
    """Key path -> its problems' messages (one a line)."""
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    found: dict[str, str] = {}
    for p in err.value.problems:
        found[p.path] = f"{found[p.path]}\n{p.message}" if p.path in found else p.message
    return found


def test_preflight_names_each_data_problem_by_its_key(tmp_path: Path, chatml_model_dir: str) -> None:
    train = write_source("parquet", tmp_path / "train", verl_rows(4))
    val = write_source("hf_disk", tmp_path / "val_disk", verl_rows(2))
    base = [
        f"model.path={chatml_model_dir}",
        "data.type=parquet",
        f"data.data_files=[{train}]",
        "validate.data.type=hf",
        f"validate.data.data_files=[{val}]",
    ]
    ok = compose_config(base + ["data.answer_key=reward_model.ground_truth"])
    assert ok["validate"]["data"]["type"] == "hf"  # a save_to_disk folder is a valid hf source

    found = problems_of(base)  # verl rows without the answer_key override
    assert set(found) == {"data.answer_key"}  # validate.data.answer_key interpolates it: not listed twice
    assert "reward_model.ground_truth" in found["data.answer_key"]  # the rows' key paths are listed

    found = problems_of(base + ["data.answer_key=reward_model.ground_truth", "data.prompt_key=question"])
    assert set(found) == {"data.prompt_key"} and "no 'question'" in found["data.prompt_key"]

    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file at all")
    found = problems_of(
        [
            *base,
            "data.answer_key=reward_model.ground_truth",
            f"data.data_files=[{train},/nonexistent/t.parquet,{garbage}]",
        ]
    )
    assert set(found) == {"data.data_files[1]", "data.data_files[2]"}
    assert (
        "no such file" in found["data.data_files[1]"]
        and "cannot be read as parquet" in found["data.data_files[2]"]
    )

    found = problems_of(
        base + ["data.answer_key=reward_model.ground_truth", "rollout_worker.max_prompt_length=3"]
    )
    assert set(found) == {"rollout_worker.max_prompt_length"}
    assert (
        "every prompt of data.data_files is longer than 3 tokens" in found["rollout_worker.max_prompt_length"]
    )
    assert "every prompt of validate.data.data_files" in found["rollout_worker.max_prompt_length"]


def test_preflight_finds_a_fitting_prompt_past_the_first_rows(tmp_path: Path, chatml_model_dir: str) -> None:
    rows = [{"prompt": "1 + 1 " * 50, "answer": "2"}] * 8 + [{"prompt": "1 + 1", "answer": "2"}]
    path = write_source("jsonl", tmp_path / "mostly_long", rows)
    cfg = compose_config(
        [
            f"model.path={chatml_model_dir}",
            "data.type=jsonl",
            f"data.data_files=[{path}]",
            f"validate.data.data_files=[{path}]",
            "rollout_worker.max_prompt_length=20",
        ]
    )
    assert cfg["data"]["data_files"] == [path]


def answer_prefix_reward(task: dict[str, Any], response: str) -> float:
    """The e2e test's reward: the response starts with the ground truth."""
    return float(response.strip().startswith(str(task["answer"])))


@pytest.mark.e2e
def test_verl_parquet_run_trains_on_the_chat_template_ids(tmp_path: Path, chatml_model_dir: str) -> None:
    train = write_source("parquet", tmp_path / "T", verl_rows(12))
    val_rows = verl_rows(4)
    val_rows[3]["prompt"] = [{"role": "user", "content": "1 + 2 " * 80}]  # filtered: longer than 96 tokens
    val = write_source("parquet", tmp_path / "V", val_rows)
    run_dir = tmp_path / "D"
    proc = run_train(
        [
            f"model.path={chatml_model_dir}",
            "data.type=parquet",
            f"data.data_files=[{train}]",
            f"validate.data.data_files=[{val}]",
            "data.answer_key=reward_model.ground_truth",
            "rollout_worker.reward_fn=tests.test_data_sources:answer_prefix_reward",
            "rollout_worker.max_prompt_length=96",
            "rollout_worker.max_response_length=8",
            "data.batch_size=8",
            "data.rollout_repeat_n=4",
            "train_worker.total_train_steps=3",
            "logger.dump_rollouts=true",
            f"run_dir={run_dir}",
            "seed=7",
            "logger.backend=[]",
            "validate.eval.validate_freq=0",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(chatml_model_dir)
    expected = {
        tuple(
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for r in verl_rows(12)
    }
    for step in (1, 2, 3):
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            input_ids, mask, responses = f["input_ids"][()], f["attention_mask"][()], f["responses"][()]
        prompt_width = input_ids.shape[1] - responses.shape[1]
        assert input_ids.shape[0] == 32
        for ids, m in zip(input_ids[:, :prompt_width], mask[:, :prompt_width]):
            assert tuple(int(i) for i in ids[m.astype(bool)]) in expected
        assert np.array_equal(input_ids[:, prompt_width:], responses)
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train_rows = [r for r in metrics if "data/filtered_long_prompts" in r]
    assert len(train_rows) == 3 and all(r["data/filtered_long_prompts"] == 0 for r in train_rows)
    val_metrics = [r for r in metrics if "val/filtered_long_prompts" in r]
    assert val_metrics and all(
        r["val/filtered_long_prompts"] == 1 and r["val/num_samples"] == 3 for r in val_metrics
    )
    copy = [json.loads(line) for line in open(run_dir / "data" / "validation.jsonl")]
    assert copy == [{"prompt": val_rows[i]["prompt"], "answer": str(i + 1)} for i in range(3)]


def test_hf_dataset_dict_folder_reads_the_configured_split(tmp_path: Path) -> None:
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(verl_rows(3)), "test": datasets.Dataset.from_list(verl_rows(1))}
    ).save_to_disk(str(folder))
    cfg = compose_config(
        [
            "data.type=hf",
            f"data.data_files=[{folder}]",
            f"validate.data.data_files=[{folder}]",
            "validate.data.split=test",
            "data.answer_key=reward_model.ground_truth",
            "model.tiny.tokenizer.chat_template='{{ messages[0].content }}'",
        ]
    )
    assert DatasetLoader(cfg["data"], data_files=[str(folder)]).num_rows == 3
    assert DatasetLoader(cfg["validate"]["data"], is_validate=True, data_files=[str(folder)]).num_rows == 1
    found = problems_of(
        [
            "data.type=hf",
            f"data.data_files=[{folder}]",
            f"validate.data.data_files=[{folder}]",
            "data.answer_key=reward_model.ground_truth",
            "model.tiny.tokenizer.chat_template='{{ messages[0].content }}'",
        ]
    )
    assert set(found) == {"validate.data.data_files[0]"}  # validate.data.split defaults to "validation"
    assert "no split 'validation' (it has train, test)" in found["validate.data.data_files[0]"]
