"""In-flight work, module liveness, errors and metrics, seen from one central place.

Modules hold an ``ActivityTrackerProxy``; the proxy forwards to the central ``ActivityTracker``
(an object in this process, or a handle to one on another rank).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexrl_hpc.core.errors import ErrorReporter, ErrorSeverity
from nexrl_hpc.core.execute import aexecute, execute, execute_async, quick

if TYPE_CHECKING:
    from nexrl_hpc.config.schema import RLTrainConfig
    from nexrl_hpc.core.module import NexRLModule
    from nexrl_hpc.tracking.experiment import ExperimentLogger

logger = logging.getLogger(__name__)


@dataclass
class _Work:
    module: str
    work: str
    started: float


class ActivityTracker:
    """Counts in-flight work per module, keeps module references for liveness, routes errors and metrics."""

    def __init__(
        self,
        config: RLTrainConfig | None = None,
        max_errors: int = 1000,
        experiment_logger: ExperimentLogger | None = None,
    ):
        self._config = config
        self._lock = threading.Condition()
        self._inflight: dict[int, _Work] = {}
        self._tokens = itertools.count(1)
        self._modules: dict[str, NexRLModule] = {}  # the modules, or handles with their methods
        self._rollout_modules: set[str] = set()
        self._rollout_inflight = 0
        self._training_step = 0
        self._heartbeats: dict[int, dict[str, Any]] = {}
        self._gauges: dict[str, float] = {}
        self._step_counts: dict[str, float] = {}  # events since the last training-step line
        self.error_reporter = ErrorReporter(max_errors=max_errors)
        self.experiment_logger = experiment_logger

    # --- in-flight work -------------------------------------------------------------------------
    @quick
    def start(self, module: str, work: str) -> int:
        with self._lock:
            token = next(self._tokens)
            self._inflight[token] = _Work(module, work, time.monotonic())
            if module in self._rollout_modules:
                self._rollout_inflight += 1
            return token

    @quick
    def end(self, token: int) -> None:
        with self._lock:
            item = self._inflight.pop(token, None)
            if item is not None and item.module in self._rollout_modules:
                self._rollout_inflight -= 1
            if not self._inflight or self._rollout_inflight == 0:
                self._lock.notify_all()

    def is_quiescent(self) -> bool:
        with self._lock:
            return not self._inflight

    def wait_quiescent(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._inflight, timeout=timeout)

    @quick
    def is_rollout_worker_quiescent(self) -> bool:
        with self._lock:
            return self._rollout_inflight == 0

    def get_running_status_summary(self) -> str:
        with self._lock:
            items = list(self._inflight.values())
        if not items:
            return "idle"
        now = time.monotonic()
        by_key: dict[tuple[str, str], list[float]] = {}
        for item in items:
            by_key.setdefault((item.module, item.work), []).append(now - item.started)
        parts = [f"{m}/{w} x{len(ages)} (oldest {max(ages):.1f}s)" for (m, w), ages in sorted(by_key.items())]
        return "; ".join(parts)

    # --- modules --------------------------------------------------------------------------------
    def register_module(
        self, module_name: str, module_ref: NexRLModule, is_rollout_worker: bool = False
    ) -> None:
        with self._lock:
            self._modules[module_name] = module_ref
            if is_rollout_worker:
                self._rollout_modules.add(module_name)

    def unregister_module(self, module_name: str) -> None:
        with self._lock:
            self._modules.pop(module_name, None)
            self._rollout_modules.discard(module_name)
            stale = [t for t, w in self._inflight.items() if w.module == module_name]
            for token in stale:  # work of a dead module will never end
                self.end(token)

    def registered_modules(self) -> list[str]:
        with self._lock:
            return list(self._modules)

    # --- ranks (mpi) ----------------------------------------------------------------------------
    @quick
    def heartbeat(
        self, rank: int, host: str, modules: list[str], stats: dict[str, Any] | None = None
    ) -> bool:
        """A rank says it is alive (and how many messages it rejected)."""
        with self._lock:
            self._heartbeats[rank] = {
                "host": host,
                "modules": list(modules),
                "t": time.monotonic(),
                "stats": dict(stats or {}),
            }
        return True

    def silent_ranks(self, timeout: float) -> list[dict[str, Any]]:
        """Ranks whose last heartbeat is older than ``timeout`` seconds: rank, host, modules, silence."""
        now = time.monotonic()
        with self._lock:
            return [
                {"rank": r, "host": h["host"], "modules": h["modules"], "silence_s": now - h["t"]}
                for r, h in sorted(self._heartbeats.items())
                if now - h["t"] > timeout
            ]

    def forget_rank(self, rank: int) -> None:
        with self._lock:
            self._heartbeats.pop(rank, None)

    def rank_stats_total(self, key: str) -> float:
        with self._lock:
            return float(sum(h["stats"].get(key, 0) for h in self._heartbeats.values()))

    @quick
    def count_for_step(self, name: str, n: float = 1.0) -> None:
        """Added to the next training-step metrics line, then back to 0 (e.g. rollout/joins)."""
        with self._lock:
            self._step_counts[name] = self._step_counts.get(name, 0.0) + n

    def set_gauge(self, name: str, value: float) -> None:
        """A value added to every training-step metrics line (e.g. rpc/rejected)."""
        with self._lock:
            self._gauges[name] = value

    def check_module_liveness(self, timeout: float = 5.0) -> bool:
        return not self.dead_modules(timeout)

    def dead_modules(self, timeout: float = 5.0) -> list[str]:
        """Names of registered modules whose ``health_check`` fails or does not answer in ``timeout``."""
        with self._lock:
            modules = dict(self._modules)
        asked = [(name, execute_async(ref.health_check)) for name, ref in modules.items()]  # all at once
        deadline = time.monotonic() + timeout
        dead = []
        for name, future in asked:
            try:
                if not future.result(timeout=max(0.0, deadline - time.monotonic())):
                    dead.append(name)
            except Exception as exc:  # a dead or unreachable module
                logger.warning("health check of %s failed: %s", name, exc or type(exc).__name__)
                dead.append(name)
        return dead

    # --- errors ---------------------------------------------------------------------------------
    @quick
    def report_exception(
        self,
        module: str,
        work: str,
        exception: BaseException,
        severity: ErrorSeverity | None = None,
        details: dict[str, Any] | None = None,
    ) -> str:
        severity = severity or ErrorSeverity.ERROR
        remote_tb = getattr(exception, "remote_traceback", "")
        logger.log(
            logging.ERROR if severity == ErrorSeverity.ERROR else logging.WARNING,
            "%s [%s]: %s: %s%s",
            module,
            work,
            type(exception).__name__,
            exception,
            f"\n{remote_tb}" if remote_tb and severity == ErrorSeverity.ERROR else "",
            exc_info=severity == ErrorSeverity.ERROR and not remote_tb,
        )
        return self.error_reporter.report_exception(module, work, exception, severity, details)

    @quick
    def report_error(
        self,
        module: str,
        work: str,
        message: str,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, Any] | None = None,
    ) -> str:
        logger.log(
            logging.ERROR if severity == ErrorSeverity.ERROR else logging.WARNING,
            "%s [%s]: %s",
            module,
            work,
            message,
        )
        return self.error_reporter.report_error(module, work, message, severity, details)

    def get_error_health_status(self) -> dict[str, Any]:
        return self.error_reporter.get_health_status()

    # --- training step and metrics --------------------------------------------------------------
    @quick
    def set_training_step(self, step: int) -> None:
        self._training_step = step

    @quick
    def get_training_step(self) -> int:
        return self._training_step

    def experiment_logger_post(self, backend: str = "all", **kwargs: Any) -> None:
        if self.experiment_logger is None:
            return
        data = kwargs.get("data")
        if data and (self._gauges or self._step_counts) and any(k.startswith("train/") for k in data):
            with self._lock:
                kwargs["data"] = {**data, **self._gauges, **self._step_counts}
                self._step_counts = dict.fromkeys(self._step_counts, 0.0)
        self.experiment_logger.post(backend, **kwargs)

    def experiment_logger_samples(self, step: int, rows: list[dict[str, Any]], tag: str = "samples") -> None:
        """A step's decoded samples to the loggers (TensorBoard text, wandb table) under ``tag``."""
        if self.experiment_logger is not None:
            self.experiment_logger.post_samples(step, rows, tag)

    def __nexrl_handle_ref__(self) -> str:
        return "activity_tracker"


