"""Every checkpoint of a run damaged: the run refuses to start over silently (exit 1 naming them and
why), and no save deletes a damaged checkpoint's files (its weights may be intact): a resume moves
the ones it skips into ``checkpoints/set_aside/``, where no later save or retention touches them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pytest

from nexrl_hpc.checkpoint.digest import hash_file
from nexrl_hpc.checkpoint.manager import (
    SET_ASIDE,
    CheckpointManager,
    NoTrustedCheckpoint,
    checkpoint_to_resume,
    complete_checkpoints,
    find_resume_checkpoint,
)
from nexrl_hpc.config.schema import ResumeConfig
from tests.conftest import run_train
from tests.test_hostile_state import _save
from tests.test_mpi import FAST, metrics


def _digests(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): hash_file(str(p)) for p in sorted(root.rglob("*")) if p.is_file()}


def _damage_state(path: Path) -> None:
    with open(path / "state.h5", "r+b") as f:
        f.write(b"\0" * 512)


def _damage_weights(path: Path) -> None:
    os.truncate(path / "model" / "model.safetensors", 1000)


def _auto(when_all_damaged: Literal["fail", "start_over"] = "fail") -> ResumeConfig:
    return {"mode": "auto", "resume_path": None, "when_all_damaged": when_all_damaged}


def test_every_checkpoint_damaged_is_refused_naming_each_and_nothing_moves(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    manager = CheckpointManager(str(tmp_path), None)
    old, new = (Path(_save(manager, s, tiny_model_dir)) for s in (2, 4))
    _damage_weights(old)
    _damage_state(new)
    before = _digests(tmp_path)
    with pytest.raises(NoTrustedCheckpoint) as err:
        checkpoint_to_resume(_auto(), str(tmp_path))
    message = str(err.value)
    assert f"none of the 2 complete checkpoint(s) in {tmp_path} can be trusted" in message
    assert f"{new}: state.h5 does not match its digest" in message
    assert f"{old}: model/model.safetensors has 1000 bytes" in message
    assert "resume.when_all_damaged=start_over" in message
    assert _digests(tmp_path) == before  # every file where it was, unchanged
    assert complete_checkpoints(str(tmp_path)) == [str(new), str(old)]


def test_start_over_sets_every_damaged_checkpoint_aside_with_its_files(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    manager = CheckpointManager(str(tmp_path), None)
    old, new = (Path(_save(manager, s, tiny_model_dir)) for s in (2, 4))
    _damage_state(old)
    _damage_state(new)
    kept = {name: _digests(p) for name, p in (("global_step_2", old), ("global_step_4", new))}
    assert checkpoint_to_resume(_auto("start_over"), str(tmp_path)) is None
    aside = tmp_path / SET_ASIDE
    assert sorted(os.listdir(aside)) == ["global_step_2", "global_step_4"]
    assert {name: _digests(aside / name) for name in kept} == kept
    assert complete_checkpoints(str(tmp_path)) == []
    # the fresh run's saves (same steps, retention 1) leave them alone
    manager.max_to_keep = 1
    for step in (2, 4, 6):
        _save(manager, step, tiny_model_dir)
    assert {name: _digests(aside / name) for name in kept} == kept
    assert complete_checkpoints(str(tmp_path)) == [str(tmp_path / "global_step_6")]


def test_a_skipped_checkpoint_is_set_aside_and_survives_the_save_of_its_step(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    manager = CheckpointManager(str(tmp_path), None)
    good, bad = (Path(_save(manager, s, tiny_model_dir)) for s in (2, 4))
    _damage_weights(bad)
    kept = _digests(bad)
    assert find_resume_checkpoint(str(tmp_path)) == str(good)
    assert _digests(tmp_path / SET_ASIDE / "global_step_4") == kept
    manager.max_to_keep = 1
    _save(manager, 4, tiny_model_dir)  # the resumed run saves that step again
    _save(manager, 4, tiny_model_dir)  # twice (a preemption save right after a periodic one)
    assert _digests(tmp_path / SET_ASIDE / "global_step_4") == kept
    assert complete_checkpoints(str(tmp_path)) == [str(tmp_path / "global_step_4")]
    _damage_state(tmp_path / "global_step_4")  # damaged again, nothing older left: refused
    with pytest.raises(NoTrustedCheckpoint):
        find_resume_checkpoint(str(tmp_path))
    assert find_resume_checkpoint(str(tmp_path), start_over=True) is None
    assert sorted(os.listdir(tmp_path / SET_ASIDE)) == ["global_step_4", "global_step_4.1"]


@pytest.mark.e2e
def test_a_run_whose_checkpoints_are_all_damaged_exits_1_and_starts_over_only_when_asked(
    tmp_path: Path,
) -> None:
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
    _damage_state(ckpt / "global_step_2")
    _damage_weights(ckpt / "global_step_1")
    before = _digests(ckpt)

    refused = run_train([*args, "train_worker.total_train_steps=3"], timeout=600)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "none of the 2 complete checkpoint(s)" in refused.stderr
    assert f"{ckpt / 'global_step_2'}: state.h5 does not match its digest" in refused.stderr
    assert f"{ckpt / 'global_step_1'}: model/model.safetensors has 1000 bytes" in refused.stderr
    assert _digests(ckpt) == before
    assert [r["step"] for r in metrics(run_dir) if "train/reward_mean" in r] == [1, 2]  # nothing redone

    fresh = run_train(
        [*args, "train_worker.total_train_steps=3", "resume.when_all_damaged=start_over"], timeout=600
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resumed at step" not in fresh.stdout + fresh.stderr
    for step in (1, 2):
        name = f"global_step_{step}"
        assert _digests(ckpt / SET_ASIDE / name) == {
            k.removeprefix(f"{name}/"): v for k, v in before.items() if k.startswith(f"{name}/")
        }
    assert complete_checkpoints(str(ckpt)) == [str(ckpt / f"global_step_{s}") for s in (3, 2, 1)]
