"""``nexrl_hpc.train(...)``: a run from a Python script, with rows, a reward function and a model in hand."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nexrl_hpc
from nexrl_hpc.api import _dataset_args, _dataset_files, data_type_of, object_spec, registered
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.rewards.match import exact_match
from tests.conftest import REPO


def test_a_function_with_an_import_path_is_named_by_it_and_others_are_registered() -> None:
    assert object_spec(exact_match, "reward_fn") == "nexrl_hpc.rewards.match:exact_match"

    def local_reward(task: dict, response: str) -> float:
        return 1.0

    spec = object_spec(local_reward, "reward_fn")
    assert spec == "nexrl_hpc.api:registered.reward_fn" and registered.reward_fn is local_reward


def test_rows_are_written_as_jsonl_and_paths_pass_through(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
    written: list[str] = []
    (path,) = _dataset_files(rows, str(tmp_path / "in" / "train.jsonl"), "train_dataset", written)
    assert [json.loads(line) for line in open(path)] == rows and written == [path]
    assert _dataset_files("/data/x.parquet", "unused", "k", written) == ["/data/x.parquet"]
    assert _dataset_files(["/a.jsonl", Path("/b.jsonl")], "unused", "k", written) == ["/a.jsonl", "/b.jsonl"]
    assert written == [path]  # paths are not the call's own files
    with pytest.raises(ConfigError, match="train_dataset.*row 1 is a str"):
        _dataset_files([{"prompt": "a"}, "b"], str(tmp_path / "t.jsonl"), "train_dataset", written)
    with pytest.raises(ConfigError, match="val_dataset.*no rows"):
        _dataset_files([], str(tmp_path / "v.jsonl"), "val_dataset", written)
    assert written == [
        path,
        str(tmp_path / "t.jsonl"),
        str(tmp_path / "v.jsonl"),
    ]  # a failed call removes them


def test_the_data_type_of_files_comes_from_their_extension() -> None:
    assert data_type_of(["/d/x.parquet", "/d/y.PARQUET"], "train_dataset") == "parquet"
    assert data_type_of(["/d/x.jsonl", "/d/y.json"], "val_dataset") == "jsonl"
    with pytest.raises(ConfigError) as err:
        data_type_of(["/d/x.csv"], "train_dataset")
    assert str(err.value.problems[0]) == (
        "train_dataset: '/d/x.csv': cannot tell the data type from its extension (.csv; known: .parquet, "
        ".jsonl, .json): name it in the overrides, e.g. data.type=hf for a datasets folder or another file type"
    )
    with pytest.raises(ConfigError, match="train_dataset: '/d/folder': .*extension \\(none;"):
        data_type_of(["/d/folder"], "train_dataset")
    with pytest.raises(ConfigError, match="train_dataset: files of different types \\(jsonl, parquet\\)"):
        data_type_of(["/d/x.jsonl", "/d/y.parquet"], "train_dataset")


def test_config_error_is_exported() -> None:
    assert nexrl_hpc.ConfigError is ConfigError and "ConfigError" in nexrl_hpc.__all__


def test_a_failed_check_removes_the_rows_it_wrote_and_nothing_else(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}] * 4
    fresh = tmp_path / "fresh" / "run"
    with pytest.raises(ConfigError):  # no reward: task=custom asks for one
        nexrl_hpc.train(train_dataset=rows, val_dataset=rows, run_dir=fresh)
    assert not (tmp_path / "fresh").exists()  # the folders this call made are gone too
    kept = tmp_path / "kept"
    (kept / "inputs").mkdir(parents=True)
    (kept / "inputs" / "mine.txt").write_text("the user's")
    (kept / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError) as err:
        nexrl_hpc.train(
            ["model.path=/nonexistent/model"],
            train_dataset=rows,
            val_dataset=rows,
            reward_fn=exact_match,
            run_dir=kept,
        )
    assert [p.path for p in err.value.problems] == ["model.path"]
    assert sorted(p.name for p in kept.rglob("*")) == ["inputs", "mine.txt", "notes.txt"]


def test_dataset_paths_name_their_data_type_unless_the_overrides_do(tmp_path: Path) -> None:
    inputs = str(tmp_path / "inputs")
    assert _dataset_args([], "/d/t.parquet", "/d/v.parquet", inputs, []) == [
        "data.type=parquet",
        "data.data_files=['/d/t.parquet']",
        "validate.data.data_files=['/d/v.parquet']",  # follows data.type
    ]
    assert _dataset_args([], "/d/t.parquet", [{"prompt": "p"}], inputs, []) == [
        "data.type=parquet",
        "data.data_files=['/d/t.parquet']",
        "validate.data.type=jsonl",  # the rows, written as jsonl
        f"validate.data.data_files=['{inputs}/validation.jsonl']",
    ]
    assert _dataset_args([], None, "/d/v.json", inputs, []) == [
        "validate.data.type=jsonl",
        "validate.data.data_files=['/d/v.json']",
    ]
    assert _dataset_args(["data.type=hf"], "/d/folder", None, inputs, []) == ["data.data_files=['/d/folder']"]


def test_a_parquet_path_gets_the_custom_preset(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}]), path)
    with pytest.raises(ConfigError) as err:  # your own data: task=custom, whose reward is yours to name
        nexrl_hpc.train(
            ["model.path=/nonexistent/model"],
            train_dataset=str(path),
            val_dataset=str(path),
            run_dir=tmp_path / "run",
        )
    assert [p.path for p in err.value.problems] == ["rollout_worker.reward_fn", "model.path"]


SCRIPT = """
import json, sys
import nexrl_hpc

