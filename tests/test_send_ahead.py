"""The next batch goes to the trainer group while it trains the current one (async modes).

Driven through ``TrainWorker._loop`` with a backend double that queues like the trainer group
(``queues_updates``): the order of sends, answers, checkpoints and announcements is the contract.
The real group's side (a batch queued behind another, its export in the same operation) is in
tests/test_train_service.py; a whole MPI run in tests/test_mpi.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nexrl_hpc.trainer.backend import UpdateInFlight
from nexrl_hpc.trainer.noop import NoopTrainService
from nexrl_hpc.trainer.worker import TrainWorker
from nexrl_hpc.types import Batch
from tests.conftest import compose_config

METRICS = {"actor/loss": 0.0, "actor/pg_loss": 0.0, "actor/grad_norm": 0.0, "actor/nan_skipped": 0}


class QueuedTrainService(NoopTrainService):
    """Records what reaches the trainer and when its answers are read."""

    queues_updates = True

    def __init__(self, events: list[str], on_result: Callable[[int], None] = lambda version: None) -> None:
        super().__init__()
        self.events = events
        self.on_result = on_result

    def start_update_actor(self, batch: dict[str, Any], export_path: str) -> UpdateInFlight:
        # weight.transport=broadcast exports nothing: the versions are counted
        version = (
            int(export_path.rsplit("_", 1)[-1])
            if export_path
            else 1 + sum(e.startswith("send") for e in self.events)
        )
        self.events.append(f"send {version}")
        service = self

        class Answer(UpdateInFlight):
            looked = False

            def done(self) -> bool:  # still training when first asked, answered at the next look
                answered, self.looked = self.looked, True
                return answered

            def result(self) -> dict[str, Any]:
                service.events.append(f"answer {version}")
                service.on_result(version)
                return {"meta_info": {"metrics": dict(METRICS), "export_s": 0.0}}

        return Answer()

    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        self.events.append("canary")  # the group answers it after every update sent before it
        return super().compute_log_prob(batch)

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        self.events.append(f"checkpoint {global_step}")
        super().save_checkpoint(local_path, global_step, save_weight_only)


class ReadyBatches:
    """The train batch pool: ``count`` batches, all ready."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.handed = 0

    def get_batch(self, model_tag: str, wait_s: float = 0.0) -> Batch | None:
        if self.left == 0:
            return None
        self.left -= 1
        self.handed += 1
        n = 4
        return Batch(
            values={
                "input_ids": torch.zeros(n, 3, dtype=torch.long),
                "attention_mask": torch.ones(n, 3, dtype=torch.long),
                "response_mask": torch.ones(n, 2),
                "behaviour_log_probs": torch.zeros(n, 2),
                "weight_version": torch.full((n,), self.handed - 1),  # on-policy: step k samples version k-1
            },
            metadata={"task_keys": [], "metrics": {}, "global_token_num": 12},
        )


class Announcements:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def train_worker_notify_weight_update(
        self, worker_name: str, model_tag: str, version: int, canary: Any = None
    ) -> None:
        self.events.append(f"announce {version}" + (f" canary {canary['version']}" if canary else ""))

    def validation_intervals(self, since: float) -> list[tuple[float, float]]:
        return []

    def trainer_dropped_batch(self, model_tag: str) -> None:
        raise AssertionError("no batch is over the staleness bound here")


class Tracker:
    @contextlib.contextmanager
    def track(self, module: str, what: str) -> Iterator[None]:
        yield

    def set_training_step(self, step: int) -> None:
        pass

    def experiment_logger_post(self, backend: str, data: dict[str, Any], step: int) -> None:
        pass

    def report_error(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"unexpected error report {args}")


def run_loop(
    tmp_path: Path,
    mode: str,
    steps: int,
    save_freq: int,
    on_result: Callable[[TrainWorker, int], None] | None = None,
    canary: list[list[int]] | None = None,
    transport: str = "disk",
) -> list[str]:
    cfg = compose_config(
        [
            f"run_dir={tmp_path}",
            f"weight.sync_mode={mode}",
            "weight.staleness_threshold=2",
            f"train_worker.total_train_steps={steps}",
            f"train_worker.save_freq={save_freq}",
            "train_worker.max_ckpt_to_keep=null",
            "logger.samples_per_step=0",  # the batches hold only what the trainer reads
            f"weight.transport={transport}",  # send-ahead needs an export per version (broadcast: see below)
        ]
    )
    events: list[str] = []
    service = QueuedTrainService(events)
    worker = TrainWorker(cfg, service)
    if on_result is not None:
        service.on_result = lambda version: on_result(worker, version)
    worker.set_module_references(ReadyBatches(steps), Announcements(events))  # type: ignore[arg-type]
    worker.set_activity_tracker(Tracker())  # type: ignore[arg-type]
    if canary is not None:
        worker.set_canary(canary)
    worker._loop()
    worker._announcer.wait()
    return events


