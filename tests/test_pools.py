"""Trajectory stores (release rules per type), pool return codes and model tags, train batch queues."""

from __future__ import annotations

from typing import Any

import pytest

from nexrl_hpc.pool.stores import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    create_store,
)
from nexrl_hpc.pool.train_batch_pool import TrainBatchPool
from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
from nexrl_hpc.types import Batch
from tests.conftest import compose_config


def traj(i: int, group: str = "g", **kw: Any) -> dict[str, Any]:
    return {"i": i, "group_id": group, **kw}


def test_store_type_follows_key_list() -> None:
    assert isinstance(create_store([], 4), SimpleTrajectoryStore)
    assert isinstance(create_store(["group_id"], 4), GroupedTrajectoryStore)
    assert isinstance(create_store(["user", "session"], 4), HierarchicalTrajectoryStore)


def test_simple_store_releases_each_trajectory_immediately() -> None:
    store = SimpleTrajectoryStore()
    assert store.add(traj(0)) == "success"
    assert store.num_ready() == 1 and store.num_pending() == 0
    store.add(traj(1))
    store.add(traj(2))
    assert [t["i"] for t in store.take(2)] == [0, 1]
    assert [t["i"] for t in store.take(5)] == [2]
    assert store.is_empty()


def test_grouped_store_releases_only_complete_groups_and_never_splits_them() -> None:
    store = GroupedTrajectoryStore("group_id", group_size=3)
    for i in range(2):
        store.add(traj(i, "a"))
    store.add(traj(10, "b"))
    assert store.num_ready() == 0 and store.num_pending() == 3
    assert store.take(10) == []
    store.add(traj(2, "a"))  # completes group a
    assert store.num_ready() == 3 and store.num_pending() == 1
    assert store.pending_groups() == {"b": 1}
    assert store.take(2) == []  # 2 < group size: a group is never split
    assert [t["i"] for t in store.take(3)] == [0, 1, 2]
    assert store.add({"i": 5}) == "fail"  # no grouping key


def test_grouped_store_batches_whole_groups_in_completion_order() -> None:
    store = GroupedTrajectoryStore("group_id", group_size=2)
    for g in ("x", "y", "z"):
        store.add(traj(0, g))
    for g in ("z", "x", "y"):
        store.add(traj(1, g))
    out = store.take(4)
    assert [t["group_id"] for t in out] == ["z", "z", "x", "x"]
    assert [t["group_id"] for t in store.take(4)] == ["y", "y"]


def test_hierarchical_store_releases_leaf_groups_and_prunes() -> None:
    store = HierarchicalTrajectoryStore(["user", "session"], group_size=2)
    store.add({"user": "u1", "session": "s1", "i": 0})
    store.add({"user": "u1", "session": "s2", "i": 1})
    store.add({"user": "u2", "session": "s1", "i": 2})
    assert store.pending_groups() == {("u1", "s1"): 1, ("u1", "s2"): 1, ("u2", "s1"): 1}
    assert store.num_ready() == 0
    store.add({"user": "u1", "session": "s2", "i": 3})
    assert store.num_ready() == 2
    assert store.pending_groups() == {("u1", "s1"): 1, ("u2", "s1"): 1}
    assert [t["i"] for t in store.take(2)] == [1, 3]
    store.add({"user": "u2", "session": "s1", "i": 4})
    store.add({"user": "u1", "session": "s1", "i": 5})
    assert store.pending_groups() == {} and store.num_pending() == 0
    assert store.add({"user": "u3", "i": 6}) == "fail"  # missing a level key


class RecordingWSC:
    """The rollout scheduler as the pool calls it: records batch-ready events, never closes the pool."""

    def __init__(self) -> None:
        self.ready: list[str] = []
        self.loader: Any = None  # where a refill's dispatch budget goes (the scheduler writes the loader's)

    def on_batch_ready(self, model_tag: str) -> bool:
        self.ready.append(model_tag)
        return False

    def replace_filtered_tasks(self, count: int) -> None:
        if self.loader is not None:
            self.loader.add_dispatch_budget(count)


def make_pool(**overrides: Any) -> tuple[TrajectoryPool, RecordingWSC]:
    cfg = compose_config([f"{k}={v}" for k, v in overrides.items()])
    pool = TrajectoryPool(cfg)
    wsc = RecordingWSC()
    pool.set_module_references(None, wsc)
    return pool, wsc