def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's signature
    return {"score": float(solution_str.strip().startswith(str(ground_truth))), "seen": 1.0}

rows = [
    {"data_source": "toy", "prompt": [{"role": "user", "content": f"what is {a} + {b}?"}],
     "reward_model": {"ground_truth": str(a + b)}}
    for a in range(10) for b in range(10)
]
result = nexrl_hpc.train(
    ["model.path=" + sys.argv[1], "data.answer_key=reward_model.ground_truth",
     "rollout_worker.max_prompt_length=64", "rollout_worker.max_response_length=4",
     "data.batch_size=8", "data.rollout_repeat_n=4", "train_worker.total_train_steps=3",
     "validate.eval.validate_freq=3", "logger.backend=[]", "seed=3"],
    train_dataset=rows[:80], val_dataset=rows[80:], reward_fn=compute_score, run_dir=sys.argv[2],
)
print(json.dumps({"exit_code": result.exit_code, "run_dir": result.run_dir,
                  "final_validation": result.final_validation}))
"""


@pytest.mark.e2e
def test_a_script_trains_a_chat_model_on_its_rows_with_its_own_reward(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    """The script's reward lives in ``__main__`` (no import path): registered, called with verl's
    arguments; rows with chat-message prompts and a nested answer; the user's tied Qwen2."""
    script = tmp_path / "my_run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), chatml_model_dir, str(run_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit_code"] == 0 and result["run_dir"] == str(run_dir)
    assert result["final_validation"]["val/num_samples"] == 20
    assert result["final_validation"]["val/seen"] == 1.0  # the verl dict's extra score, averaged
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    assert all(r["train/seen"] == 1.0 and r["reward/errors"] == 0 for r in rows if "train/reward_mean" in r)
    assert len((run_dir / "inputs" / "train.jsonl").read_text().splitlines()) == 80
    assert (run_dir / "train.log").read_text().count("training finished at step 3") == 1
    assert (run_dir / "checkpoints").is_dir()


def test_dataset_paths_count_for_the_checks_of_data_type(tmp_path: Path) -> None:
    """``data.type=parquet`` with the files given as ``train_dataset``: the checks see the files
    (no "needs at least one file"), so only the real problem is reported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}]), path)
    with pytest.raises(ConfigError) as err:
        nexrl_hpc.train(
            ["data.type=parquet", "model.path=/nonexistent/model"],
            train_dataset=str(path),
            val_dataset=str(path),
            reward_fn=exact_match,
            run_dir=tmp_path / "run",
        )
    assert [p.path for p in err.value.problems] == ["model.path"]
