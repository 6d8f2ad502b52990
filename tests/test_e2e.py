"""End-to-end runs of ``python -m launch.train``, as a user runs it (real server, real trainer, real files)."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import pytest
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from launch import status as status_cli
from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.tracking.timing import TIMING_PARTS
from tests.conftest import REPO, compose_config, independent_eval, run_train

pytestmark = pytest.mark.e2e

FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_steps(rows: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in rows if "train/reward_mean" in r]


def assert_step_time_adds_up(rows: list[dict[str, Any]]) -> None:
    """Every step line's timing parts sum to its timing/step_s (the trainer's timeline)."""
    for r in (r for r in rows if "train/reward_mean" in r):
        assert abs(sum(r[k] for k in TIMING_PARTS) - r["timing/step_s"]) < 1e-9, r["step"]
        assert min(r[k] for k in TIMING_PARTS) >= -1e-9, r["step"]


def run_status_lines(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``python -m launch.status RUN_DIR``'s lines, by label."""
    capsys.readouterr()
    assert status_cli.main([str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    width = lines[0].index("/")  # the labels' column width (the run dir is absolute)
    return {line[:width].strip(): line[width:] for line in lines}


def wait_for_plots(run_dir: Path, names: set[str], timeout: float = 180) -> None:
    """The last drawing finishes after the run exits (outside Slurm the run does not wait for it)."""
    deadline = time.monotonic() + timeout
    while not names <= {p.stem for p in (run_dir / "plots").glob("*.png")}:
        assert time.monotonic() < deadline, sorted(p.name for p in (run_dir / "plots").glob("*"))
        time.sleep(0.5)


def test_default_run_learns_and_matches_an_independent_evaluation(
    default_run: tuple[Path, subprocess.CompletedProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    """The acceptance run: the embedded default with only run_dir and seed set."""
    run_dir, proc = default_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run_dir)
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    assert val[0][0] == 0 and val[0][1] <= 0.3, val  # validate_before_train
    assert val[-1][0] == 50 and val[-1][1] >= 0.8, val
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    for r in steps:
        assert r["train/logprob_mismatch_max"] <= 1e-4, r["step"]
        for key in ("train/loss", "train/grad_norm", "timing/step_s"):
            assert isinstance(r[key], float), key
        assert (
            r["train/response_length_min"]
            <= r["train/response_length_mean"]
            <= r["train/response_length_max"]
        )
        assert (
            r["perf/trajectories"] == 256
            and r["perf/generated_tokens"] >= r["train/response_length_min"] * 256
        )
        assert r["perf/trajectories_per_s"] == pytest.approx(256 / r["timing/step_s"])
        assert r["perf/trained_tokens_per_s"] > r["perf/generated_tokens_per_s"] > 0  # trained: prompts too
    assert steps[-1]["train/reward_mean"] > steps[0]["train/reward_mean"]
    # sync mode: the trainer waits for every batch's generation; a validation of version v runs
    # beside the rollouts of step v + 1, so the trainer can wait for it only in steps v + 1 (its
    # batch is in first) and v + 2 (version v + 1 is published after the validation), never elsewhere
    assert_step_time_adds_up(rows)
    assert all(r["timing/generation_s"] > 0 for r in steps)
    validated = {v[0] for v in val}
    beside = {v + d for v in validated if 0 < v < 50 for d in (1, 2)}
    assert {r["step"] for r in steps if r["timing/validation_s"] > 0} <= beside

    # run dir layout
    assert (run_dir / "config.yaml").exists() and (run_dir / "tensorboard").is_dir()
    ckpt = run_dir / "checkpoints" / "global_step_50"
    assert (
        (ckpt / "COMPLETE").exists()
        and (ckpt / "state.h5").exists()
        and (ckpt / "optimizer" / "rank_0.safetensors").exists()
    )
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step_50"
    with h5py.File(ckpt / "state.h5") as f:
        assert f.attrs["global_step"] == 50 and json.loads(f["dataloader"][()])["issued_fresh"] == 50 * 256
    model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt / "model")
    assert model.config.vocab_size == len(tok)
    val_rows = [json.loads(line) for line in open(run_dir / "data" / "validation.jsonl")]
    assert set(val_rows[0]) == {"prompt", "answer"} and len(val_rows) == 140

    result = independent_eval(run_dir)
    assert result["checkpoint"].endswith("global_step_50")
    assert abs(result["accuracy"] - val[-1][1]) <= 0.1

    # seeing the run: PNG curves, and launch.status
    wait_for_plots(
        run_dir, {"reward", "validation", "loss", "grad_norm", "entropy", "logprob_mismatch", "step_time"}
    )
    status = run_status_lines(run_dir, capsys)
    assert status["state"] == "finished (exit 0): run finished"
    assert status["step"] == "50 / 50" and status["last checkpoint"].endswith("global_step_50")
    assert status["last validation"].startswith("step 50: ")
    assert f"val/accuracy={val[-1][1]:.4f}" in status["last validation"]
    assert status["reward"].endswith(
        f"last {steps[-1]['train/reward_mean']:.4f}"
        f" (min {min(r['train/reward_mean'] for r in steps):.4f},"
        f" max {max(r['train/reward_mean'] for r in steps):.4f})"
    )

    # the same command again: the run is finished, nothing is added, its last validation is reported
    again = run_train([f"run_dir={run_dir}", "seed=7"], timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir) if "train/reward_mean" in r] == list(range(1, 51))
    assert f"last validation: val/accuracy={val[-1][1]:.4f}" in again.stdout


ASYNC = [
    "weight.sync_mode=fully-async",
    "weight.staleness_threshold=2",
    "weight.stale_policy=keep",
    "service.train_service.num_threads=1",
    "service.inference_service.local.num_threads=1",
]


@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_resume_after_kill_continues_steps_and_data_exactly_once(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed right after a checkpoint and resumed, the run trains exactly the data of an
    uninterrupted one; in fully-async mode also the tasks that were out or done-but-untrained
    at the checkpoint (the order within the run then differs, the multiset does not)."""
    run_dir = tmp_path / "resume"
    args = [
        f"run_dir={run_dir}",
        "seed=3",
        "train_worker.total_train_steps=12",
        "train_worker.save_freq=2",
        "train_worker.max_ckpt_to_keep=null",
        "logger.dump_rollouts=true",
        *FAST,
        *(ASYNC if mode != "sync" else []),
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "launch.train", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = run_dir / "checkpoints" / "global_step_4" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert first.poll() is None, "the first run ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown: like a node failure
    first.wait()
    status = run_status_lines(run_dir, capsys)  # not shown as running: its process is gone
    assert (
        status["state"]
        == f"failed: the run's process (pid {first.pid}) is gone without recording an end: killed (SIGKILL, out of memory?)"
    )
    done_before = sorted(
        int(p.name.split("_")[-1])
        for p in (run_dir / "checkpoints").glob("global_step_*")
        if (p / "COMPLETE").exists()
    )
    assert 4 <= done_before[-1] < 12

    second = run_train(args, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert train_steps(metrics(run_dir)) == list(range(1, 13))  # every step exactly once
    assert_step_time_adds_up(metrics(run_dir))  # in fully-async mode too
    assert run_status_lines(run_dir, capsys)["state"] == "finished (exit 0): run finished"

    # the data order of an uninterrupted run: 12 steps x 32 prompts x 8 samples
    cfg = compose_config(args)
    reference = DatasetLoader(cfg["data"], data_files=[str(run_dir / "data" / "train.jsonl")])
    per_step = cfg["trajectory_pool"]["batch_size"]
    all_expected: collections.Counter = collections.Counter()
    all_got: collections.Counter = collections.Counter()
    for step in range(1, 13):
        expected = collections.Counter(
            (t["uid"], t["epoch"]) for t in (reference.get_next_item() for _ in range(per_step))
        )
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            got = collections.Counter(zip([u.decode() for u in f["uid"][()]], f["epoch"][()].tolist()))
            versions = f["weight_version"][()].tolist()
        if mode == "sync":
            assert versions == [step - 1] * per_step  # on-policy
            assert got == expected, step
        else:
            assert all(step - 1 - v <= 2 for v in versions), (step, versions)
        all_expected += expected
        all_got += got
    assert all_got == all_expected  # every task of the 12 batches trained, none twice


def test_bad_dataset_rows_are_skipped_counted_and_the_run_continues(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    with open(train, "wb") as f:
        for i in range(40):
            f.write(
                (
                    json.dumps({"prompt": f"m{i % 10}{(i * 7) % 10}{(i * 3) % 10}=", "answer": "9"}) + "\n"
                ).encode()
            )
        f.write(b"\xff\xfe\xfa garbage\n")
        f.write(b'{"answer": "1"}\n')
        f.write(b"{broken json\n")
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "m123=", "answer": "3"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "task=max_digit",  # the digit task's rows as jsonl: its model and lengths, a shipped scorer
            "rollout_worker.reward_fn=nexrl_hpc.rewards:prefix_match",
            "data.type=jsonl",
            f"data.data_files=[{train}]",
            f"validate.data.data_files=[{val}]",
            "data.batch_size=4",
            "train_worker.total_train_steps=2",
            *FAST,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in metrics(run_dir) if "train/reward_mean" in r]
    assert [r["data/skipped_rows"] for r in rows] == [3, 3]
    assert [json.loads(line) for line in open(run_dir / "data" / "validation.jsonl")] == [
        {"prompt": "m123=", "answer": "3"}
    ]


def nan_reward_for_first_row(task: dict[str, Any], response: str) -> dict[str, float]:
    """Reward function used by the NaN test: poisons one sample of row 0's group. A NaN reward
    would be scored 0 by the reward runner; 1e39 is a valid reward that overflows the float32 batch
    to inf, so the group's mean and advantages, and the loss, are NaN (one sample only: a group
    whose rewards are all equal gets advantage 0 whatever they are)."""
    poisoned = task["uid"] == "train-0" and task["sample_index"] == 0
    return {"reward": 1e39 if poisoned else 0.0}


def test_nan_loss_step_is_skipped_and_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "nan"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "rollout_worker.reward_fn=tests.test_e2e:nan_reward_for_first_row",
            "data.shuffle=false",
            "train_worker.total_train_steps=3",
            *FAST,
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in metrics(run_dir) if "train/reward_mean" in r]
    assert [r["train/nan_skipped"] for r in rows] == [1, 0, 0]
    assert "non-finite loss or gradient" in (run_dir / "train.log").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_inference_service_fails_with_its_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_train(
        [
            f"run_dir={tmp_path / 'x'}",
            f"service.inference_service.base_url={url}",
            "service.inference_service.retry_backoff_s=0.05",
        ]
    )
    assert proc.returncode == 1
    assert "run failed" in proc.stderr and url in proc.stderr
    status = run_status_lines(tmp_path / "x", capsys)  # the run dir says why, not "step 0 ... None"
    assert status["state"].startswith("failed (exit 1): ") and url in status["state"]
    assert status["step"] == "0 / 50" and status["last checkpoint"] == "-"
