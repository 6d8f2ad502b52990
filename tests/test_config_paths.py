"""The model directory and data files a run reads are config problems (exit 2), found before anything
starts, and with launcher=slurm before anything is submitted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.launcher.preflight import preflight
from tests.conftest import CONFIG_DIR, compose_config, run_train


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        preflight(CONFIG_DIR, "rl_train", overrides)
    return {p.path: p.message for p in err.value.problems}


def write_jsonl(path: Path, n: int = 3) -> str:
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def test_model_path_must_be_a_directory_holding_config_json(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert problems_of([f"model.path={missing}"]) == {
        "model.path": f"'{missing}': no such directory (expected an HF-layout model directory with "
        "config.json; null builds the tiny model of model.tiny)"
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    assert problems_of([f"model.path={empty}"])["model.path"].startswith(f"'{empty}': no config.json in it")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    assert problems_of([f"model.path={a_file}"])["model.path"].startswith(f"'{a_file}': not a directory")


def test_a_model_dir_must_load_its_config_tokenizer_and_hold_weights(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    """Each part of the user's model directory that the run needs, removed or broken in a copy."""
    import shutil

    def broken(name: str, change: str) -> Path:
        d = tmp_path / name
        shutil.copytree(chatml_model_dir, d)
        if change == "no weights":
            (d / "model.safetensors").unlink()
        elif change == "bad tokenizer":
            (d / "tokenizer.json").write_text("{not json")
        elif change == "unknown architecture":
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
        return d

    assert "no weights in it" in problems_of([f"model.path={broken('w', 'no weights')}"])["model.path"]
    assert (
        "its tokenizer does not load"
        in problems_of([f"model.path={broken('t', 'bad tokenizer')}"])["model.path"]
    )
    why = problems_of([f"model.path={broken('a', 'unknown architecture')}"])["model.path"]
    assert "its config.json does not load" in why and "no_such_arch" in why
    preflight(CONFIG_DIR, "rl_train", [f"model.path={chatml_model_dir}"])  # the intact one passes


def test_a_real_model_dir_passes(tiny_model_dir: str) -> None:
    assert os.path.isfile(os.path.join(tiny_model_dir, "config.json"))
    preflight(CONFIG_DIR, "rl_train", [f"model.path={tiny_model_dir}"])  # no error
    assert compose_config([f"model.path={tiny_model_dir}"])["model"]["path"] == tiny_model_dir


def test_every_missing_data_file_is_named_with_its_index(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "train.jsonl")
    missing = tmp_path / "missing.jsonl"
    a_dir = tmp_path / "a_dir"
    a_dir.mkdir()
    probs = problems_of(
        [
            "data.type=jsonl",
            f"data.data_files=[{good},{missing}]",
            f"validate.data.data_files=[{a_dir}]",
        ]
    )
    assert probs == {
        "data.data_files[1]": f"'{missing}': no such file",
        "validate.data.data_files[0]": f"'{a_dir}': is a directory, not a file",
    }


def test_a_data_file_whose_read_fails_is_named() -> None:
    # /proc/self/mem is a regular file that opens, but reading its first byte (address 0, never
    # mapped) fails with EIO, for root too: a file that exists and still cannot be read
    mem = "/proc/self/mem"
    probs = problems_of(["data.type=jsonl", f"data.data_files=[{mem}]", f"validate.data.data_files=[{mem}]"])
    assert probs["data.data_files[0]"].startswith(f"'{mem}': cannot be read")
    assert probs["validate.data.data_files[0]"].startswith(f"'{mem}': cannot be read")


def test_a_data_file_that_is_not_a_regular_file_is_named(tmp_path: Path) -> None:
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)  # opening it would block until a writer comes: never opened
    probs = problems_of(
        ["data.type=jsonl", f"data.data_files=[{fifo}]", f"validate.data.data_files=[{fifo}]"]
    )
    assert probs["data.data_files[0]"] == f"'{fifo}': not a regular file"


def test_real_data_files_pass_and_task_data_ignores_the_lists(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl")
    val = write_jsonl(tmp_path / "val.jsonl")
    preflight(
        CONFIG_DIR,
        "rl_train",
        [
            "data.type=jsonl",
            f"data.data_files=[{train}]",
            f"validate.data.data_files=[{val}]",
            "rollout_worker.reward_fn=nexrl_hpc.rewards:prefix_match",  # not the toy task's: these are your rows
        ],
    )
    # data.type=task generates its rows: listed files are never read, so not checked
    preflight(CONFIG_DIR, "rl_train", [f"data.data_files=[{tmp_path / 'nope.jsonl'}]"])


def test_cli_missing_model_and_data_exit_2_and_start_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    model = tmp_path / "no_model"
    train = tmp_path / "no_train.jsonl"
    val = tmp_path / "no_val.jsonl"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"model.path={model}",
            "data.type=jsonl",
            f"data.data_files=[{train}]",
            f"validate.data.data_files=[{val}]",
        ],
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid config (4 problems):" in proc.stderr  # your model and data: task=custom, no reward yet
    assert "rollout_worker.reward_fn: not set (null)" in proc.stderr
    assert f"model.path: '{model}': no such directory" in proc.stderr
    assert f"data.data_files[0]: '{train}': no such file" in proc.stderr
    assert f"validate.data.data_files[0]: '{val}': no such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_slurm_launcher_refuses_a_missing_model_before_asking_the_cluster(tmp_path: Path) -> None:
    """No cluster needed: sbatch and sinfo on PATH are stand-ins that record being called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("sbatch", "sinfo", "squeue", "scontrol"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 1\n')
        script.chmod(0o755)
    run_dir = tmp_path / "never"
    model = tmp_path / "no_model"
    proc = run_train(
        [f"run_dir={run_dir}", "launcher=slurm", f"model.path={model}"],
        timeout=120,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"model.path: '{model}': no such directory" in proc.stderr
    assert not calls.exists(), calls.read_text()  # neither the partition check nor sbatch ran
    assert "submitted" not in proc.stdout
    assert not run_dir.exists()
