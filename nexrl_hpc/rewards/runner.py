"""RewardRunner: score off the caller's thread, with a timeout, never raising.

Why threads and what a timeout means: a Python function cannot be stopped from outside, so a reward
runs on one of ``num_threads`` daemon threads and the caller stops *waiting* for it after
``timeout_s`` (counted from when the call started running, not from when it was queued). The
timed-out thread is then abandoned: it is replaced so the pool keeps its size, and it exits when
the call returns (if ever). At most ``4 * num_threads`` threads may be abandoned at once; beyond
that the function is not called any more (each score is a timeout at once) until one of them
returns. Daemon threads never hold up the process's exit. A reward that busy-loops holds the GIL in
turns and slows the worker down: untrusted code belongs in a sandbox (nexrl_hpc.agents.sandbox).

Many responses that finish together (a coalesced completion request returns a whole batch) are
submitted together (``submit_many``): cut into one chunk per pool thread, each chunk one hand-off to
a thread that scores its items in turn, each item with its own deadline; when an item times out
the rest of its chunk goes back to the queue for the other threads. One hand-off per item cost
many times the default task's reward itself.

A batched reward (TRL's form, or a set of functions one of which is) is called once per
submission: the submission is one job, with one deadline, and its failure fails every response in it.

A reward that raises any ``BaseException`` (``sys.exit()``, ``exit()``, argparse's exit inside a
scorer) fails that call, counted as an error; its thread carries on, and a thread that dies anyway is
replaced and its call counted as an error, never as a timeout. Each call runs under
``containment.reward_call``: ``os._exit`` fails the call instead of ending the run, and the processes
the call started are killed and reaped when it ends (``close`` does the same for calls still
running). What still goes wrong, a reward failing on most samples, is the error-rate stop's
(``rollout_worker.max_reward_error_frac``).

Every failure is a score of 0 with a count: ``reward/errors`` (raised, or returned no reward) and
``reward/timeouts``, both present in every score dict so per-step sums are counts, as is
``reward/skipped`` (a TRL function returned None). A warning names the function and the exception,
at most once per ``WARN_EVERY_S`` per kind; ``first_error`` keeps the first failure's traceback.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nexrl_hpc.rewards.containment import reap_children, reward_call
from nexrl_hpc.rewards.loader import SKIPPED, Outcome, Reward, RewardFailure

if TYPE_CHECKING:
    from nexrl_hpc.rewards.combined import RewardSet

logger = logging.getLogger(__name__)

WARN_EVERY_S = 30.0  # one warning per kind of failure per this long (the rest are counted in it)
ABANDONED_PER_THREAD = 4  # hung calls tolerated per pool thread before the function is not called

ERRORS = "reward/errors"
TIMEOUTS = "reward/timeouts"


@dataclass
class _Job:
    """One call of the reward: one (task, response), or a batched reward's whole submission."""

    items: list[tuple[Any, Any]]
    futures: list[Future]
    deadline: float = 0.0


@dataclass
class _Worker:
    thread: threading.Thread | None = None
    job: _Job | None = None
    abandoned: bool = False
    rest: deque[_Job] = field(default_factory=deque)  # what is left of the chunk it is scoring


@dataclass
class _Warnings:
    last: dict[str, float] = field(default_factory=dict)
    suppressed: dict[str, int] = field(default_factory=dict)


