"""Verified delivery: every engine must compute with the trainer's published weights, or the run stops.

The pieces (the local server's prompt log-probs, the canary, the tolerance, the verifier) and whole
runs: a default run verifies every sync with ``weight_sync/*`` metrics on each step; an engine that
serves the previous version's weights under the new label stops the run on that step, exit 1,
naming the server and the version (local mode, and mpirun with two rollout ranks).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from nexrl_hpc.inference.engine import HFEngine
from nexrl_hpc.inference.openai_api import RequestLimits
from nexrl_hpc.inference.server import create_app
from nexrl_hpc.models.tiny import load_model, load_tokenizer
from nexrl_hpc.trainer.logprobs import response_log_probs
from nexrl_hpc.weight_sync.verify import (
    FP32_TOLERANCE,
    HALF_TOLERANCE,
    CanaryReference,
    WeightVerificationError,
    WeightVerifier,
    canary_batch,
    canary_prompts,
    engine_prompt_log_probs,
    max_abs_diff,
    verify_due,
    verify_tolerance,
)
from tests.conftest import REPO, compose_config, run_train
from tests.helpers.stale_engine import ENV, sitecustomize_dir

FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str) -> Iterator[HFEngine]:
    eng = HFEngine(tiny_model_dir, max_batch_size=8, batch_wait_ms=0.0, seed=0, stop_timeout_s=10.0)
    yield eng
    eng.stop()


def _ids(tiny_model_dir: str, texts: list[str]) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [list(tokenizer(t).input_ids) for t in texts]


def test_the_local_server_answers_prompt_logprobs_equal_to_the_trainers(
    engine: HFEngine, tiny_model_dir: str
) -> None:
    prompts = _ids(tiny_model_dir, ["max of 3 9 1 4:", "max of 7 2:"])
    app = create_app(engine, "policy", None, RequestLimits(max_n=8, max_prompts=8, max_body_bytes=1 << 20))
    with TestClient(app) as http:
        raw = http.post(
            "/v1/completions", json={"prompt": prompts[0], "max_tokens": 1, "prompt_logprobs": 0}
        ).json()
        scored = engine_prompt_log_probs(http, "http://testserver/v1", {}, "policy", prompts, 10.0)
    entries = raw["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompts[0])  # vLLM's shape: one per token
    assert list(entries[1]) == [str(prompts[0][1])]
    # the trainer's function on the canary's batch layout: the same numbers
    model = load_model(tiny_model_dir).eval()
    with torch.no_grad():
        trainer = response_log_probs(model, canary_batch(prompts))
    reference = [row[: len(p) - 1] for row, p in zip(trainer.tolist(), prompts)]
    assert [len(s) for s in scored] == [len(p) - 1 for p in prompts]
    assert max_abs_diff(reference, scored) <= FP32_TOLERANCE
    assert scored[0][0] == pytest.approx(entries[1][str(prompts[0][1])]["logprob"])


def test_a_long_prompt_is_scored_a_chunk_at_a_time_to_the_same_log_probs(
    engine: HFEngine, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nexrl_hpc.inference.engine as engine_module

    prompts = _ids(tiny_model_dir, ["max of 3 9 1 4 7 2 8 5 6 0:", "1 2"])
    whole = engine.prompt_log_probs(prompts)
    monkeypatch.setattr(engine_module, "PROMPT_LOGPROBS_CHUNK", 4)  # logits of 4 positions at a time
    chunked = engine.prompt_log_probs(prompts)
    assert [len(c) for c in chunked] == [len(p) - 1 for p in prompts]
    assert max_abs_diff(whole, chunked) <= 1e-5


def test_the_canary_is_the_first_validation_prompts_or_else_the_first_training_prompts(
    tmp_path: Path, tiny_model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = compose_config(["weight.verify_prompts=2"])
    tokenizer = load_tokenizer(tiny_model_dir)
    val, train = tmp_path / "val.jsonl", tmp_path / "train.jsonl"
    val.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ["max 3 4", "5 6", "x"]))
    train.write_text(json.dumps({"prompt": "max 1 2", "answer": "2"}) + "\n")
    # the first rows, in file order, as the rollout workers send them (BOS included)
    assert canary_prompts(cfg, tokenizer, [str(val)], [str(train)]) == _ids(
        tiny_model_dir, ["max 3 4", "5 6"]
    )
    with caplog.at_level(logging.INFO, logger="nexrl_hpc.weight_sync.verify"):
        assert canary_prompts(cfg, tokenizer, [], [str(train)]) == _ids(tiny_model_dir, ["max 1 2"])
    assert "no validation set" in caplog.text

    class OneToken:  # a prompt of one token has nothing to score after it
        def __call__(self, text: str) -> Any:
            return type("Encoding", (), {"input_ids": [5]})()

    with pytest.raises(ValueError, match="weight.verify_prompts: no prompt of 2 tokens or more"):
        canary_prompts(cfg, OneToken(), [str(val)], [])


def test_tolerance_follows_the_dtypes_unless_set_and_verify_every_picks_the_syncs() -> None:
    cfg = compose_config([])
    assert verify_tolerance(cfg) == FP32_TOLERANCE  # the CPU default: float32 on both sides
    half = copy.deepcopy(cfg)
    half["service"]["inference_service"]["backend"] = "vllm"
    half["service"]["inference_service"]["vllm"]["dtype"] = "bfloat16"
    assert verify_tolerance(half) == HALF_TOLERANCE == 1.0
    local_bf16 = copy.deepcopy(cfg)
    local_bf16["service"]["train_service"]["dtype"] = "bfloat16"  # the local engine computes in the trainer's
    assert verify_tolerance(local_bf16) == HALF_TOLERANCE
    half["weight"]["verify_tolerance"] = 0.03
    assert verify_tolerance(half) == 0.03
    assert [v for v in range(7) if verify_due(cfg, v)] == list(range(7))  # default: every sync
    cfg["weight"]["verify_every"] = 3
    assert [v for v in range(7) if verify_due(cfg, v)] == [0, 3, 6]
    cfg["weight"]["verify_every"] = 0
    assert not any(verify_due(cfg, v) for v in range(7))
    fake = compose_config(["service.inference_service.backend=fake"])
    assert not verify_due(fake, 0)  # no engine to score with


class _Service:
    def __init__(self, name: str, answer: Any):
        self.name, self.answer = name, answer

    def get_module_name(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"http://127.0.0.1:1/{self.name}"

    def score_canary(self, prompts: list[list[int]]) -> list[list[float]]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_the_verifier_names_each_engine_that_disagrees_with_the_version_and_the_size() -> None:
    verifier = WeightVerifier(compose_config([]))
    reference = CanaryReference(version=7, prompts=[[1, 2, 3], [4, 5]], log_probs=[[-1.0, -2.0], [-0.5]])
    good = _Service("inference_service_0", [[-1.0 + 3e-5, -2.0], [-0.5]])
    verifier.set_inference_services([good])
    assert verifier.verify(reference) == pytest.approx(3e-5)
    stale = _Service("inference_service_1", [[-1.0, -2.25], [-0.5]])
    dead = _Service("inference_service_2", ConnectionError("refused"))
    nan = _Service("inference_service_3", [[float("nan"), -2.0], [-0.5]])
    verifier.set_inference_services([good, stale, dead, nan])
    with pytest.raises(WeightVerificationError) as failed:
        verifier.verify(reference)
    message = str(failed.value)
    assert "weight version 7 failed verification" in message and "inference_service_0" not in message
    assert "inference_service_1 (http://127.0.0.1:1/inference_service_1)" in message
    assert "max |delta log p| = 0.25 over 3 canary tokens" in message
    assert "inference_service_2: the canary could not be scored (refused)" in message
    assert "inference_service_3" in message and "= nan" in message


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sync_rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in _rows(run_dir) if "weight_sync/seconds" in r}


def test_a_default_run_verifies_every_sync_and_logs_what_each_moved(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train([f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=3", *FAST], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    syncs = _sync_rows(run_dir)
    assert sorted(syncs) == [0, 1, 2, 3]  # the initial weights and every step's
    # weight.transport=broadcast (the default): the bytes the trainer sent, one copy of its weights
    from nexrl_hpc.checkpoint.hf import read_safetensors_dir

    model = read_safetensors_dir(str(run_dir / "checkpoints" / "global_step_3" / "model"))
    exported = sum(t.numel() * t.element_size() for t in model.values())
    assert not (run_dir / "weights").exists()
    for step, row in syncs.items():
        assert 0.0 <= row["weight_sync/verify_max_abs_diff"] <= FP32_TOLERANCE, (step, row)
        assert row["weight_sync/seconds"] > 0 and row["weight_sync/bytes"] == exported
        assert row["weight_sync/gbps"] == pytest.approx(exported * 8 / row["weight_sync/seconds"] / 1e9)


def _stale_env(tmp_path: Path, spec: str) -> dict[str, str]:
    site = sitecustomize_dir(tmp_path)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), ENV: spec}


def _failure(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1, status
    failed = [line for line in proc.stderr.splitlines() if "run failed" in line]
    assert failed and "failed verification" in failed[-1], proc.stderr[-3000:]
    assert "failed verification" in status["reason"]
    return str(status["reason"])


def test_an_engine_serving_the_old_weights_under_the_new_label_stops_the_run_on_that_step(
    tmp_path: Path,
) -> None:
    """The server reloads version 1's export when told to serve version 2, and reports version 2."""
    run_dir = tmp_path / "run"
    env = _stale_env(tmp_path, "2")
    proc = run_train(
        [f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=4", *FAST], timeout=600, env=env
    )
    reason = _failure(proc, run_dir)
    assert (
        "weight version 2 failed verification" in reason and "inference_service (http://127.0.0.1:" in reason
    )
    assert "over weight.verify_tolerance = 0.0001" in reason
    assert sorted(_sync_rows(run_dir)) == [0, 1]  # versions 0 and 1 verified; 2 caught, nothing after
    assert max(r["step"] for r in _rows(run_dir) if "train/loss" in r) == 2


@pytest.mark.e2e
def test_under_mpirun_the_one_stale_rollout_rank_is_named(tmp_path: Path) -> None:
    """mpirun -n 4: driver, trainer, two rollout ranks; rank 3's engine (inference_service_1) keeps
    version 1's weights at version 2. Both engines pass versions 0 and 1; version 2 names rank 3's."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, **_stale_env(tmp_path, "2:3"))
    args = [f"run_dir={run_dir}", "seed=3", "train_worker.total_train_steps=4", *FAST]
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "launch.train", "launch_mode=mpi", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    reason = _failure(proc, run_dir)
    assert "weight version 2 failed verification: inference_service_1 (http://" in reason, reason
    assert "inference_service_0" not in reason
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert "inference_service_1" in ranks[3]["modules"]
    syncs = _sync_rows(run_dir)
    assert sorted(syncs) == [0, 1]
    assert all(r["weight_sync/verify_max_abs_diff"] <= FP32_TOLERANCE for r in syncs.values())


@pytest.mark.e2e
def test_under_mpirun_fully_async_every_version_is_verified_on_both_rollout_ranks(tmp_path: Path) -> None:
    """mpirun -n 4, fully-async: the trainer rank's canary log-probs are taken while the next batch
    may already be queued behind the update (the trainer group answers in order), and every
    version's sync passes on both engines."""
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        "seed=3",
        "weight.sync_mode=fully-async",
        "train_worker.total_train_steps=4",
        *FAST,
    ]
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "launch.train", "launch_mode=mpi", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    syncs = _sync_rows(run_dir)
    assert sorted(syncs) == [0, 1, 2, 3, 4]
    assert all(r["weight_sync/verify_max_abs_diff"] <= FP32_TOLERANCE for r in syncs.values()), syncs
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else proc.stderr
    assert log.count("verified on 2 engine(s)") >= 5
