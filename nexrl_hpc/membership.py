"""Who generates rollouts: the controller's rollout workers and inference services as ranks come and go.

Two ways the set changes, both on the controller's thread between two looks at the training loop:

- **Lost** (``continue_without``, policy continue; or any joined rank, whatever the policy): the rest
  are re-wired (scheduler, weight publisher, verifier) and the lost workers' tasks are re-issued
  through the data loaders' ledger, exactly once.
- **Joined** (``poll``, ``take_departures``; runtime.elastic, runtime/elastic.py): a proven joiner's worker and service
  are wired in between tasks: the service loads the version the others serve (from its export on
  disk; a broadcast receiver instead joins the next publication's group) before its worker starts,
  and is in the weight-sync set from then on. A joined rank that says it leaves is lost as above;
  one that goes silent is found by the heartbeats like any rank.

Metrics on every step line: ``rollout/live_ranks`` (rollout workers generating), ``rollout/joins``
and ``rollout/leaves`` (since the previous step line: the tracker's per-step counts),
``rollout/join_refused`` (all the run).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from nexrl_hpc.core.execute import execute
from nexrl_hpc.run_health import RunFailed
from nexrl_hpc.runtime.elastic import JoinDoor, Member
from nexrl_hpc.types import NexRLRole
from nexrl_hpc.weight_sync.publisher import sync_weight_dir

if TYPE_CHECKING:
    from nexrl_hpc.controller import NexRLController

logger = logging.getLogger(__name__)


class RolloutMembership:
    """The controller's rollout set: ``continue_without`` (lost), ``take_departures`` (leaves) and
    ``poll`` (joins, gauges)."""

    def __init__(self, controller: NexRLController) -> None:
        self._c = controller
        self._joined: dict[str, int] = {}  # a joined rank's module name -> its rank
        self._catching_up: dict[int, tuple[Any, int]] = {}  # rank -> (service, version it loaded)
        self._waiting: dict[
            int, tuple[Any, int, int]
        ] = {}  # broadcast joiners: rank -> (worker, version, seen)

    # --- lost ----------------------------------------------------------------------------------
    def continue_without(self, gone: set[str], reason: str) -> None:
        """Lost rollout workers / inference services: re-wire the rest, re-issue their tasks."""
        c = self._c
        c._rollout_workers = [w for w in c._rollout_workers if execute(w.get_module_name) not in gone]
        c._inference_services = [s for s in c._inference_services if execute(s.get_module_name) not in gone]
        if not c._rollout_workers or not c._inference_services:
            raise RunFailed(f"{reason}: no rollout worker or inference service is left")
        execute(c.scheduler.set_inference_services, c._inference_services)
        assert c._health is not None
        for name in gone:
            if c._health.module_roles.get(name) == NexRLRole.ROLLOUT_WORKER:
                n = execute(c.dataloader.requeue_consumer, name)
                m = execute(c.validate_dataloader.requeue_consumer, name)
                logger.warning("re-issued %d training and %d validation task(s) that %s held", n, m, name)
        # a joined rank leaves once, however many of its modules are found lost and in how many looks
        ranks = {self._joined[name] for name in gone if name in self._joined}
        self._joined = {n: r for n, r in self._joined.items() if r not in ranks}
        for rank in sorted(ranks):
            self._catching_up.pop(rank, None)
            self._waiting.pop(rank, None)
            if c.activity_tracker is not None:
                c.activity_tracker.count_for_step("rollout/leaves")
            door = c.runtime.elastic_door()
            if door is not None:
                door.left(rank, reason)

    # --- joins and leaves ------------------------------------------------------------------------
    def take_departures(self) -> None:
        """Drop the joined ranks that said they leave (before the health check looks: a leaving
        rank's server may already be gone, and it left rather than died)."""
        c = self._c
        door = c.runtime.elastic_door()
        if door is None or c._health is None:
            return
        for rank, reason in door.take_departures():
            names = [n for n, r in self._joined.items() if r == rank]
            c.runtime.retire_rank(rank, reason)  # first: nothing it still sends is served after the re-issue
            if names:
                c._health.lose_modules(names, f"joined rank {rank} left ({reason})")

    def poll(self) -> None:
        """Wire in the joiners that arrived (departures: ``take_departures``), and keep the gauges
        current. Joiners wait while a validation runs (its workers are fixed)."""
        c = self._c
        door = c.runtime.elastic_door()
        if door is None or c._health is None or c.activity_tracker is None:
            return
        if not execute(c.scheduler.is_waiting_for_validation):
            for member in door.take_arrivals():
                self._admit(member)
        self._catch_up()
        self._note_first_tasks(door)
        tracker = c.activity_tracker
        tracker.count_for_step("rollout/joins", 0.0)  # on every step line from now on, 0 or more
        tracker.count_for_step("rollout/leaves", 0.0)
        tracker.set_gauge("rollout/live_ranks", float(len(c._rollout_workers)))
        tracker.set_gauge("rollout/join_refused", float(door.refused))

    def _admit(self, member: Member) -> None:
        c = self._c
        door = c.runtime.elastic_door()
        assert door is not None and c._health is not None and c.activity_tracker is not None
        service: Any = None
        version = -1
        try:
            worker, service = c.runtime.admit_joiner(member)
            for name, role, handle in zip(
                member.names, (NexRLRole.ROLLOUT_WORKER, NexRLRole.INFERENCE_SERVICE), (worker, service)
            ):
                c._health.module_roles[name] = role
                c._health.elastic_modules.add(name)
                c.activity_tracker.register_module(
                    name, handle, is_rollout_worker=role == NexRLRole.ROLLOUT_WORKER
                )
                self._joined[name] = member.rank
            execute(
                worker.set_module_references,
                c.trajectory_pool,
                c.dataloader,
                c.scheduler,
                c.validate_dataloader,
                c.validator,
            )
            execute(worker.set_inference_service, service)
            if (
                c._reward_services
            ):  # reward_model.placement=own_ranks: as start_reward_services hands them out
                execute(worker.set_reward_service, c._reward_services[member.rank % len(c._reward_services)])
            version = execute(c.scheduler.get_rollout_model_version, c._model_tag)
            broadcast = execute(service.weight_receivers) > 0
            if not broadcast:
                self._load(service, version)
            c._inference_services.append(service)
            execute(c.scheduler.set_inference_services, c._inference_services)
            if broadcast:  # served from the next publication its group includes
                self._waiting[member.rank] = (worker, version, version)
            else:
                self._catching_up[member.rank] = (service, version)
                execute(worker.run)
                c._rollout_workers.append(worker)
        except Exception as exc:
            logger.exception("elastic: wiring in rank %d failed", member.rank)
            for name in member.names:
                c.activity_tracker.unregister_module(name)
                self._joined.pop(name, None)
            c._inference_services = [s for s in c._inference_services if s is not service]
            c.runtime.retire_rank(member.rank, f"not wired in: {exc}")
            door.turn_away(member, f"not wired in: {type(exc).__name__}: {exc}")
            return
        door.welcome(member)
        c.activity_tracker.count_for_step("rollout/joins")
        logger.info(
            "elastic: rank %d (host %s%s) joined at weight version %d: %s",
            member.rank,
            member.host,
            f", Slurm job {member.job}" if member.job else "",
            version,
            ", ".join(member.names),
        )

    def _note_first_tasks(self, door: JoinDoor) -> None:
        """A joined worker holding tasks for the first time: the end of its join time (status)."""
        waiting = {
            m.names[0]: m.rank for m in door.members() if m.state == "joined" and m.first_task_at is None
        }
        if waiting:
            holding = execute(self._c.dataloader.outstanding)
            for name in set(waiting) & set(holding):
                door.first_task(waiting[name])

    def _load(self, service: Any, version: int) -> None:
        """The version the others serve, from its export (weight.sync_weight_path), as the
        publisher has every service load it (a service that cannot names the path)."""
        path = sync_weight_dir(self._c.config["weight"]["sync_weight_path"], version)
        execute(service.reload_weights, path, version)

    def _catch_up(self) -> None:
        """A publication in flight when a joiner was added went to the set without it: once, the
        joiner loads the version that publication brought (every later one includes it)."""
        c = self._c
        version = execute(c.scheduler.get_rollout_model_version, c._model_tag)
        for rank, (service, loaded) in list(self._catching_up.items()):
            if version != loaded:
                del self._catching_up[rank]
                try:
                    self._load(service, version)
                except Exception as exc:  # its heartbeats or health checks decide whether it is lost
                    logger.warning("elastic: rank %d could not load version %d: %s", rank, version, exc)
        for rank, (worker, joined_at, seen) in list(self._waiting.items()):
            if version != seen:  # the second publication since joining: its group had this rank
                if seen != joined_at:
                    del self._waiting[rank]
                    execute(worker.run)
                    c._rollout_workers.append(worker)
                else:
                    self._waiting[rank] = (worker, joined_at, version)