def test_fully_async_sends_the_next_batch_while_the_trainer_trains_but_never_past_a_checkpoint(
    tmp_path: Path,
) -> None:
    events = run_loop(tmp_path, "fully-async", steps=4, save_freq=2)
    # 2 goes out before 1's answer is read; 2 is a checkpoint step: 3 waits for that checkpoint,
    # which holds version 2's weights and nothing newer; 4 (the last) rides behind 3
    assert [e for e in events if not e.startswith("announce")] == [
        "send 1",
        "send 2",
        "answer 1",
        "answer 2",
        "checkpoint 2",
        "send 3",
        "send 4",
        "answer 3",
        "answer 4",
        "checkpoint 4",
    ]
    assert [e for e in events if e.startswith("announce")] == [f"announce {v}" for v in (1, 2, 3, 4)]
    # a version is announced only after its own answer (its weights are exported)
    for v in (1, 2, 3, 4):
        assert events.index(f"announce {v}") > events.index(f"answer {v}")


def test_with_broadcast_a_version_is_announced_before_the_next_update_changes_the_weights(
    tmp_path: Path,
) -> None:
    """weight.transport=broadcast: the trainer sends a version while the engines receive it, so the
    next update waits for the announcement (nothing goes ahead) and nothing is exported."""
    events = run_loop(tmp_path, "fully-async", steps=3, save_freq=0, transport="broadcast")
    assert events == [
        "send 1",
        "answer 1",
        "announce 1",
        "send 2",
        "answer 2",
        "announce 2",
        "send 3",
        "answer 3",
        "checkpoint 3",  # the last step
        "announce 3",
    ]
    assert not (tmp_path / "weights").exists()


def test_a_stop_request_while_a_batch_is_ahead_ends_the_session_after_that_batch(tmp_path: Path) -> None:
    """Preemption read at step 1 while step 2 is already with the trainer: a checkpoint at 1 would
    hold step 2's weights, so the session ends after step 2, checkpointed, 2 not announced."""

    def stop_at_first_answer(worker: TrainWorker, version: int) -> None:
        if version == 1:
            worker.stop_after_current_step()

    events = run_loop(tmp_path, "fully-async", steps=6, save_freq=0, on_result=stop_at_first_answer)
    assert [e for e in events if not e.startswith("announce")] == [
        "send 1",
        "send 2",
        "answer 1",
        "answer 2",
        "checkpoint 2",
    ]
    assert [e for e in events if e.startswith("announce")] == ["announce 1"]  # 2 ends the session


def test_a_verified_sync_takes_the_canary_before_the_batch_sent_ahead(tmp_path: Path) -> None:
    """Weight verification on every sync: the trainer's canary log-probs of version v are asked
    for before batch v + 1 goes to the group (which answers in order: they are v's weights), and
    the next batch is still sent while the trainer trains."""
    events = run_loop(tmp_path, "fully-async", steps=4, save_freq=0, canary=[[1, 5, 6], [1, 7]])
    assert [e for e in events if not e.startswith("announce")] == [
        "send 1",
        "canary",
        "send 2",
        "answer 1",
        "canary",
        "send 3",
        "answer 2",
        "canary",
        "send 4",
        "answer 3",
        "answer 4",
        "checkpoint 4",
        "canary",
    ]
    assert [e for e in events if e.startswith("announce")] == [
        f"announce {v} canary {v}" for v in (1, 2, 3, 4)
    ]


def test_sync_mode_sends_one_batch_at_a_time(tmp_path: Path) -> None:
    """The next batch needs the new weights: nothing goes ahead, even to a backend that queues."""
    events = run_loop(tmp_path, "sync", steps=3, save_freq=0)
    assert [e for e in events if not e.startswith("announce")] == [
        "send 1",
        "answer 1",
        "send 2",
        "answer 2",
        "send 3",
        "answer 3",
        "checkpoint 3",
    ]


def test_trainer_rank_0_takes_only_an_export_path_with_a_batch() -> None:
    """What a batch message may carry besides its tensors (it is signed with the job's key, but a
    well-formed header is still checked before anything is broadcast to the group)."""
    from nexrl_hpc.trainer.trainer_rank import _batch_args

    assert _batch_args("update_actor", None) == ({}, None)
    assert _batch_args("update_actor", {"export_path": "/w/version_3"}) == (
        {"export_path": "/w/version_3"},
        None,
    )
    for operation, args in [
        ("update_actor", {"export_path": 5}),
        ("update_actor", {"export_path": ""}),
        ("update_actor", {"export_path": "/w", "rm": "-rf"}),
        ("compute_log_prob", {"export_path": "/w"}),
        ("update_actor", ["export_path"]),
    ]:
        kept, problem = _batch_args(operation, args)
        assert kept == {} and problem is not None and problem.startswith(f"{operation}: unexpected arguments")
