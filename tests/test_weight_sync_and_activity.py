"""Rollout scheduler (sync mode state machine), activity tracker, error reporter, execute."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.errors import ErrorReporter, ErrorSeverity
from nexrl_hpc.core.execute import execute, execute_async
from nexrl_hpc.pool.trajectory_pool import TrajectoryPool
from nexrl_hpc.scheduler.rollout_scheduler import RolloutScheduler
from nexrl_hpc.weight_sync.publisher import sync_weight_dir
from nexrl_hpc.weight_sync.transport import WeightSyncError
from tests.conftest import compose_config


class RecordingService:
    """Stands in for an InferenceService: records the reloads it is asked for."""

    def __init__(self) -> None:
        self.published: list[tuple[str, int]] = []
        self.fail = False

    def reload_weights(self, model_path: str, version: int) -> None:
        if self.fail:
            raise WeightSyncError("reload refused")
        self.published.append((model_path, version))

    def get_module_name(self) -> str:
        return "inference_service"


class BudgetLoader:
    def __init__(self) -> None:
        self.budget: int | None = None
        self.calls = 0

    def set_dispatch_budget(self, budget: int | None) -> None:
        self.budget = budget
        self.calls += 1


def make_wsc(
    tmp_path: Any, *overrides: str
) -> tuple[RolloutScheduler, RecordingService, BudgetLoader, TrajectoryPool]:
    cfg = compose_config([f"run_dir={tmp_path}", "data.batch_size=2", "data.rollout_repeat_n=2", *overrides])
    transport = RecordingService()
    wsc = RolloutScheduler(cfg)
    wsc.set_inference_services([transport])
    loader = BudgetLoader()
    pool = TrajectoryPool(cfg)
    wsc.set_module_references(loader, pool)
    pool.set_module_references(loader, wsc)
    return wsc, transport, loader, pool


def test_sync_mode_releases_one_batch_per_version(tmp_path: Any) -> None:
    wsc, transport, loader, pool = make_wsc(
        tmp_path, "validate.eval.validate_freq=2", "train_worker.total_train_steps=3"
    )
    assert loader.budget == 0  # nothing before start
    wsc.sync_weight_to_rollout_service("default")
    wsc.start("default")
    assert loader.budget == 4 and wsc.check_rollout_service_status("default") == "continue"
    calls = loader.calls
    wsc.start("default")
    assert loader.calls == calls  # one training batch per version, however often it is asked
    for g in ("a", "b"):
        for i in range(2):
            assert pool.put_trajectory({"group_id": g, "i": i}) == "success"
    assert pool.put_trajectory({"group_id": "late"}) == "re-rollout"  # batch complete: stragglers go back
    assert pool.get_batch() is not None
    wsc.train_worker_notify_weight_update("train_worker", "default", 1)
    assert wsc.get_rollout_model_version("default") == 1
    assert transport.published[-1] == (sync_weight_dir(str(tmp_path / "weights"), 1), 1)
    assert not wsc.is_waiting_for_validation() and loader.budget == 4
    assert wsc.check_rollout_service_status("default") == "continue"
    calls = loader.calls
    wsc.train_worker_notify_weight_update("train_worker", "default", 2)  # validate_freq=2
    assert wsc.is_waiting_for_validation() and wsc.waiting_validation_model_tag() == "default"
    # the next batch is rolled out beside the validation, with the version it measures
    assert loader.calls == calls + 1 and loader.budget == 4
    assert wsc.check_rollout_service_status("default") == "continue"  # validation requests must flow
    # the trainer's next version waits until the validation of this one ends
    published = threading.Thread(
        target=wsc.train_worker_notify_weight_update, args=("train_worker", "default", 3)
    )
    published.start()
    published.join(timeout=0.3)
    assert published.is_alive() and wsc.get_rollout_model_version("default") == 2
    wsc.end_validate("default")
    published.join(timeout=5.0)
    assert not published.is_alive() and wsc.get_rollout_model_version("default") == 3
    assert loader.calls == calls + 2  # end_validate released nothing more: version 2's batch was out
    assert wsc.is_waiting_for_validation()  # last step: validate_at_end
    wsc.end_validate("default")
    assert loader.budget == 0  # done: no more rollouts


def test_clients_are_held_only_while_the_reload_runs(tmp_path: Any) -> None:
    wsc, transport, _, _ = make_wsc(tmp_path)
    seen = []
    transport.reload_weights = lambda path, version: seen.append(wsc.check_rollout_service_status("default"))  # type: ignore[method-assign]
    wsc.sync_weight_to_rollout_service("default")
    assert seen == ["block"] and wsc.check_rollout_service_status("default") == "continue"


def test_failed_reload_does_not_bump_the_version(tmp_path: Any) -> None:
    wsc, transport, _, _ = make_wsc(tmp_path)
    wsc.sync_weight_to_rollout_service("default")
    transport.fail = True
    with pytest.raises(WeightSyncError):
        wsc.train_worker_notify_weight_update("train_worker", "default", 1)
    assert wsc.get_rollout_model_version("default") == 0
    assert wsc.get_train_model_version("default") == 1


class ScoringService(RecordingService):
    """A recorded engine that scores the canary with the weights of the last version it reloaded
    (``weights[v]``: its log-probs under version ``v``); a joiner holds the base weights (0)."""

    def __init__(self, name: str, weights: dict[int, list[list[float]]], on_reload: Any = None):
        super().__init__()
        self.name, self.weights, self.on_reload = name, weights, on_reload
        self.scored = 0

    def reload_weights(self, model_path: str, version: int) -> None:
        if self.on_reload is not None:
            self.on_reload()
        super().reload_weights(model_path, version)

    def score_canary(self, prompts: list[list[int]]) -> list[list[float]]:
        self.scored += 1
        return self.weights[self.published[-1][1] if self.published else 0]

    def get_module_name(self) -> str:
        return self.name

    def describe(self) -> str:
        return self.name


def test_a_rank_joining_while_a_version_is_published_is_verified_from_the_next(tmp_path: Any) -> None:
    """The joiner's engine is added while version 1 is being published: version 1 reached only the
    engines there before, and only those are held to it; the joiner gets version 2 and its check."""
    from nexrl_hpc.weight_sync.verify import CanaryReference, WeightVerificationError

    weights = {0: [[-1.0, -2.0]], 1: [[-1.5, -0.5]], 2: [[-0.7, -0.9]]}
    wsc, _, _, _ = make_wsc(tmp_path)
    joiner = ScoringService("inference_service_e3", weights)
    member = ScoringService("inference_service", weights)
    member.on_reload = lambda: wsc.set_inference_services([member, joiner])  # mid-publish, once
    wsc.set_inference_services([member])
    wsc.train_worker_notify_weight_update(
        "train_worker", "default", 1, CanaryReference(version=1, prompts=[[1, 2, 3]], log_probs=weights[1])
    )
    assert [v for _, v in member.published] == [1] and not joiner.published
    assert (member.scored, joiner.scored) == (1, 0)
    member.on_reload = None
    wsc.train_worker_notify_weight_update(
        "train_worker", "default", 2, CanaryReference(version=2, prompts=[[1, 2, 3]], log_probs=weights[2])
    )
    assert [v for _, v in joiner.published] == [2] and (member.scored, joiner.scored) == (2, 1)
    # and an engine that got the version but serves other weights is still caught
    weights[3] = weights[2]  # version 3: the same weights
    joiner.weights = {**weights, 3: weights[0]}  # but the joiner's engine went back to its base
    with pytest.raises(WeightVerificationError, match="version 3 failed verification: inference_service_e3 "):
        wsc.train_worker_notify_weight_update(
            "train_worker",
            "default",
            3,
            CanaryReference(version=3, prompts=[[1, 2, 3]], log_probs=weights[2]),
        )


def test_activity_tracker_counts_inflight_work_and_quiescence() -> None:
    tracker = ActivityTracker()
    tracker.register_module("rollout_worker", object(), is_rollout_worker=True)
    proxy = ActivityTrackerProxy(tracker)
    t1 = proxy.start("rollout_worker", "rollout")
    t2 = proxy.start("train_worker", "train_step")
    assert not tracker.is_quiescent() and not tracker.is_rollout_worker_quiescent()
    assert "rollout_worker/rollout x1" in tracker.get_running_status_summary()
    proxy.end(t1)
    assert tracker.is_rollout_worker_quiescent() and not tracker.is_quiescent()
    assert not tracker.wait_quiescent(timeout=0.05)
    threading.Timer(0.05, proxy.end, args=(t2,)).start()
    assert tracker.wait_quiescent(timeout=5)
    assert tracker.get_running_status_summary() == "idle"


def test_track_reports_exceptions_and_reraises() -> None:
    tracker = ActivityTracker()
    proxy = ActivityTrackerProxy(tracker)
    with pytest.raises(ZeroDivisionError), proxy.track("algorithm_processor", "fit"):
        1 / 0  # noqa: B018
    assert tracker.is_quiescent()
    (err,) = tracker.error_reporter.errors()
    assert err.module_name == "algorithm_processor" and err.exception_type == "ZeroDivisionError"
    assert "ZeroDivisionError" in (err.exception_traceback or "")
    assert tracker.get_error_health_status()["status"] == "error"


def test_error_reporter_severities_and_errors_since() -> None:
    reporter = ErrorReporter(max_errors=3)
    assert reporter.get_health_status()["status"] == "healthy"
    reporter.report_error("m", "w", "careful", ErrorSeverity.WARNING)
    assert reporter.get_health_status() | {} == {
        "status": "warning",
        "message": "1 warning(s) in the last 300s",
        "recent_error_count": 1,
        "error_level_count": 0,
        "warning_level_count": 1,
    }
    new, seen = reporter.errors_since(0)
    assert [e.message for e in new] == ["careful"] and seen == 1
    for i in range(4):
        reporter.report_error("m", "w", f"e{i}")
    new, seen = reporter.errors_since(seen)
    assert [e.message for e in new] == ["e1", "e2", "e3"] and seen == 5  # only the last 3 are kept


def test_liveness_names_dead_modules() -> None:
    class Alive:
        def health_check(self) -> bool:
            return True

    class Dead:
        def health_check(self) -> bool:
            return False

    class Broken:
        def health_check(self) -> bool:
            raise ConnectionError("gone")

    tracker = ActivityTracker()
    for name, mod in (("a", Alive()), ("d", Dead()), ("b", Broken())):
        tracker.register_module(name, mod)
    assert tracker.dead_modules() == ["d", "b"]
    assert not tracker.check_module_liveness()


def test_execute_local_and_async_future() -> None:
    assert execute(lambda a, b=1: a + b, 2, b=3) == 5
    fut = execute_async(lambda: time.monotonic())
    assert fut.done() and isinstance(fut.result(), float)
    bad = execute_async(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()


def test_a_module_loop_that_crashed_is_dead_one_that_finished_is_not() -> None:
    from nexrl_hpc.core.module import NexRLModule

    finished, crashed = NexRLModule(), NexRLModule()
    tracker = ActivityTracker()
    for m, name in ((finished, "finished"), (crashed, "crashed")):
        m.set_module_name(name)
        m.set_activity_tracker(ActivityTrackerProxy(tracker))
    finished._start_thread(lambda: None)
    crashed._start_thread(lambda: 1 / 0)
    for m in (finished, crashed):
        m._thread.join(5)
    assert finished.health_check() and not crashed.health_check()
    (err,) = tracker.error_reporter.errors()
    assert err.module_name == "crashed" and err.is_critical and err.exception_type == "ZeroDivisionError"