class RewardRunner:
    """``submit(task, response) -> Future[dict]``: the score dict, always with ``reward/errors`` and
    ``reward/timeouts`` (0 or 1). Call ``close`` when done (it does not wait for hung calls)."""

    def __init__(
        self, reward: Reward | RewardSet, timeout_s: float, num_threads: int, name: str = "reward"
    ) -> None:
        self.reward = reward
        self.first_error: str | None = None  # "<spec>: <traceback>" of the first failure
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.name = name
        self.num_errors = 0
        self.num_timeouts = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[list[_Job] | None] = queue.SimpleQueue()  # chunks
        self._live: list[_Worker] = []
        self._abandoned: list[_Worker] = []
        self._deadlines: list[tuple[float, int, _Worker]] = []  # heap of running calls
        self._order = itertools.count()
        self._warnings = _Warnings()
        self._closed = False
        for _ in range(num_threads):
            self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    # --- the caller's side ------------------------------------------------------------------------
    def submit(self, task: Any, response: str) -> Future:
        return self.submit_many([(task, response)])[0]

    def submit_many(self, pairs: Sequence[tuple[Any, str]]) -> list[Future]:
        """A future per ``(task, response)``, in order; the pairs go to the threads as one chunk per
        live thread."""
        if self.reward.batched:
            jobs = [_Job(list(pairs), [Future() for _ in pairs])] if pairs else []
        else:
            jobs = [_Job([pair], [Future()]) for pair in pairs]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the reward runner is closed")
            saturated = not self._live
            # queued under the lock: the watchdog's drain sees them if all threads hang
            if not saturated and jobs:
                size = -(-len(jobs) // len(self._live))
                for start in range(0, len(jobs), size):
                    self._queue.put(jobs[start : start + size])
        if saturated:  # every thread hung: do not queue behind them
            for job in jobs:
                self._resolve_failure(
                    job.futures,
                    TIMEOUTS,
                    RewardFailure(
                        f"{len(self._abandoned)} calls are still running past {self.timeout_s} s; not called "
                        "until one returns"
                    ),
                )
        return [future for job in jobs for future in job.futures]

    def score(self, task: Any, response: str) -> dict[str, float]:
        """``submit`` and wait (for callers on a thread of their own, e.g. an environment's step)."""
        return self.submit(task, response).result()

    def close(self) -> None:
        """Stop the threads; the processes calls still running (hung ones too) started are killed."""
        with self._lock:
            self._closed = True
            workers = len(self._live)
            threads = [w.thread for w in (*self._live, *self._abandoned) if w.thread is not None]
            self._wake.notify_all()
        for _ in range(workers):
            self._queue.put(None)
        for thread in threads:
            if thread.native_id is not None:
                reap_children(thread.native_id)

    # --- pool threads ------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """A new pool thread (the lock is held or the runner is being built)."""
        worker = _Worker()
        worker.thread = threading.Thread(
            target=self._serve, args=(worker,), name=f"{self.name}-{next(self._order)}", daemon=True
        )
        self._live.append(worker)
        worker.thread.start()

    def _serve(self, worker: _Worker) -> None:
        try:
            self._serve_chunks(worker)
        except BaseException as exc:  # a thread that dies is replaced, never a timeout
            self._replace_dead(worker, exc)

    def _serve_chunks(self, worker: _Worker) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            with self._lock:
                worker.rest.extend(chunk)
            while (outcome := self._score_next(worker)) == "scored":
                pass
            if outcome == "retired":
                return

    def _score_next(self, worker: _Worker) -> str:
        """Score the next item of the worker's chunk: "scored"; "done" when nothing is left of it
        (a timed-out item's thread finds its chunk requeued by the watchdog); "retired" when that
        thread is not needed any more (the pool was refilled meanwhile) and must exit."""
        with self._lock:
            if not worker.rest:
                return "done"
            job = worker.rest.popleft()
            if not any([f.set_running_or_notify_cancel() for f in job.futures]):
                return "scored"
            job.deadline = time.monotonic() + self.timeout_s
            worker.job = job
            heapq.heappush(self._deadlines, (job.deadline, next(self._order), worker))
            if len(self._deadlines) == 1:  # a later deadline than those queued needs no wake-up
                self._wake.notify()
        outcomes = self._call(job)
        with self._lock:
            timed_out = worker.abandoned  # then the watchdog answered for this call
            worker.job = None
            if worker.abandoned:
                self._abandoned.remove(worker)
                if self._closed or len(self._live) >= self.num_threads:
                    return "retired"
                worker.abandoned = False  # back in the pool: a hung call returned
                self._live.append(worker)
        if timed_out:
            return "done"  # the watchdog requeued the rest of the chunk
        for future, outcome in zip(job.futures, outcomes):
            if isinstance(outcome, RewardFailure):
                self._resolve_failure([future], ERRORS, outcome)
            else:
                _set(future, {SKIPPED: 0.0, **outcome, ERRORS: 0.0, TIMEOUTS: 0.0})
        return "scored"

    def _call(self, job: _Job) -> list[Outcome]:
        """The job's outcomes: one call of the reward (a batched one over all of the job's items).
        Any ``BaseException`` is the call's failure: ``sys.exit()`` in a reward must not end its
        thread (the containment module: ``os._exit`` and the processes the call started)."""
        try:
            with reward_call():
                if self.reward.batched:
                    tasks, responses = zip(*job.items)
                    return self.reward.score_batch(tasks, responses)
                ((task, response),) = job.items
                return [self.reward(task, response)]
        except BaseException as exc:  # a pool thread: never the main thread's Ctrl-C
            return [RewardFailure.now(exc)] * len(job.items)

    def _replace_dead(self, worker: _Worker, exc: BaseException) -> None:
        """A pool thread ended by an exception: its call is an error (not a timeout), the rest of
        its chunk goes back to the queue and a new thread takes its place."""
        with self._lock:
            job, worker.job = worker.job, None
            answered = worker.abandoned  # the watchdog already answered its call as a timeout
            rest = list(worker.rest)
            worker.rest.clear()
            if worker in self._live:
                self._live.remove(worker)
            if worker in self._abandoned:
                self._abandoned.remove(worker)
            if not self._closed and len(self._live) < self.num_threads:
                self._spawn()
            if rest:
                self._queue.put(rest)
        if job is not None and not answered:
            failure = RewardFailure(f"the reward's thread died: {type(exc).__name__}: {exc}")
            self._resolve_failure(job.futures, ERRORS, failure)

    def _watch(self) -> None:
        """Answer calls past their deadline with a timeout and replace their threads."""
        while True:
            expired: list[_Job] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    deadline, _, worker = heapq.heappop(self._deadlines)
                    job = worker.job
                    if job is None or job.deadline != deadline or worker.abandoned:
                        continue  # that call finished in time
                    worker.abandoned = True
                    self._live.remove(worker)
                    self._abandoned.append(worker)
                    if worker.rest:  # the rest of its chunk: to the threads still live
                        self._queue.put(list(worker.rest))
                        worker.rest.clear()
                    if len(self._abandoned) <= ABANDONED_PER_THREAD * self.num_threads:
                        self._spawn()
                    expired.append(job)
                # deadlines are checked at most every 50 ms: calls finishing in time leave stale entries
                wait = max(self._deadlines[0][0] - now, 0.05) if self._deadlines else None
                if not expired:
                    self._wake.wait(wait)
            for job in expired:
                self._resolve_failure(
                    job.futures,
                    TIMEOUTS,
                    RewardFailure(f"still running after rollout_worker.reward_timeout_s={self.timeout_s}"),
                )
            if expired:
                self._drain_if_saturated()

    def _drain_if_saturated(self) -> None:
        """With no live thread left, queued calls would wait forever: answer them as timeouts."""
        with self._lock:
            if self._live:
                return
        while True:
            try:
                chunk = self._queue.get_nowait()
            except queue.Empty:
                return
            for job in chunk or ():
                if any([f.set_running_or_notify_cancel() for f in job.futures]):
                    self._resolve_failure(job.futures, TIMEOUTS, RewardFailure("every reward thread is hung"))

    # --- failures ----------------------------------------------------------------------------------
    def _resolve_failure(self, futures: list[Future], kind: str, failure: RewardFailure) -> None:
        message = failure.message
        with self._lock:
            if kind == ERRORS:
                self.num_errors += len(futures)
            else:
                self.num_timeouts += len(futures)
            if self.first_error is None:
                self.first_error = f"{self.reward.spec}: {failure.traceback or failure.message}"
            now = time.monotonic()
            due = now - self._warnings.last.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S
            suppressed = self._warnings.suppressed.get(kind, 0)
            if due:
                self._warnings.last[kind] = now
                self._warnings.suppressed[kind] = 0
            else:
                self._warnings.suppressed[kind] = suppressed + 1
        if due:
            what = "raised or returned no reward" if kind == ERRORS else "timed out"
            more = f" ({suppressed} more since the last warning)" if suppressed else ""
            logger.warning(
                "reward function %s %s; scored 0: %s%s", self.reward.spec, what, message[:500], more
            )
        for future in futures:
            _set(
                future,
                {
                    "reward": 0.0,
                    SKIPPED: 0.0,
                    ERRORS: float(kind == ERRORS),
                    TIMEOUTS: float(kind == TIMEOUTS),
                },
            )


def _set(future: Future, scores: dict[str, float]) -> None:
    try:
        future.set_result(scores)
    except InvalidStateError:
        pass  # the caller cancelled the call meanwhile