def test_pool_return_codes_and_batch_release() -> None:
    pool, wsc = make_pool(**{"data.batch_size": 2, "data.rollout_repeat_n": 2})
    assert pool.get_batch() is None
    assert pool.put_trajectory(traj(0, "a")) == "success"
    assert pool.put_trajectory({"i": 1}) == "fail"  # no group key
    pool.put_trajectory(traj(1, "a"))
    pool.put_trajectory(traj(2, "b"))
    assert pool.get_batch() is None and wsc.ready == []
    pool.put_trajectory(traj(3, "b"))
    assert wsc.ready == ["default"]  # batch_size (4 trajectories) reached
    pool.refuse_trajectories("default")
    assert pool.put_trajectory(traj(4, "c")) == "re-rollout"
    batch = pool.get_batch()
    assert isinstance(batch, Batch) and len(batch) == 4
    assert batch.values["i"] == [0, 1, 2, 3] and batch.metadata["model_tag"] == "default"
    pool.accept_trajectories("default")
    assert pool.put_trajectory(traj(4, "c")) == "success"
    assert not pool.is_empty()


def test_pool_keeps_one_instance_per_model_tag() -> None:
    pool, wsc = make_pool(
        **{
            "data.batch_size": 1,
            "data.rollout_repeat_n": 1,
            "algorithm.adv_estimator": "reinforce_pp",  # one sample per prompt: no group estimator
            "trajectory_pool.key_list": "[]",
        }
    )
    pool.put_trajectory({"i": 0, "model_tag": "student"})
    pool.put_trajectory({"i": 1})
    assert sorted(pool.get_model_tags()) == ["default", "student"]
    assert sorted(wsc.ready) == ["default", "student"]
    assert pool.get_batch(model_tag="teacher") is None
    assert pool.get_batch(model_tag="student").values["i"] == [0]
    assert pool.is_empty("student") and not pool.is_empty()
    assert pool.get_batch_any().values["i"] == [1]
    assert pool.is_empty()


def test_loaded_batch_finished_rule_waits_for_the_loader_and_rollouts() -> None:
    class Loader:
        more = True

        def can_return_item(self) -> bool:
            return self.more

    class Tracker:
        quiet = False

        def is_rollout_worker_quiescent(self) -> bool:
            return self.quiet

    pool, _ = make_pool(**{"trajectory_pool.check_batch_ready_function": "loaded_batch_finished"})
    loader, tracker = Loader(), Tracker()
    pool.set_module_references(loader, RecordingWSC())
    pool.set_activity_tracker(tracker)  # type: ignore[arg-type]
    for i in range(8):
        pool.put_trajectory(traj(i, "a"))
    assert pool.get_batch() is None  # loader can still hand out items
    loader.more = False
    assert pool.get_batch() is None  # a rollout is still in flight
    tracker.quiet = True
    assert len(pool.get_batch()) == 8  # everything loaded is back: released though < batch_size


def test_custom_batch_ready_function() -> None:
    pool, _ = make_pool(
        **{"trajectory_pool.check_batch_ready_function": "tests.test_pools:ready_at_two_groups"}
    )
    for g in ("a", "b"):
        for i in range(8):
            pool.put_trajectory(traj(i, g))
    assert len(pool.get_batch(batch_size=16)) == 16


def ready_at_two_groups(num_ready: int, num_pending: int, batch_size: int) -> bool:
    return num_ready >= 16


def test_train_batch_pool_per_model_queues_and_back_pressure() -> None:
    cfg = compose_config(["train_batch_pool.max_queue_size=2"])
    pool = TrainBatchPool(cfg)
    b = lambda tag, v: Batch(values={"x": [v]}, metadata={"model_tag": tag})  # noqa: E731
    assert pool.is_empty()
    assert pool.put_batch(b("default", 1))
    assert pool.put_batch(b("default", 2))
    assert not pool.put_batch(b("default", 3))  # full
    assert pool.put_batch(b("teacher", 9))
    assert pool.get_batch("teacher").values["x"] == [9]
    assert pool.get_batch("teacher") is None
    first = pool.get_batch()
    assert first.values["x"] == [1]
    assert pool.get_batch().values["x"] == [2]
    assert pool.is_empty()


@pytest.mark.parametrize("n", [0, 3])
def test_batch_from_and_to_trajectories(n: int) -> None:
    trajs = [{"a": i, "b": str(i)} for i in range(n)]
    batch = Batch.from_trajectories(trajs, {"model_tag": "m"})
    assert len(batch) == n
    assert batch.to_trajectories() == trajs
    assert batch.to_dict()["model_tag"] == "m"


