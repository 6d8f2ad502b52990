"""Is the run still healthy? The controller's checks between two looks at the training loop.

Errors the modules reported, under ``runtime_monitor.exception_handling.policy``; dead ranks (no
heartbeat for ``health_check.timeout``); modules that fail their health checks. A check that finds
the run cannot go on raises ``RunFailed``; under policy ``continue`` a lost rollout worker or
inference service is dropped (the controller re-wires the rest and re-issues their tasks).
Called from the controller's thread only: no locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nexrl_hpc.config.schema import RuntimeMonitorConfig
from nexrl_hpc.core.activity import ActivityTracker
from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.runtime.protocol import Runtime
from nexrl_hpc.types import NexRLRole

logger = logging.getLogger(__name__)

# roles whose loss a run survives under policy "continue": the work of a dead instance is re-issued
REPLACEABLE_ROLES = {NexRLRole.ROLLOUT_WORKER, NexRLRole.INFERENCE_SERVICE}


class RunFailed(RuntimeError):
    """The run stopped because of an error (policy ``stop_on_error`` / ``stop_on_critical`` or a dead module)."""


class RunHealth:
    """``continue_without(names, reason)`` drops lost replaceable modules (policy ``continue``)."""

    def __init__(
        self,
        monitor: RuntimeMonitorConfig,
        runtime: Runtime,
        tracker: ActivityTracker,
        continue_without: Callable[[set[str], str], None],
    ) -> None:
        self._monitor = monitor
        self._policy = monitor["exception_handling"]["policy"]
        self._runtime = runtime
        self._tracker = tracker
        self._continue_without = continue_without
        self._seen_errors = 0
        self._last_health_check = 0.0
        self.module_roles: dict[str, NexRLRole] = {}  # filled as the modules are wired
        self.server_descriptions: dict[str, str] = {}  # inference service name -> its server, at start-up
        self.elastic_modules: set[str] = (
            set()
        )  # joined ranks' modules: losing them is normal, whatever the policy

    def check_module_exceptions(self) -> bool:
        """Apply ``runtime_monitor.exception_handling.policy`` to errors reported since the last check."""
        if not self._monitor["exception_handling"]["enabled"]:
            return True
        new, self._seen_errors = self._tracker.error_reporter.errors_since(self._seen_errors)
        # a joined rank's errors as it leaves (its server killed under it) are its leaving, not the run's
        errors = [
            e for e in new if e.severity == ErrorSeverity.ERROR and e.module_name not in self.elastic_modules
        ]
        if self._policy == "stop_on_critical":
            errors = [e for e in errors if e.is_critical]
        elif self._policy == "continue":
            errors = []
        if errors:
            first = errors[0]
            raise RunFailed(
                f"{first.module_name} [{first.work_context}]: {first.message} (policy {self._policy})"
            )
        return True

    def check_health(self) -> None:
        """Dead ranks (heartbeats, a local look-up) on every wake-up, so a silent rank is declared dead
        soon after ``timeout``; module health checks (calls) every ``check_interval``."""
        health = self._monitor["health_check"]
        if not health["enabled"]:
            return
        tracker, runtime = self._tracker, self._runtime
        now = time.monotonic()
        for dead in runtime.dead_ranks(health["timeout"]):
            reason = (
                f"rank {dead['rank']} on {dead['host']} ({', '.join(dead['modules'])}) stopped answering: "
                f"no heartbeat for {dead['silence_s']:.1f}s"
            )
            try:
                if set(dead["modules"]) & set(tracker.registered_modules()):
                    self.lose_modules(dead["modules"], reason)
                elif runtime.is_trainer_rank(dead["rank"]):  # no module, but training needs it
                    raise RunFailed(f"{reason}: the trainer group cannot train without it")
            finally:
                runtime.retire_rank(dead["rank"], reason)  # calls to it fail at once from now on
        if now - self._last_health_check < health["check_interval"]:
            return
        self._last_health_check = now
        tracker.set_gauge("rpc/rejected", runtime.rpc_rejected_total())
        dead_modules = tracker.dead_modules(health["timeout"])
        if dead_modules:
            self.check_module_exceptions()  # a crash that was reported names its cause
            silent = runtime.ranks_only_hosting(dead_modules)  # nothing on them answers
            where = ", ".join(
                f"{name} ({runtime.location(name)}{self._served_at(name)})" for name in dead_modules
            )
            if silent:
                reason = "; ".join(
                    f"{runtime.describe_rank(r)} stopped answering: health checks timed out" for r in silent
                )
            else:
                reason = f"module(s) not alive: {where}"
            try:
                self.lose_modules(dead_modules, reason)
            finally:
                for rank in silent:
                    runtime.retire_rank(rank, reason)

    def _served_at(self, name: str) -> str:
        """For an inference service: ``, server <url> (pid, log)`` — which server died, for the message.
        Recorded at start-up, never asked of the dead module (its rank may be hung)."""
        description = self.server_descriptions.get(name)
        return f", server {description}" if description else ""

    def lose_modules(self, names: list[str], reason: str) -> None:
        """Stop the run, or (policy continue, rollout modules only; or a joined rank's, whatever the
        policy) go on without them: their tasks are re-issued."""
        for name in names:  # their in-flight work will never end: shutdown must not wait for it
            self._tracker.unregister_module(name)
        replaceable = all(self.module_roles.get(m) in REPLACEABLE_ROLES for m in names)
        tolerated = self._policy == "continue" or set(names) <= self.elastic_modules
        if not tolerated or not replaceable:
            raise RunFailed(f"{reason} (policy {self._policy})")
        why = "policy continue" if self._policy == "continue" else "a joined rank's"
        logger.error("%s; continuing without it (%s)", reason, why)
        self._tracker.report_error("controller", "health_check", reason, ErrorSeverity.WARNING)
        self._continue_without(set(names), reason)
