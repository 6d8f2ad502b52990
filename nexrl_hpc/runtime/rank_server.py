"""A rank other than 0 in MPI mode, from the run context's broadcast to its exit code.

The rank builds its modules, heartbeats to rank 0, and stops when rank 0 tells it to (or stops
answering). Told to stop, it stops its modules, answers, and waits until rank 0 releases it (or is
gone): under mpirun the first rank to exit without MPI_Finalize takes the others down with it.

Threads: ``serve`` runs on the main thread; rank 0's ``shutdown``/``abort``/``release`` arrive as
rank built-ins on the RPC threads. They share no lock: they hand over through the three events
(``_stop``, ``_stopped``, ``_released``), each field of the verdict being written before the event
that publishes it is set.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from nexrl_hpc.config.schema import HealthCheckConfig, RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.execute import execute_async
from nexrl_hpc.core.module import abort_modules
from nexrl_hpc.runtime.bootstrap import TRACKER, MPIWorld, build_rank_modules
from nexrl_hpc.runtime.gc_tuning import settle_after_setup
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT
from nexrl_hpc.runtime.roles import RunContext

if TYPE_CHECKING:
    from nexrl_hpc.core.module import NexRLModule
    from nexrl_hpc.trainer.trainer_rank import TrainerRank

logger = logging.getLogger(__name__)


class RankServer:
    """Serves one rank > 0: ``serve()`` returns the process exit code; ``finalize`` then says
    whether rank 0 released this rank to call MPI_Finalize (every rank alive)."""

    def __init__(self, config: RLTrainConfig, world: MPIWorld) -> None:
        self._config = config
        self._world = world
        self._monitor = config["runtime_monitor"]
        self._health: HealthCheckConfig = self._monitor["health_check"]
        self._stop = threading.Event()  # rank 0 said shutdown or abort
        self._stopped = threading.Event()  # this rank's modules are stopped (or aborted)
        self._released = threading.Event()  # rank 0 let this rank go
        self._reason = ""
        self._code = 0
        self._finalize = False
        self._aborted = False
        self._modules: list[NexRLModule] = []
        self._tracker: ActivityTracker | None = None  # the handle to rank 0's ActivityTracker
        self._names: list[str] = []

    # --- rank built-ins (called by rank 0, on this rank's RPC threads) --------------------------
    def shutdown(self, reason: str, exit_code: int) -> bool:
        self._reason, self._code = reason, exit_code
        self._stop.set()
        return self._stopped.wait(self._monitor["stop_timeout_s"])

    def abort(self, reason: str, exit_code: int) -> bool:
        logger.info("rank %d: aborting its modules and leaving (%s)", self._world.rank, reason)
        self._reason, self._code, self._aborted = reason, exit_code, True
        abort_modules(self._modules)
        self._stop.set()
        self._stopped.set()
        return True

    def release(self, finalize: bool = False) -> None:
        self._finalize = finalize
        self._released.set()

    # --- the rank's life ------------------------------------------------------------------------
    def serve(self) -> int:
        world, monitor = self._world, self._monitor
        msg = world.comm.bcast(None, root=0)
        if msg is None:
            return 1  # rank 0 failed before anything started; it reports why
        ctx = RunContext(**msg)
        self._tracker = world.directory.resolve(TRACKER)
        world.registry.add_builtin("shutdown", self.shutdown)
        world.registry.add_builtin("abort", self.abort)
        world.registry.add_builtin("release", self.release)
        self._modules += build_rank_modules(world, self._config, ctx, ActivityTrackerProxy(self._tracker))
        world.comm.barrier()
        settle_after_setup(self._config["runtime"])  # as rank 0 does: no long GC pauses mid-step
        self._names = world.peers[world.rank]["modules"]
        trainer_stop = threading.Event()
        trainer_thread = None
        if world.trainer is not None:
            trainer_thread = threading.Thread(
                target=_serve_trainer, args=(world.trainer, trainer_stop), name="trainer-rank", daemon=True
            )
            trainer_thread.start()

        if not self._heartbeat_until(self._stop):
            self._reason, self._code = "rank 0 stopped answering", 1
        if self._code not in (0, PREEMPTED_EXIT):
            print(
                f"error: rank {world.rank} ({', '.join(self._names)}) stopping: {self._reason}",
                file=sys.stderr,
            )
        if not self._aborted:  # aborted: nothing to stop in order, the process is ending
            _stop_modules(self._modules, monitor["stop_timeout_s"])
            if trainer_thread is not None:  # trainer rank 0 stops and tells the other trainer ranks to
                trainer_stop.set()
                trainer_thread.join(monitor["stop_timeout_s"])
            self._stopped.set()
        if self._stop.is_set():  # rank 0 is alive and asked: wait for its go (or its end)
            self._heartbeat_until(self._released, max_s=monitor["stop_timeout_s"])
        if not self._aborted:  # closing waits for the IO thread; an ending process need not
            world.endpoint.close()
        return int(self._code)

    @property
    def finalize(self) -> bool:
        """Released by rank 0 with every rank alive: MPI_Finalize before leaving (the last step)."""
        return self._released.is_set() and self._finalize

    def _beat(self, until: threading.Event) -> None:
        world = self._world
        stats = dict(world.endpoint.stats())
        if world.trainer is not None:
            stats["rejected"] += world.trainer.rejected
        assert self._tracker is not None  # resolved before the beats start
        reply = execute_async(self._tracker.heartbeat, world.rank, world.host, self._names, stats)
        # a beat in flight when rank 0 says stop/release must not hold this rank (rank 0 may be
        # gone without answering it, and rank 0's exit waits for this rank's MPI_Finalize)
        deadline = time.monotonic() + self._health["timeout"]
        while not until.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("rank 0 did not answer a heartbeat")
            if wait_futures([reply], timeout=min(self._health["reply_poll_s"], remaining)).done:
                reply.result()
                return

    def _heartbeat_until(self, event: threading.Event, max_s: float | None = None) -> bool:
        """Heartbeat to rank 0 every interval until ``event`` is set or ``max_s`` passed (True), or
        rank 0 stops answering (False). A beat stops waiting for its reply once ``event`` is set."""
        interval, timeout = self._health["check_interval"], self._health["timeout"]
        last_ok = start = time.monotonic()
        while not event.wait(interval):
            try:
                self._beat(event)
                last_ok = time.monotonic()
            except Exception:
                if time.monotonic() - last_ok > timeout:
                    return False
            if max_s is not None and time.monotonic() - start > max_s:
                return True
        return True


def _serve_trainer(trainer: TrainerRank, stop: threading.Event) -> None:
    try:
        trainer.serve(stop)
    except Exception as exc:  # the group broke (a trainer rank died): rank 0's clients get the error
        logger.error("trainer rank %d: trainer group broke: %s", trainer.rank, exc)


def _stop_modules(modules: list[NexRLModule], timeout: float) -> None:
    """Stop what this rank runs, bounded in time: an exit must never hang."""

    def stop_all() -> None:
        for m in modules:
            if hasattr(m, "stop"):
                try:
                    m.stop()
                except Exception:
                    logger.exception("stopping %s", m.get_module_name())

    t = threading.Thread(target=stop_all, daemon=True)
    t.start()
    t.join(timeout)
