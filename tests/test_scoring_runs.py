"""Runs scored by a model: a reward model (tiny sequence classifier built offline) and an LLM judge
(the local engine server serving a tiny judge with a rubric) under mpirun, each on a rank of its own
(placement group ``reward``), called over the signed RPC; and a run whose judge server is killed
mid-run: its samples are skipped and counted, the run ends as planned."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.scoring.classifier import ClassifierScorer
from tests.conftest import REPO, compose_config, run_train
from tests.helpers.reward_models import RUBRIC
from tests.test_mpi import FAST, metrics, mpirun
from tests.test_samples import read_rows

pytestmark = pytest.mark.e2e

SPECIAL = re.compile(r"<s>|</s>|<pad>|<unk>")  # the default task's char tokenizer's special tokens
SMALL = ["data.batch_size=8", "data.rollout_repeat_n=4", "trajectory_pool.batch_size=32"]


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in metrics(run_dir) if "train/reward_mean" in r]


def run_mpi(run_dir: Path, args: list[str]) -> subprocess.CompletedProcess:
    """mpirun -n 4: driver, trainer, reward, rollout."""
    cmd = mpirun(
        4, [f"run_dir={run_dir}", "seed=3", *FAST, *SMALL, "train_worker.total_train_steps=2", *args]
    )
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def assert_reward_rank(run_dir: Path) -> None:
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert [r["group"] for r in ranks] == ["driver", "trainer", "reward", "rollout"]


def test_mpi_run_scored_by_a_reward_model_on_its_own_rank(tmp_path: Path, classifier_model_dir: str) -> None:
    run_dir = tmp_path / "rm"
    proc = run_mpi(
        run_dir,
        [
            "reward_model.type=classifier",
            "reward_model.placement=own_ranks",
            f"reward_model.classifier.path={classifier_model_dir}",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_reward_rank(run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all((r["reward/errors"], r["reward/timeouts"]) == (0, 0) for r in rows)
    # each sample's reward is the classifier's logit for its (prompt, response)
    scorer = ClassifierScorer(
        compose_config(
            ["reward_model.type=classifier", f"reward_model.classifier.path={classifier_model_dir}"]
        )["reward_model"]["classifier"]
    )
    samples = [row for step in (1, 2) for row in read_rows(run_dir, step)]
    # the samples are decoded with the special tokens, the texts scored without them (the engine's)
    prompts = [SPECIAL.sub("", row["prompt"]) for row in samples]
    responses = [SPECIAL.sub("", row["response"]) for row in samples]
    expected = [s["reward"] for s in scorer.score_batch(prompts, responses, [None] * len(samples))]
    assert [row["reward"] for row in samples] == pytest.approx(expected, abs=1e-4)
    assert len({round(row["reward"], 4) for row in samples}) > 1  # not a constant


def judge_args(*more: str) -> list[str]:
    return [
        "reward_model.type=judge",
        f'reward_model.judge.prompt_template="{RUBRIC}"',
        "reward_model.judge.max_retries=0",
        *more,
    ]


def test_mpi_run_scored_by_an_llm_judge_served_on_its_own_rank(tmp_path: Path, judge_model_dir: str) -> None:
    """The reward rank starts the judge's local engine server; every sample is graded 7/10."""
    run_dir = tmp_path / "judge"
    proc = run_mpi(
        run_dir,
        judge_args("reward_model.placement=own_ranks", f"reward_model.judge.model_path={judge_model_dir}"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_reward_rank(run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/reward_mean"] == pytest.approx(0.7)
        assert (r["reward/judge_errors"], r["reward/judge_parse_errors"], r["reward/errors"]) == (0, 0, 0)
    assert (run_dir / "logs" / "reward_service-judge.log").exists()


def test_a_judge_server_killed_mid_run_is_counted_not_fatal(tmp_path: Path, judge_model_dir: str) -> None:
    """A judge at base_url (started here), killed once step 1 is logged: later samples are skipped and
    counted (reward/judge_errors), the run trains every planned step and exits 0."""
    server = LocalInferenceServer(
        judge_model_dir,
        compose_config()["service"]["inference_service"]["local"],
        str(tmp_path / "logs"),
        "judge",
    )
    base_url = server.start()
    run_dir = tmp_path / "killed"
    killed = threading.Event()

    def kill_after_first_step() -> None:
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and train_rows(run_dir):
                server.kill()
                killed.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_first_step, daemon=True)
    watcher.start()
    try:
        proc = run_train(
            [
                f"run_dir={run_dir}",
                "seed=3",
                *FAST,
                *SMALL,
                "train_worker.total_train_steps=6",
                *judge_args(f"reward_model.judge.base_url={base_url}"),
            ],
            env={"NEXRL_JUDGE_API_KEY": server.api_key},
        )
    finally:
        server.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed.is_set()
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["train/reward_mean"] == pytest.approx(0.7) and rows[0]["reward/judge_errors"] == 0
    assert (
        rows[-1]["reward/judge_errors"] == 32 and rows[-1]["reward/skipped"] == 32
    )  # every sample of the step
    assert all(r["reward/errors"] == 0 for r in rows)  # no reward error: the judge's own count


def test_local_mode_serves_the_judge_from_an_in_process_reward_service(
    tmp_path: Path, judge_model_dir: str
) -> None:
    """launch_mode=local, placement=own_ranks: one reward service in the run's process starts the judge's
    server (logs/reward_service-judge.log) and stops it with the run."""
    run_dir = tmp_path / "local_judge"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "seed=3",
            *FAST,
            *SMALL,
            "train_worker.total_train_steps=2",
            *judge_args(
                "reward_model.placement=own_ranks", f"reward_model.judge.model_path={judge_model_dir}"
            ),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/reward_mean"] == pytest.approx(0.7) and r["reward/judge_errors"] == 0 for r in rows)
    assert (run_dir / "logs" / "reward_service-judge.log").exists()
    assert not processes_naming(str(run_dir))  # the judge's server (its ready file is under run_dir) is gone


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
