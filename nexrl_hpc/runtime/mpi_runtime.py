"""Rank 0's runtime in MPI mode: handles to every module, rank liveness, stopping the other ranks.

``MPIRuntime`` answers the controller's questions (the ``Runtime`` protocol) with remote handles
resolved through the rank directory; ``LocalRuntime`` answers the same ones with plain objects.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.module import abort_modules
from nexrl_hpc.rpc.endpoint import RPC_MODULE
from nexrl_hpc.runtime.bootstrap import TRACKER, MPIWorld, build_rank_modules
from nexrl_hpc.runtime.elastic import JoinDoor, Member
from nexrl_hpc.runtime.placement import SERVICE_GROUPS
from nexrl_hpc.runtime.protocol import Runtime
from nexrl_hpc.runtime.roles import RunContext
from nexrl_hpc.types import NexRLRole

logger = logging.getLogger(__name__)


class MPIRuntime(Runtime):
    """Rank 0's view of the job: handles to every module, rank liveness, shutdown of the others."""

    def __init__(self, config: RLTrainConfig, world: MPIWorld) -> None:
        self._config = config
        self._world = world
        self._context_sent = False
        self.aborted = False  # abort() ran: the process leaves without closing its endpoint
        self._door: JoinDoor | None = None  # runtime.elastic: rollout ranks that join later

    def create_all_actors(self, ctx: RunContext, tracker: ActivityTracker) -> None:
        w = self._world
        w.registry.add(TRACKER, tracker)
        w.comm.bcast(asdict(ctx), root=0)
        self._context_sent = True
        build_rank_modules(w, self._config, ctx, ActivityTrackerProxy(tracker))
        w.comm.barrier()  # every rank has built and registered its modules: MPI's job is done
        for r, peer in enumerate(w.peers):
            if r != 0:
                tracker.heartbeat(r, peer["host"], peer["modules"])  # silence is measured from here
        logger.info("placement: %s", w.placement.describe())
        # who runs where (no secrets): for operators, the status tool and tests
        ranks = [{"rank": r, **peer, "group": w.placement.ranks[r].group} for r, peer in enumerate(w.peers)]
        path = os.path.join(ctx.run_dir, "logs", "ranks.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(ranks, f, indent=1)
        os.replace(f"{path}.tmp", path)
        if self._config["runtime"]["elastic"]["enabled"]:
            self._open_door(ctx)

    def _open_door(self, ctx: RunContext) -> None:
        """Listen for joiners (on the RPC interface) and write this start's credential."""
        w = self._world
        welcome = {
            "driver": {"address": w.peers[0]["address"], "lane_address": w.peers[0]["lane_address"]},
            "locations": {name: [r, role.value] for name, (r, role, _) in w.placement.modules().items()},
            "context": asdict(ctx),
        }
        host = w.endpoint.address.removeprefix("tcp://").rsplit(":", 1)[0]
        rpc = self._config["runtime"]["rpc"]
        self._door = JoinDoor(
            self._config["runtime"]["elastic"],
            ctx.run_dir,
            host,
            w.key,
            len(w.peers),
            welcome,
            rpc["preauth_max_connections"],
        )
        w.registry.add_builtin("elastic_leave", self._door.leave_notice)

    def elastic_door(self) -> JoinDoor | None:
        return self._door

    def admit_joiner(self, member: Member) -> tuple[Any, Any]:
        """Reach a proven joiner's modules: (its rollout worker, its inference service)."""
        w = self._world
        w.endpoint.connect({member.rank: member.address}, {member.rank: member.lane_address})
        worker, service = member.names
        w.directory.add(worker, member.rank, w.roles.role_class(NexRLRole.ROLLOUT_WORKER, self._config))
        w.directory.add(service, member.rank, w.roles.role_class(NexRLRole.INFERENCE_SERVICE, self._config))
        self._tracker().heartbeat(member.rank, member.host, member.names)  # silence is measured from here
        return w.directory.resolve(worker), w.directory.resolve(service)

    def abort_startup(self) -> None:
        """Rank 0 failed before sending the context: release the ranks waiting for it."""
        if not self._context_sent:
            self._context_sent = True
            self._world.comm.bcast(None, root=0)

    def _names_of(self, role: NexRLRole) -> list[str]:
        found = [(idx, name) for name, (_, r, idx) in self._world.placement.modules().items() if r == role]
        return [name for _, name in sorted(found)]

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return [self._world.directory.resolve(name) for name in self._names_of(role)]

    def get_one(self, role: NexRLRole) -> Any:
        return self.get_actor_wrapper(role)[0]

    def modules(self) -> list[tuple[str, NexRLRole, Any]]:
        return [
            (name, role, self._world.directory.resolve(name))
            for name, (_, role, _) in self._world.placement.modules().items()
        ]

    def location(self, name: str) -> str:
        rank = self._world.directory.rank_of(name)
        return f"rank {rank} ({self._peer(rank)['host']})"

    def _peer(self, rank: int) -> dict[str, Any]:
        """An MPI rank's start-up record, or a joined rank's (host, modules)."""
        if rank < len(self._world.peers):
            return self._world.peers[rank]
        member = self._door.member_of(rank) if self._door is not None else None
        return {"host": member.host if member else "?", "modules": member.names if member else []}

    def dead_ranks(self, timeout: float) -> list[dict[str, Any]]:
        return [
            r for r in self._tracker().silent_ranks(timeout) if not self._world.endpoint.is_dead(r["rank"])
        ]

    def is_trainer_rank(self, rank: int) -> bool:
        return rank < len(self._world.peers) and self._world.placement.ranks[rank].group in SERVICE_GROUPS

    def retire_rank(self, rank: int, reason: str) -> None:
        self._world.endpoint.fail_peer(rank, reason)
        self._tracker().forget_rank(rank)

    def describe_rank(self, rank: int) -> str:
        peer = self._peer(rank)
        return f"rank {rank} on {peer['host']} ({', '.join(peer['modules'])})"

    def ranks_only_hosting(self, names: list[str]) -> list[int]:
        """Ranks all of whose modules are in ``names`` (lost modules: the rank has nothing left to do)."""
        lost = set(names)
        joined = self._door.members() if self._door is not None else []
        return [
            spec.rank
            for spec in self._world.placement.ranks
            if spec.module_names and set(spec.module_names) <= lost
        ] + [m.rank for m in joined if m.state == "joined" and set(m.names) <= lost]

    def rpc_rejected_total(self) -> float:
        return self._world.endpoint.stats()["rejected"] + self._tracker().rank_stats_total("rejected")

    def shutdown(self, reason: str, exit_code: int) -> None:
        """Tell every live rank to stop its modules (with the reason and exit code); wait for them.

        The ranks stay up after replying, until ``release_ranks``: mpich's mpirun kills every rank
        still running once one exits without MPI_Finalize, so rank 0 must be the first to go.
        """
        self._call_live_ranks(
            "shutdown", (reason, exit_code), self._config["runtime_monitor"]["stop_timeout_s"]
        )

    def abort(self, reason: str, exit_code: int) -> None:
        """End the run's processes now, with no orderly stop (a preempted run whose checkpoint is
        complete: Slurm starts the requeued job only once every process of this one is gone).
        This rank's modules and every live rank's abort (server processes killed, nothing finished
        or waited for); the ranks answer at once and leave when released, as after ``shutdown``."""
        self.aborted = True
        registry = self._world.registry
        abort_modules([m for m in map(registry.get, self._world.spec.module_names) if m is not None])
        self._call_live_ranks("abort", (reason, exit_code), self._config["runtime_monitor"]["stop_timeout_s"])

    def release_ranks(self) -> bool:
        """Rank 0 is about to exit (its output flushed): the other ranks may exit now. Waits briefly
        for the answers: closing the endpoint at once could drop the queued messages.

        When every rank is alive, all of them (rank 0 too) call MPI_Finalize and then leave through
        ``exit_process``: under mpirun a rank leaving any other way makes Hydra SIGKILL the others,
        which could cut rank 0 short and turn a finished run's exit code into 9. Returns whether
        rank 0 should finalize."""
        w = self._world
        everyone = all(not w.endpoint.is_dead(r) for r in range(1, len(w.peers)))
        self._call_live_ranks("release", (everyone,), self._config["runtime_monitor"]["release_wait_s"])
        return everyone  # not "all answered": a released rank may close its socket before its reply leaves

    def _tracker(self) -> ActivityTracker:
        tracker = self._world.registry.get(TRACKER)
        assert tracker is not None, "create_all_actors registers the tracker"
        return tracker

    def _call_live_ranks(self, builtin: str, args: tuple[Any, ...], timeout: float) -> None:
        """Call a rank built-in on every rank not declared dead; wait up to ``timeout`` for all."""
        w = self._world
        joined = self._door.live_ranks() if self._door is not None else []
        if self._door is not None and builtin != "release":
            self._door.close()  # no joiner is let in once the run ends
        futures = [
            w.endpoint.call_async(r, RPC_MODULE, builtin, args, {}, timeout=timeout)
            for r in [*range(1, len(w.peers)), *joined]
            if not w.endpoint.is_dead(r)
        ]
        deadline = time.monotonic() + timeout
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass  # a rank that does not answer is gone or going: nothing more to tell it