class ActivityTrackerProxy:
    """What a module holds: forwards to the central tracker (local object or remote handle)."""

    def __init__(self, central_tracker: ActivityTracker):
        # the tracker itself in local mode, a handle with its methods elsewhere
        self._central = central_tracker

    @contextmanager
    def track(self, module: str, work: str, auto_report_errors: bool = True) -> Iterator[None]:
        token = execute(self._central.start, module, work)
        try:
            yield
        except Exception as exc:
            if auto_report_errors:
                execute(self._central.report_exception, module, work, exc)
            raise
        finally:
            execute(self._central.end, token)

    def start(self, module: str, work: str) -> int:
        return execute(self._central.start, module, work)

    def end(self, token: int) -> None:
        execute(self._central.end, token)

    async def astart(self, module: str, work: str) -> int:
        """``start`` from an event loop (the loop serves other steps while the call travels)."""
        return await aexecute(self._central.start, module, work)

    async def aend(self, token: int) -> None:
        await aexecute(self._central.end, token)

    def report_exception(
        self,
        module: str,
        work: str,
        exception: BaseException,
        severity: ErrorSeverity | None = None,
        details: dict[str, Any] | None = None,
    ) -> str:
        return execute(self._central.report_exception, module, work, exception, severity, details)

    def report_error(
        self,
        module: str,
        work: str,
        message: str,
        severity: ErrorSeverity = ErrorSeverity.ERROR,
        details: dict[str, Any] | None = None,
    ) -> str:
        return execute(self._central.report_error, module, work, message, severity, details)

    def is_rollout_worker_quiescent(self) -> bool:
        return execute(self._central.is_rollout_worker_quiescent)

    def set_training_step(self, step: int) -> None:
        execute(self._central.set_training_step, step)

    def get_training_step(self) -> int:
        return execute(self._central.get_training_step)

    def experiment_logger_post(self, backend: str = "all", **kwargs: Any) -> None:
        execute(self._central.experiment_logger_post, backend, **kwargs)

    def experiment_logger_samples(self, step: int, rows: list[dict[str, Any]], tag: str = "samples") -> None:
        execute(self._central.experiment_logger_samples, step, rows, tag)
