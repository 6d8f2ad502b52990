"""Admission has one owner: the rollout scheduler writes the dispatch budget and answers for the pool."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
from nexrl_hpc.scheduler.rollout_scheduler import RolloutScheduler
from tests.conftest import compose_config

PACKAGE = Path(__file__).resolve().parents[1] / "nexrl_hpc"


class Loader:
    """The data loader as the scheduler and the pool call it."""

    def __init__(self) -> None:
        self.budget: int | None = None
        self.released: list[str] = []

    def set_dispatch_budget(self, budget: int | None) -> None:
        self.budget = budget

    def add_dispatch_budget(self, items: int) -> None:
        self.budget = (self.budget or 0) + items

    def num_untrained(self) -> int:
        return 0

    def release_items(self, keys: list[str]) -> None:
        self.released.extend(keys)


def wired(tmp_path: Path, *overrides: str) -> tuple[RolloutScheduler, TrajectoryPool, Loader]:
    cfg = compose_config([f"run_dir={tmp_path}", "data.batch_size=1", "data.rollout_repeat_n=2", *overrides])
    scheduler, pool, loader = RolloutScheduler(cfg), TrajectoryPool(cfg), Loader()
    scheduler.set_module_references(loader, pool)  # type: ignore[arg-type]
    pool.set_module_references(loader, scheduler)  # type: ignore[arg-type]
    return scheduler, pool, loader


def trajectory(i: int, group: str, reward: float) -> dict[str, Any]:
    return {"group_id": group, "uid": group, "epoch": 0, "sample_index": i, "reward": reward}


def test_only_the_scheduler_writes_the_dispatch_budget() -> None:
    writers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"\.(set|add)_dispatch_budget\b", path.read_text())
    )
    assert writers == ["scheduler/rollout_scheduler.py"]


def _imported(folder: str) -> set[str]:
    """The package modules ``folder``'s files import (``TYPE_CHECKING`` imports included)."""
    found: set[str] = set()
    for path in (PACKAGE / folder).rglob("*.py"):
        found.update(re.findall(r"^\s*(?:from|import) (nexrl_hpc\.[\w.]+)", path.read_text(), re.M))
    return found


def test_the_pool_and_the_weight_sync_do_not_know_each_other() -> None:
    """The pool talks to the scheduler; the weight sync moves data and calls neither."""
    assert not [m for m in _imported("pool") if m.startswith("nexrl_hpc.weight_sync")]
    assert not [
        m for m in _imported("weight_sync") if m.startswith(("nexrl_hpc.pool", "nexrl_hpc.scheduler"))
    ]


def test_a_filtered_group_is_replaced_through_the_scheduler(tmp_path: Path) -> None:
    scheduler, pool, loader = wired(
        tmp_path, "algorithm.filter_groups.enable=true", "train_worker.total_train_steps=3"
    )
    scheduler.start("default")
    assert loader.budget == 2  # one batch: one group of two
    for i in range(2):
        assert pool.put_trajectory(trajectory(i, "a", 1.0)) == "success"
    assert loader.released == ["a#0", "a#1"] and loader.budget == 4  # the dull group's two tasks again


@pytest.mark.parametrize("mode", ["sync", "fully-async", "batch-async"])
def test_only_sync_mode_sends_stragglers_back_until_the_next_release(tmp_path: Path, mode: str) -> None:
    scheduler, pool, _ = wired(tmp_path, f"weight.sync_mode={mode}", "train_worker.total_train_steps=3")
    scheduler.start("default")
    for i in range(2):
        assert pool.put_trajectory(trajectory(i, "a", float(i))) == "success"
    late = pool.put_trajectory(trajectory(0, "b", 0.0))
    assert late == ("re-rollout" if mode == "sync" else "success")
    assert pool.get_batch() is not None
    scheduler.train_worker_notify_weight_update("train_worker", "default", 1)  # releases the next batch
    assert pool.put_trajectory(trajectory(1, "b", 1.0)) == "success"
