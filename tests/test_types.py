"""nexrl_hpc.types: the Trajectory TypedDict declares what the rollout workers really put, and the
typed Batch stays a plain-dict carrier (what crosses the wire)."""

from __future__ import annotations

import asyncio

import torch

from nexrl_hpc.rollout.base import BaseRolloutWorker
from nexrl_hpc.types import Batch, RolloutFields, TaskFields, Trajectory
from tests.test_agents_rollout_worker import TASK, make_worker

DECLARED = Trajectory.__required_keys__ | Trajectory.__optional_keys__

RESULT = {
    "model_tag": "default",
    "response": "ab",
    "finish_reason": "stop",
    "prompt_ids": [5, 6],
    "response_ids": [7, 8, 2],
    "logprobs": [-0.1, -0.2, -0.3],
    "weight_version": 4,
    "reasoning": None,  # client result keys that are not trajectory fields stay out
}


def test_the_typed_dicts_split_task_rollout_and_score_fields() -> None:
    assert TaskFields.__optional_keys__ == {"prompt", "uid", "epoch", "sample_index", "group_id"}
    assert (
        Trajectory.__required_keys__ == RolloutFields.__required_keys__ == set(RolloutFields.__annotations__)
    )
    assert {"reward", "scores", "step_spans", "termination_reason"} <= Trajectory.__optional_keys__


def test_make_trajectory_puts_the_declared_fields_on_a_plain_dict() -> None:
    task = {"prompt": "q", "uid": "u1", "epoch": 0, "sample_index": 1, "group_id": "u1@0", "answer": "7"}
    traj = BaseRolloutWorker.make_trajectory(task, RESULT, {"reward": 1.0, "accuracy": 1.0})
    assert type(traj) is dict
    assert set(traj) - set(task) <= DECLARED  # everything a worker adds is declared
    assert Trajectory.__required_keys__ <= set(traj)
    assert traj["loss_mask"] == [1, 1, 1] and traj["behaviour_log_probs"] == [-0.1, -0.2, -0.3]
    assert traj["reward"] == 1.0 and traj["answer"] == "7"  # the row's own columns ride along
    assert list(traj)[: len(task)] == list(task)  # task fields first, as before


def test_agent_trajectory_fields_are_declared() -> None:
    worker, _, pool, _, _ = make_worker(["<k>c</k>", "3"])
    assert asyncio.run(worker.step(dict(TASK))) == "success"
    (traj,) = pool.items
    assert set(traj) - set(TASK) <= DECLARED
    assert Trajectory.__required_keys__ <= set(traj)


def test_batch_columns_and_metadata_stay_plain() -> None:
    trajs = [BaseRolloutWorker.make_trajectory({"uid": f"u{i}"}, RESULT) for i in range(3)]
    batch = Batch.from_trajectories(trajs, {"model_tag": "m"})
    assert type(batch.metadata) is dict and batch.metadata == {"model_tag": "m", "batch_size": 3}
    assert batch.values["uid"] == ["u0", "u1", "u2"] and batch.to_trajectories() == trajs
    tensors = Batch(values={"x": torch.zeros(2, 3)})
    assert type(tensors.metadata) is dict and len(tensors) == 2
