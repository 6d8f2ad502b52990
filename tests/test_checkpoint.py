"""CheckpointManager: what a save killed at any point leaves behind is never resumed from, and is
cleaned up (or put back) by the next save; pruning never removes the newest complete checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.checkpoint import manager as mgr
from nexrl_hpc.checkpoint.manager import (
    CheckpointManager,
    capture_rng_state,
    find_latest_checkpoint,
    read_state_h5,
)


def state(step: int) -> dict[str, Any]:
    return {"global_step": step, "weight_version": {"m": step}, "dataloader": {}, "rng": capture_rng_state()}


def write_model(d: str) -> None:
    os.makedirs(os.path.join(d, "model"))
    Path(d, "model", "model.safetensors").write_bytes(b"x" * 16)


def entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_save_layout_latest_and_keep_last_k(tmp_path: Path) -> None:
    cm = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (2, 4, 6):
        cm.save(step, write_model, state(step))
    assert entries(tmp_path) == ["global_step_4", "global_step_6", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "global_step_6"
    assert cm.latest() == str(tmp_path / "global_step_6")
    assert read_state_h5(str(tmp_path / "global_step_6" / "state.h5"))["global_step"] == 6


def test_a_save_killed_before_complete_is_ignored_and_its_leftovers_removed_by_the_next(
    tmp_path: Path,
) -> None:
    cm = CheckpointManager(str(tmp_path), max_to_keep=1)
    cm.save(2, write_model, state(2))
    # killed while writing (temp dir) and killed after the rename but before COMPLETE (step dir)
    (tmp_path / ".tmp-global_step_4-99999" / "model").mkdir(parents=True)
    (tmp_path / "global_step_6" / "model").mkdir(parents=True)
    (tmp_path / ".latest.tmp-99999").write_text("global_step_6\n")
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_2")
    cm.save(4, write_model, state(4))
    assert entries(tmp_path) == ["global_step_4", "latest"]


def test_a_failing_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    cm = CheckpointManager(str(tmp_path), max_to_keep=1)
    cm.save(2, write_model, state(2))

    def broken(d: str) -> None:
        write_model(d)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cm.save(4, broken, state(4))
    assert cm.latest() == str(tmp_path / "global_step_2")
    assert (tmp_path / "latest").read_text().strip() == "global_step_2"


def test_saving_a_step_again_never_leaves_it_without_a_complete_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-saving a step used to rmtree the complete one before the new one was in place; now it is
    moved aside by a rename, and a writer killed right after that rename is recovered from."""
    cm = CheckpointManager(str(tmp_path), max_to_keep=1)
    cm.save(2, write_model, state(2))
    real_replace = os.replace
    calls = []

    def killed_after_moving_aside(src: str, dst: str) -> None:
        calls.append((src, dst))
        real_replace(src, dst)
        if os.path.basename(dst).startswith(".old-"):
            raise KeyboardInterrupt  # stands in for SIGKILL: nothing after this runs

    monkeypatch.setattr(mgr.os, "replace", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        cm.save(2, write_model, state(2))
    monkeypatch.setattr(mgr.os, "replace", real_replace)
    old = [n for n in entries(tmp_path) if n.startswith(".old-")]
    assert len(old) == 1 and "global_step_2" not in entries(tmp_path)
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / old[0])  # still resumable
    # the next save puts it back, then goes on
    cm.save(3, write_model, state(3))
    assert entries(tmp_path) == ["global_step_3", "latest"]
    cm2 = CheckpointManager(str(tmp_path), max_to_keep=2)
    cm2.save(3, write_model, state(3))  # an uninterrupted re-save: replaced, nothing left aside
    assert entries(tmp_path) == ["global_step_3", "latest"]


def test_an_old_copy_is_restored_when_its_replacement_never_completed(tmp_path: Path) -> None:
    cm = CheckpointManager(str(tmp_path), max_to_keep=None)
    cm.save(2, write_model, state(2))
    os.replace(tmp_path / "global_step_2", tmp_path / ".old-global_step_2-123")
    (tmp_path / "global_step_2" / "model").mkdir(parents=True)  # the replacement, without COMPLETE
    cm.save(4, write_model, state(4))
    assert entries(tmp_path) == ["global_step_2", "global_step_4", "latest"]
    assert mgr.is_complete(str(tmp_path / "global_step_2"))


def test_pruning_removes_complete_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune cut short must not leave a half-deleted directory that still says COMPLETE."""
    cm = CheckpointManager(str(tmp_path), max_to_keep=1)
    cm.save(2, write_model, state(2))
    removed: list[str] = []
    monkeypatch.setattr(mgr.shutil, "rmtree", lambda p, ignore_errors=False: removed.append(p))
    cm.save(4, write_model, state(4))
    assert removed == [str(tmp_path / "global_step_2")]
    assert not mgr.is_complete(str(tmp_path / "global_step_2"))
    assert find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_4")
