"""RunHealth (the controller's checks) on real objects: the exception policy, dead modules, policy continue."""

from __future__ import annotations

from typing import cast

import pytest

from nexrl_hpc.assembly.roles import ROLES
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker
from nexrl_hpc.run_health import RunFailed, RunHealth
from nexrl_hpc.runtime.local import LocalRuntime
from nexrl_hpc.types import NexRLRole
from tests.conftest import compose_config


class _Module:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def health_check(self) -> bool:
        return self.alive


def _health(policy: str) -> tuple[RunHealth, ActivityTracker, list[tuple[set[str], str]]]:
    config = cast(RLTrainConfig, compose_config([f"runtime_monitor.exception_handling.policy={policy}"]))
    monitor = config["runtime_monitor"]
    tracker = ActivityTracker()
    dropped: list[tuple[set[str], str]] = []
    health = RunHealth(
        monitor, LocalRuntime(config, ROLES), tracker, lambda names, why: dropped.append((names, why))
    )
    return health, tracker, dropped


def test_errors_stop_the_run_by_policy() -> None:
    health, tracker, _ = _health("stop_on_error")
    health.check_module_exceptions()  # nothing reported yet
    tracker.report_error("rollout_worker", "step", "boom")
    with pytest.raises(RunFailed, match=r"rollout_worker \[step\]: boom \(policy stop_on_error\)"):
        health.check_module_exceptions()
    health.check_module_exceptions()  # an error is acted on once

    health, tracker, _ = _health("continue")
    tracker.report_error("rollout_worker", "step", "boom")
    assert health.check_module_exceptions()


def test_a_dead_module_stops_the_run_unless_it_is_replaceable_under_continue() -> None:
    health, tracker, dropped = _health("stop_on_error")
    tracker.register_module("train_worker", _Module(alive=False))
    health.module_roles["train_worker"] = NexRLRole.TRAIN_WORKER
    with pytest.raises(RunFailed, match=r"module\(s\) not alive: train_worker \(this process\) \(policy"):
        health.check_health()
    assert tracker.registered_modules() == [] and dropped == []

    health, tracker, dropped = _health("continue")
    tracker.register_module("rollout_worker_0", _Module(alive=False))
    tracker.register_module("rollout_worker_1", _Module(alive=True))
    health.module_roles.update(
        rollout_worker_0=NexRLRole.ROLLOUT_WORKER, rollout_worker_1=NexRLRole.ROLLOUT_WORKER
    )
    health.check_health()
    assert dropped == [({"rollout_worker_0"}, "module(s) not alive: rollout_worker_0 (this process)")]
    assert tracker.registered_modules() == ["rollout_worker_1"]
