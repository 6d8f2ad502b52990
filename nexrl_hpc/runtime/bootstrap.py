"""MPI start-up of one rank: everything MPI is used for before the modules talk over ZMQ.

Plan the placement (every rank computes the same), split COMM_WORLD by colocation group, broadcast
a per-job random key (it never crosses the RPC sockets and is never written to disk), open this
rank's signed ZMQ endpoint and gather every rank's address, start the trainer group's
torch.distributed on trainer ranks. ``build_rank_modules`` builds a rank's modules once rank 0 has
broadcast the run context.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.rpc.endpoint import RpcEndpoint
from nexrl_hpc.rpc.handles import Directory, ModuleRegistry
from nexrl_hpc.rpc.preauth import WireLimits
from nexrl_hpc.runtime.network import (
    BindAddress,
    network_host,
    reachability_problems,
    resolve_bind_address,
    use_interface_for_collectives,
)
from nexrl_hpc.runtime.placement import (
    CRITIC_GROUP,
    SERVICE_GROUPS,
    TEACHER_GROUP,
    TRAINER_GROUP,
    Placement,
    RankSpec,
    plan_placement,
)
from nexrl_hpc.runtime.roles import RoleRegistry, RunContext, TrainerRankBuilder

if TYPE_CHECKING:
    from mpi4py.MPI import Comm, Intracomm

    from nexrl_hpc.core.module import NexRLModule
    from nexrl_hpc.trainer.trainer_rank import TrainerRank

logger = logging.getLogger(__name__)

TRACKER = "activity_tracker"  # the registry name of rank 0's ActivityTracker


def resolve_on_every_rank(comm: Intracomm, spec: str, key: str) -> BindAddress:
    """``spec`` resolved by each rank on its own host; every rank raises the same ConfigError
    (naming ``key``) when a rank cannot resolve it or when it is loopback on a job that spans
    hosts: ranks elsewhere could not reach the addresses exchanged next."""
    bind, error = None, None
    try:
        bind = resolve_bind_address(spec, key)
    except ConfigError as err:
        error = "; ".join(p.message for p in err.problems)
    found = comm.allgather(
        {
            "net": network_host(),
            "host": socket.gethostname(),
            "address": bind.address if bind else None,
            "loopback": bool(bind and bind.loopback),
            "error": error,
        }
    )
    problems = reachability_problems(found, spec, key)
    if problems or bind is None:
        raise ConfigError(problems)
    return bind


@dataclass
class MPIWorld:
    comm: Intracomm
    rank: int
    placement: Placement
    spec: RankSpec
    group_comm: Comm
    endpoint: RpcEndpoint
    registry: ModuleRegistry
    directory: Directory
    host: str
    peers: list[dict[str, Any]]
    key: bytes
    roles: RoleRegistry  # which class builds which role (handed in by the composition)
    trainer: TrainerRank | None = None  # this rank's TrainerRank when it is a trainer (or teacher) rank

    def service_group(self, group: str = TRAINER_GROUP) -> tuple[str, bytes] | None:
        """(rank 0's address, job key) of the job's trainer group ``group`` (the policy's or the teacher's), if any."""
        address = next(
            (
                p["trainer_address"]
                for r, p in enumerate(self.peers)
                if self.placement.ranks[r].group == group and p["trainer_address"]
            ),
            None,
        )
        return (address, self.key) if address else None


def bootstrap(config: RLTrainConfig, comm: Intracomm, roles: RoleRegistry) -> MPIWorld:
    """Everything MPI is used for (besides the context broadcast and the barrier); ``roles`` builds
    this rank's modules and trainer."""
    rank = comm.Get_rank()
    placement = plan_placement(config, comm.Get_size())  # identical on every rank; raises on every rank
    spec = placement.ranks[rank]
    group_names = [g.name for g in placement.groups]
    group_comm = comm.Split(color=group_names.index(spec.group), key=rank)
    key = comm.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    rpc = config["runtime"]["rpc"]
    bind = resolve_on_every_rank(comm, rpc["interface"], "runtime.rpc.interface")
    # every rank's collectives (the trainer group, the weight broadcast group its servers join) on
    # the interface the job's calls use: reachable from the other hosts of the job
    chosen = use_interface_for_collectives(bind)
    if chosen:
        logger.info("collective sockets: %s", ", ".join(f"{k}={v}" for k, v in chosen.items()))
    registry = ModuleRegistry()
    locations: dict[str, tuple[int, type]] = {
        name: (r, roles.role_class(role, config)) for name, (r, role, _) in placement.modules().items()
    }
    locations[TRACKER] = (0, ActivityTracker)
    directory_box: list[Directory] = []
    endpoint = RpcEndpoint(
        rank,
        bind.address,
        key,
        max_message_bytes=rpc["max_message_mb"] << 20,
        server_threads=rpc["server_threads"],
        call_timeout_s=rpc["call_timeout_s"],
        direct_sockets_per_peer=rpc["direct_sockets_per_peer"],
        long_poll_threads=rpc["long_poll_threads_per_peer"] * max(1, comm.size - 1 + _joiners(config)),
        lookup=registry.lookup,
        resolve_handle=lambda name: directory_box[0].resolve(name),
        limits=WireLimits.from_config(rpc),
    )
    directory = Directory(rank, endpoint, registry, locations)
    directory_box.append(directory)
    host = socket.gethostname()
    trainer = None
    names = spec.module_names
    if spec.group in SERVICE_GROUPS:
        trainer = start_trainer_rank(config, group_comm, bind, key, roles.build_trainer_rank, spec.group)
        names = [f"{spec.group}_rank_{spec.instance}"]
    peers = comm.allgather(
        {
            "address": endpoint.address,
            "lane_address": endpoint.lane_address,  # blocking @quick calls (nexrl_hpc/rpc/lane.py)
            "host": host,
            "interface": bind.interface,  # what runtime.rpc.interface resolved to on this host
            "node": os.environ.get("SLURMD_NODENAME", host),  # Slurm's node name (virtual nodes share a host)
            "pid": os.getpid(),
            "modules": names,
            # rank 0 of a trainer group (the policy's or the teacher's): where its client sends batches
            "trainer_address": trainer.address if trainer is not None else None,
        }
    )
    endpoint.connect(
        {r: p["address"] for r, p in enumerate(peers)}, {r: p["lane_address"] for r, p in enumerate(peers)}
    )
    registry.add_builtin("ping", lambda: True)
    return MPIWorld(
        comm,
        rank,
        placement,
        spec,
        group_comm,
        endpoint,
        registry,
        directory,
        host,
        peers,
        key,
        roles,
        trainer,
    )


def start_trainer_rank(
    config: RLTrainConfig,
    group_comm: Comm,
    bind: BindAddress,
    key: bytes,
    build_trainer_rank: TrainerRankBuilder,
    group: str = TRAINER_GROUP,
) -> TrainerRank:
    """torch.distributed over the trainer group (its rendezvous address exchanged over MPI; gloo's
    and NCCL's sockets on the interface of ``bind``), then this rank's TrainerRank from
    ``build_trainer_rank`` (rank 0 binds the socket the train worker sends batches to)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    ts = config["service"]["train_service"]
    host = bind.address
    chosen = use_interface_for_collectives(bind)
    if chosen:
        logger.info("trainer group sockets: %s", ", ".join(f"{k}={v}" for k, v in chosen.items()))
    grank, size = group_comm.Get_rank(), group_comm.Get_size()
    local_rank = group_comm.Split_type(_comm_type_shared()).Get_rank()
    timeout = timedelta(seconds=ts["collective_timeout_s"])
    # group rank 0's store listens on a socket bound here to its own address (TCPStore would
    # listen on every interface) on a port of the kernel's choosing, kept from the start: picking a
    # "free" port first and binding it later lost it to another connection's ephemeral port
    # (EADDRINUSE, seen). The others connect to rank 0's address, not their own.
    store = None
    if grank == 0:
        listener = socket.create_server((host, 0), backlog=max(128, 2 * size))
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
    master = group_comm.bcast((host, store.port) if store is not None else None, root=0)
    # every rank has the address before rank 0 leaves MPI for the store: MPICH moves a message to
    # another node only while its sender is inside MPI (no progress thread), and rank 0 next
    # waits in the store for ranks that would wait forever for that message (seen across hosts)
    group_comm.barrier()
    if store is None:
        store = dist.TCPStore(master[0], master[1], size, is_master=False, timeout=timeout)
    os.environ.update(RANK=str(grank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank))
    if ts["device"] == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"service.train_service.device=cuda but trainer rank {grank} sees no CUDA device "
                "(placement.resources.trainer.gpus_per_rank under Slurm)"
            )
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        ts["dist_backend"],
        store=store,
        rank=grank,
        world_size=size,
        timeout=timeout,
    )
    return build_trainer_rank(config, host, key, group)


def _joiners(config: RLTrainConfig) -> int:
    """Rollout ranks that may join later (runtime/elastic.py): rank 0 keeps long-poll threads for them."""
    elastic = config["runtime"]["elastic"]
    return elastic["max_members"] if elastic["enabled"] else 0


def _comm_type_shared() -> int:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def build_rank_modules(
    world: MPIWorld, config: RLTrainConfig, ctx: RunContext, proxy: ActivityTrackerProxy
) -> list[NexRLModule]:
    """Build, name and register this rank's modules (every rank, rank 0 included, once the context is known)."""
    modules = []
    for name, role in zip(world.spec.module_names, world.spec.roles):
        module = world.roles.build_module(
            role,
            config,
            ctx,
            world.service_group(),
            world.service_group(TEACHER_GROUP),
            world.service_group(CRITIC_GROUP),
        )
        module.set_module_name(name)
        module.set_activity_tracker(proxy)
        world.registry.add(name, module)
        modules.append(module)
    return modules
