"""CheckpointManager: what a save killed at any point leaves behind is never resumed from, and is
cleaned up (or put back) by the next save; pruning never removes the newest complete checkpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.checkpoint import manager as mgr
from nexrl_hpc.checkpoint.hf import WritebackKicker, read_safetensors_dir, write_safetensors
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


def test_sharded_write_and_read_back(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.weight": torch.full((256,), float(i)) for i in range(10)}
    paths = write_safetensors(tensors, str(tmp_path), max_shard_bytes=3 * 1024)
    assert len(paths) == 5 and paths[-1].endswith("model.safetensors.index.json")
    back = read_safetensors_dir(str(tmp_path))
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_writeback_kicker_leaves_what_is_written_intact(tmp_path: Path) -> None:
    """The kicker fadvises files while they are written (here: between appends); content and size
    are exactly what was written, and the thread is gone after the block."""
    path = tmp_path / "sub" / "f.bin"
    path.parent.mkdir()
    chunks = [bytes([i]) * (1 << 20) for i in range(8)]
    with WritebackKicker(str(tmp_path), interval_s=0.001) as kicker, open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            f.flush()
            time.sleep(0.005)
    assert not kicker._thread.is_alive()
    assert path.read_bytes() == b"".join(chunks)
