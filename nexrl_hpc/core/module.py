"""Base class of every module: a name, an activity tracker, a health check, an optional loop thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from nexrl_hpc.core.activity import ActivityTrackerProxy
from nexrl_hpc.core.execute import quick

logger = logging.getLogger(__name__)


class NexRLModule:
    """Modules are plain objects; the runtime decides whether callers reach them in-process or by RPC."""

    def __init__(self) -> None:
        self._module_name: str = "invalid"
        self._activity_tracker: ActivityTrackerProxy | None = None
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_crashed = False

    def set_activity_tracker(self, tracker: ActivityTrackerProxy) -> None:
        self._activity_tracker = tracker

    def set_module_name(self, module_name: str) -> None:
        self._module_name = module_name

    @quick
    def get_module_name(self) -> str:
        return self._module_name

    def __nexrl_handle_ref__(self) -> str:
        """Sent to another rank, a module travels as its registered name."""
        return self._module_name

    @quick
    def health_check(self) -> bool:
        """Alive: answers, and its loop thread (if any) is running or ended without an error."""
        if self._thread is None or self._stop_event.is_set():
            return True
        return self._thread.is_alive() or not self._loop_crashed

    # --- loop thread helpers for modules that run continuously ---------------------------------
    def _start_thread(self, target: Callable[[], None]) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self._module_name} is already running")
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._guarded(target), name=self._module_name, daemon=True)
        self._thread.start()

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except Exception as exc:  # a crashed loop is reported, then seen dead by health_check
                self._loop_crashed = True
                if self._activity_tracker is not None:
                    self._activity_tracker.report_exception(
                        self._module_name, "main_loop", exc, details={"critical": True}
                    )
                else:
                    logger.exception("%s main loop crashed", self._module_name)

        return run

    def _stop_thread(self, timeout: float | None = None) -> None:
        self._stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def abort(self) -> None:
        """This process ends right after this call, with no stop (a preempted run whose checkpoint is
        complete): end what would outlive the process, finish nothing. Loops see ``stopped``;
        nobody waits for them."""
        self._stop_event.set()

    @property
    def stopped(self) -> bool:
        return self._stop_event.is_set()


def abort_modules(modules: list[NexRLModule]) -> None:
    """``abort`` every module, whatever one of them raises (the process is ending either way)."""
    for m in modules:
        try:
            m.abort()
        except Exception:
            logger.exception("aborting %s", m.get_module_name())