def test_batch_strips_padding_shared_by_all_rows() -> None:
    import torch

    ids = torch.tensor([[0, 0, 5, 6, 0], [0, 7, 8, 0, 0]])
    mask = (ids != 0).long()
    batch = Batch(values={"input_ids": ids, "attention_mask": mask}, metadata={"model_tag": "m"})
    left = Batch.remove_redundant_left_padding(batch, 0, ["input_ids", "attention_mask"])
    assert left.values["input_ids"].tolist() == [[0, 5, 6, 0], [7, 8, 0, 0]]
    both = Batch.remove_redundant_right_padding(left, 0, ["input_ids", "attention_mask"])
    assert both.values["input_ids"].tolist() == [[0, 5, 6], [7, 8, 0]] and both.metadata == {
        "model_tag": "m",
        "batch_size": 2,
    }
    capped = Batch.remove_redundant_left_padding(batch, 0, ["input_ids"], max_strip_threshold=0)
    assert capped.values["input_ids"].shape == (2, 5)


def test_pool_ignores_a_sample_it_already_has() -> None:
    pool, _ = make_pool(**{"data.batch_size": 1, "data.rollout_repeat_n": 2})
    t = {"group_id": "a@0", "uid": "a", "epoch": 0, "sample_index": 0}
    assert pool.put_trajectory(dict(t)) == "success"
    assert pool.put_trajectory(dict(t)) == "success"  # re-issued task (its worker died after putting it)
    assert pool.get_batch() is None  # still one of two samples: the duplicate was not stored
    assert pool.put_trajectory(dict(t, sample_index=1)) == "success"
    assert len(pool.get_batch()) == 2


class RecordingLoader:
    """The data loader calls the pool's group filter makes."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.budget = 0

    def release_items(self, keys: list[str]) -> None:
        self.released.extend(keys)

    def add_dispatch_budget(self, items: int) -> None:
        self.budget += items


def scored(i: int, group: str, reward: float) -> dict[str, Any]:
    return {"i": i, "group_id": group, "uid": group, "epoch": 0, "sample_index": i % 2, "reward": reward}


def test_dynamic_sampling_drops_zero_variance_groups_and_refills_until_the_cap() -> None:
    pool, wsc = make_pool(
        **{
            "data.batch_size": 1,
            "data.rollout_repeat_n": 2,
            "algorithm.filter_groups.enable": "true",
            "algorithm.filter_groups.max_num_gen_batches": 3,
        }
    )
    loader = RecordingLoader()
    wsc.loader = loader
    pool.set_module_references(loader, wsc)  # type: ignore[arg-type]
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 1.0), ("b", 0.0), ("b", 0.0)]):
        assert pool.put_trajectory(scored(i, group, reward)) == "success"
    # two all-equal groups: dropped, their tasks consumed, two tasks each handed out in their place
    assert pool.get_batch() is None and wsc.ready == []
    assert loader.released == ["a#0", "a#1", "b#0", "b#1"] and loader.budget == 4
    pool.put_trajectory(scored(4, "c", 1.0))
    pool.put_trajectory(scored(5, "c", 0.0))
    batch = pool.get_batch()
    assert batch is not None and batch.values["group_id"] == ["c", "c"] and wsc.ready == ["default"]
    assert batch.metadata["filtered_groups"] == 2 and batch.metadata["filtered_groups_kept"] == 0
    # the cap: (3 - 1) batches' worth = 4 refilled tasks per batch; the third dull group is kept
    for i, group in enumerate(["d", "d", "e", "e", "f", "f"]):
        pool.put_trajectory(scored(6 + i, group, 0.5))
    assert loader.budget == 8
    batch = pool.get_batch()
    assert batch is not None and batch.values["group_id"] == ["f", "f"]
    assert batch.metadata["filtered_groups"] == 2 and batch.metadata["filtered_groups_kept"] == 1


def test_without_dynamic_sampling_zero_variance_groups_are_batched() -> None:
    pool, _ = make_pool(**{"data.batch_size": 1, "data.rollout_repeat_n": 2})
    pool.put_trajectory(scored(0, "a", 1.0))
    pool.put_trajectory(scored(1, "a", 1.0))
    batch = pool.get_batch()
    assert batch is not None and len(batch) == 2 and "filtered_groups" not in batch.metadata
