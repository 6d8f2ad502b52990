"""Issue 21, rows 11 and 13: state that cannot be trusted is not trusted, and others cannot read it.

Row 11: ``COMPLETE`` used to prove only that a save got to its end; a damaged ``state.h5`` in the
newest checkpoint made every requeue of the job crash on it. Row 13: checkpoints, weights and logs
were world-readable (umask 022), and the train API server's schema and docs answered without the
token.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from nexrl_hpc.checkpoint.digest import SIDECAR, hash_file, write_sidecar
from nexrl_hpc.checkpoint.hf import write_hf_model_dir
from nexrl_hpc.checkpoint.manager import (
    CheckpointManager,
    capture_rng_state,
    find_latest_checkpoint,
    find_resume_checkpoint,
)
from nexrl_hpc.checkpoint.state_file import load_state_file, save_state_file
from nexrl_hpc.trainer.api_server import create_app
from tests.conftest import run_train, wire_limits
from tests.test_mpi import FAST, metrics


def _save(manager: CheckpointManager, step: int, tiny_model_dir: str) -> str:
    """A checkpoint as the trainer writes one: HF weights and an optimizer state file, both hashed
    as written (sidecars), then state.h5 and COMPLETE by the manager."""

    def save_model(root: str) -> None:
        weights = {"w": torch.full((64, 64), float(step)), "b": torch.arange(64, dtype=torch.bfloat16)}
        write_hf_model_dir(weights, tiny_model_dir, os.path.join(root, "model"), 1 << 30, sidecars=True)
        os.makedirs(os.path.join(root, "optimizer"))
        opt = os.path.join(root, "optimizer", "rank_0.safetensors")
        write_sidecar(opt, *save_state_file({"exp_avg": torch.randn(1000), "step": step}, opt))

    state = {
        "global_step": step,
        "weight_version": {"default": step},
        "dataloader": {},
        "rng": capture_rng_state(),
    }
    return manager.save(step, save_model, state)


def test_complete_records_every_file_with_its_digest(tmp_path: Path, tiny_model_dir: str) -> None:
    path = Path(_save(CheckpointManager(str(tmp_path), None), 2, tiny_model_dir))
    record = json.loads((path / "COMPLETE").read_text())
    assert record["step"] == 2 and record["algorithm"] == "xxh3_128"
    on_disk = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "COMPLETE"
    )
    assert sorted(record["files"]) == on_disk  # every file, no sidecar left behind
    assert not any(name.endswith(SIDECAR) for name in on_disk)
    assert {
        "state.h5",
        "model/model.safetensors",
        "optimizer/rank_0.safetensors",
        "model/config.json",
    } <= set(on_disk)
    for rel, entry in record["files"].items():  # the writers' digests are those of the bytes on disk
        assert hash_file(str(path / rel)) == (entry["xxh3_128"], entry["size"]), rel
    loaded = load_state_file(str(path / "optimizer" / "rank_0.safetensors"))
    assert loaded["step"] == 2 and loaded["exp_avg"].shape == (1000,)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("bitflip_weights", "model/model.safetensors does not match its digest"),
        ("truncate_state", "state.h5 has"),
        ("zero_state_header", "state.h5 does not match its digest"),
        ("remove_optimizer", "optimizer/rank_0.safetensors is missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, tiny_model_dir: str, caplog: pytest.LogCaptureFixture, damage: str, named: str
) -> None:
    manager = CheckpointManager(str(tmp_path), None)
    _save(manager, 2, tiny_model_dir)
    newest = Path(_save(manager, 4, tiny_model_dir))
    if damage == "bitflip_weights":
        with open(newest / "model" / "model.safetensors", "r+b") as f:
            f.seek(8000)
            byte = f.read(1)
            f.seek(8000)
            f.write(bytes([byte[0] ^ 0x01]))
    elif damage == "truncate_state":
        os.truncate(newest / "state.h5", 100)
    elif damage == "zero_state_header":
        with open(newest / "state.h5", "r+b") as f:
            f.write(b"\0" * 512)
    else:
        os.unlink(newest / "optimizer" / "rank_0.safetensors")
    assert find_latest_checkpoint(str(tmp_path)) == str(newest)  # complete, as far as the marker goes
    with caplog.at_level(logging.WARNING, logger="nexrl_hpc.checkpoint.manager"):
        assert find_resume_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_2")
    assert any(str(newest) in r.message and named in r.message for r in caplog.records), caplog.text


def test_a_checkpoint_of_an_older_version_is_trusted_as_before(tmp_path: Path, tiny_model_dir: str) -> None:
    path = Path(_save(CheckpointManager(str(tmp_path), None), 2, tiny_model_dir))
    (path / "COMPLETE").write_text("2\n")  # what earlier versions wrote
    assert find_resume_checkpoint(str(tmp_path)) == str(path)


@pytest.mark.e2e
def test_a_run_resumes_from_the_previous_checkpoint_and_its_files_are_private(tmp_path: Path) -> None:
    """The whole path: a real run, its newest state.h5 damaged, the same command run again."""
    os.chmod(tmp_path, 0o755)
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        "service.inference_service.backend=fake",
        "data.batch_size=4",
        "train_worker.save_freq=1",
        "logger.dump_rollouts=false",
        *FAST,
    ]
    first = run_train([*args, "train_worker.total_train_steps=2"], timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run_dir / "checkpoints"
    with open(ckpt / "global_step_2" / "state.h5", "r+b") as f:
        f.write(b"\0" * 512)  # h5py can no longer open it: every resume crashed here
    second = run_train([*args, "train_worker.total_train_steps=3"], timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert f"checkpoint {ckpt / 'global_step_2'} skipped: state.h5 does not match its digest" in log
    assert f"resumed at step 1 from {ckpt / 'global_step_1'}" in log
    steps = [r["step"] for r in metrics(run_dir) if "train/reward_mean" in r]
    assert steps == [1, 2, 3]  # step 2 redone (its first record replaced), then step 3
    # row 13: runtime.umask=077 (the default): the run dir and everything in it are the user's alone
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    for path in [ckpt, *ckpt.rglob("*"), run_dir / "metrics.jsonl", run_dir / "config.yaml"]:
        assert not os.stat(path).st_mode & 0o077, f"{path} is {oct(stat.S_IMODE(os.stat(path).st_mode))}"


def test_train_api_server_schema_and_docs_need_the_token() -> None:
    client = TestClient(create_app("t0ken", 5.0, 5.0, 1 << 20, wire_limits()))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer t0ken"}).status_code == 200
    schema = client.get("/openapi.json", headers={"Authorization": "Bearer t0ken"}).json()
    assert "/register_worker_group" in schema["paths"]
