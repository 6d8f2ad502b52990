"""MPI launch mode: ``mpirun -n N`` / ``srun --mpi=pmi2``; rank 0 runs the controller.

MPI only starts the job: plan the placement (every rank computes the same), split COMM_WORLD by
colocation group, broadcast a per-job random key (it never crosses the RPC sockets and is never
written to disk), gather every rank's ZMQ endpoint, broadcast the run context, build the modules,
barrier. From then on ranks talk through signed ZMQ calls only, so a dead rank cannot hang a
collective: other ranks see its heartbeats stop (or rank 0's replies stop) and act on it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.execute import execute_async
from nexrl_hpc.core.module import abort_modules
from nexrl_hpc.launcher.preemption import PREEMPTED_EXIT
from nexrl_hpc.rpc.endpoint import RPC_MODULE, RpcEndpoint
from nexrl_hpc.rpc.handles import Directory, ModuleRegistry
from nexrl_hpc.runtime.placement import TRAINER_GROUP, Placement, RankSpec, plan_placement
from nexrl_hpc.runtime.roles import RunContext, build_module, role_class
from nexrl_hpc.types import NexRLRole

logger = logging.getLogger(__name__)
TRACKER = "activity_tracker"
_HARD_BOOTSTRAP_GRACE_S = 10.0  # after runtime.bootstrap_timeout_s, for a rank stuck in C code


def interface_address(spec: str) -> str:
    """The address to bind: an IP as given, ``hostname`` (this host's address), or an interface name (Linux)."""
    try:
        ipaddress.ip_address(spec)
        return spec
    except ValueError:
        pass
    if spec == "hostname":
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", spec[:15].encode()))  # SIOCGIFADDR
        except OSError as exc:
            raise ValueError(
                f"runtime.rpc.interface={spec!r}: not an IP address, 'hostname' or a network interface ({exc})"
            ) from exc
    return socket.inet_ntoa(packed[20:24])


@dataclass
class MPIWorld:
    comm: Any
    rank: int
    placement: Placement
    spec: RankSpec
    group_comm: Any
    endpoint: RpcEndpoint
    registry: ModuleRegistry
    directory: Directory
    host: str
    peers: list[dict[str, Any]]
    key: bytes
    trainer: Any = None  # this rank's TrainerRank when it is a trainer rank

    def trainer_group(self) -> tuple[str, bytes] | None:
        """(trainer rank 0's address, job key) if the job has trainer ranks."""
        address = next((p["trainer_address"] for p in self.peers if p.get("trainer_address")), None)
        return (address, self.key) if address else None


def bootstrap(config: RLTrainConfig, comm: Any) -> MPIWorld:
    """Everything MPI is used for (besides the context broadcast and the barrier)."""
    rank = comm.Get_rank()
    placement = plan_placement(config, comm.Get_size())  # identical on every rank; raises on every rank
    spec = placement.ranks[rank]
    group_names = [g.name for g in placement.groups]
    group_comm = comm.Split(color=group_names.index(spec.group), key=rank)
    key = comm.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    rpc = config["runtime"]["rpc"]
    registry = ModuleRegistry()
    locations: dict[str, tuple[int, type]] = {
        name: (r, role_class(role, config)) for name, (r, role, _) in placement.modules().items()
    }
    locations[TRACKER] = (0, ActivityTracker)
    directory_box: list[Directory] = []
    endpoint = RpcEndpoint(
        rank,
        interface_address(rpc["interface"]),
        key,
        max_message_bytes=rpc["max_message_mb"] << 20,
        server_threads=rpc["server_threads"],
        call_timeout_s=rpc["call_timeout_s"],
        direct_sockets_per_peer=rpc["direct_sockets_per_peer"],
        long_poll_threads=rpc["long_poll_threads_per_peer"] * max(1, comm.size - 1),
        lookup=registry.lookup,
        resolve_handle=lambda name: directory_box[0].resolve(name),
    )
    directory = Directory(rank, endpoint, registry, locations)
    directory_box.append(directory)
    host = socket.gethostname()
    trainer = None
    names = spec.module_names
    if spec.group == TRAINER_GROUP:
        trainer = start_trainer_rank(config, group_comm, interface_address(rpc["interface"]), key)
        names = [f"trainer_rank_{spec.instance}"]
    peers = comm.allgather(
        {
            "address": endpoint.address,
            "lane_address": endpoint.lane_address,  # blocking @quick calls (nexrl_hpc/rpc/lane.py)
            "host": host,
            "node": os.environ.get("SLURMD_NODENAME", host),  # Slurm's node name (virtual nodes share a host)
            "pid": os.getpid(),
            "modules": names,
            "trainer_address": trainer.address if trainer is not None else None,
        }
    )
    endpoint.connect(
        {r: p["address"] for r, p in enumerate(peers)}, {r: p["lane_address"] for r, p in enumerate(peers)}
    )
    registry.add_builtin("ping", lambda: True)
    return MPIWorld(
        comm, rank, placement, spec, group_comm, endpoint, registry, directory, host, peers, key, trainer
    )


def start_trainer_rank(config: RLTrainConfig, group_comm: Any, host: str, key: bytes) -> Any:
    """torch.distributed over the trainer group (its rendezvous address exchanged over MPI), then
    this rank's TrainerRank (rank 0 binds the socket the train worker sends batches to)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from nexrl_hpc.train.policy_trainer import PolicyTrainer
    from nexrl_hpc.train.trainer_rank import TrainerRank

    ts = config["service"]["train_service"]
    grank, size = group_comm.Get_rank(), group_comm.Get_size()
    local_rank = group_comm.Split_type(_comm_type_shared()).Get_rank()
    timeout = timedelta(seconds=ts["collective_timeout_s"])
    # group rank 0's store binds a port of the kernel's choosing and keeps it: picking a "free" port
    # first and binding it later lost it to another connection's ephemeral port (EADDRINUSE, seen)
    store = (
        dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        if grank == 0
        else None
    )
    port = group_comm.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    os.environ.update(RANK=str(grank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank))
    if ts["device"] == "cuda":
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        "nccl" if ts["device"] == "cuda" else "gloo",
        store=store,
        rank=grank,
        world_size=size,
        timeout=timeout,
    )
    return TrainerRank(
        PolicyTrainer(),
        torch.device(ts["device"]),
        key,
        host=host,
        max_message_bytes=config["runtime"]["rpc"]["max_message_mb"] << 20,
        idle_tick_s=ts["idle_tick_s"],
    )


def _comm_type_shared() -> int:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def _build_rank_modules(
    world: MPIWorld, config: RLTrainConfig, ctx: RunContext, proxy: ActivityTrackerProxy
) -> list[Any]:
    modules = []
    for name, role in zip(world.spec.module_names, world.spec.roles):
        module = build_module(role, config, ctx, world.trainer_group())
        module.set_module_name(name)
        module.set_activity_tracker(proxy)
        world.registry.add(name, module)
        modules.append(module)
    return modules


class MPIRuntime:
    """Rank 0's view of the job: handles to every module, rank liveness, shutdown of the others."""

    def __init__(self, config: RLTrainConfig, world: MPIWorld):
        self._config = config
        self._world = world
        self._context_sent = False
        self.aborted = False  # abort() ran: the process leaves without closing its endpoint

    def create_all_actors(self, ctx: RunContext, tracker: ActivityTracker) -> None:
        w = self._world
        w.registry.add(TRACKER, tracker)
        w.comm.bcast(asdict(ctx), root=0)
        self._context_sent = True
        _build_rank_modules(w, self._config, ctx, ActivityTrackerProxy(tracker))
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
        return f"rank {rank} ({self._world.peers[rank]['host']})"

    def dead_ranks(self, timeout: float) -> list[dict[str, Any]]:
        tracker = self._world.registry.get(TRACKER)
        return [r for r in tracker.silent_ranks(timeout) if not self._world.endpoint.is_dead(r["rank"])]

    def is_trainer_rank(self, rank: int) -> bool:
        return self._world.placement.ranks[rank].group == TRAINER_GROUP

    def retire_rank(self, rank: int, reason: str) -> None:
        self._world.endpoint.fail_peer(rank, reason)
        self._world.registry.get(TRACKER).forget_rank(rank)

    def describe_rank(self, rank: int) -> str:
        peer = self._world.peers[rank]
        return f"rank {rank} on {peer['host']} ({', '.join(peer['modules'])})"

    def ranks_only_hosting(self, names: list[str]) -> list[int]:
        """Ranks all of whose modules are in ``names`` (lost modules: the rank has nothing left to do)."""
        lost = set(names)
        return [
            spec.rank
            for spec in self._world.placement.ranks
            if spec.module_names and set(spec.module_names) <= lost
        ]

    def rpc_rejected_total(self) -> float:
        tracker = self._world.registry.get(TRACKER)
        return self._world.endpoint.stats()["rejected"] + tracker.rank_stats_total("rejected")

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
        abort_modules([self._world.registry.get(name) for name in self._world.spec.module_names])
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
        self._call_live_ranks("release", (everyone,), 1.0)
        return everyone  # not "all answered": a released rank may close its socket before its reply leaves

    def _call_live_ranks(self, builtin: str, args: tuple, timeout: float) -> None:
        """Call a rank built-in on every rank not declared dead; wait up to ``timeout`` for all."""
        w = self._world
        futures = [
            w.endpoint.call_async(r, RPC_MODULE, builtin, args, {}, timeout=timeout)
            for r in range(1, len(w.peers))
            if not w.endpoint.is_dead(r)
        ]
        deadline = time.monotonic() + timeout
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass  # a rank that does not answer is gone or going: nothing more to tell it


def serve_rank(config: RLTrainConfig, world: MPIWorld) -> int:
    """Ranks > 0: build this rank's modules, heartbeat to rank 0, stop when told or when rank 0 is gone.

    Told to stop, a rank stops its modules, answers, and waits until rank 0 releases it (or is
    gone): under mpirun the first rank to exit without MPI_Finalize takes the others down with it.
    """
    msg = world.comm.bcast(None, root=0)
    if msg is None:
        return 1  # rank 0 failed before anything started; it reports why
    ctx = RunContext(**msg)
    tracker = world.directory.resolve(TRACKER)
    monitor = config["runtime_monitor"]
    stop, stopped, released = threading.Event(), threading.Event(), threading.Event()
    verdict: dict[str, Any] = {"reason": "", "code": 0, "finalize": False, "aborted": False}

    def shutdown(reason: str, exit_code: int) -> bool:
        verdict.update(reason=reason, code=exit_code)
        stop.set()
        return stopped.wait(monitor["stop_timeout_s"])

    world.registry.add_builtin("shutdown", shutdown)
    modules: list[Any] = []

    def abort(reason: str, exit_code: int) -> bool:
        logger.info("rank %d: aborting its modules and leaving (%s)", world.rank, reason)
        verdict.update(reason=reason, code=exit_code, aborted=True)
        abort_modules(modules)
        stop.set()
        stopped.set()
        return True

    world.registry.add_builtin("abort", abort)

    def release(finalize: bool = False) -> None:
        verdict["finalize"] = finalize
        released.set()

    world.registry.add_builtin("release", release)
    modules += _build_rank_modules(world, config, ctx, ActivityTrackerProxy(tracker))
    world.comm.barrier()
    names = world.peers[world.rank]["modules"]
    trainer_stop = threading.Event()
    trainer_thread = None
    if world.trainer is not None:
        trainer_thread = threading.Thread(
            target=_serve_trainer, args=(world.trainer, trainer_stop), name="trainer-rank", daemon=True
        )
        trainer_thread.start()

    def beat(until: threading.Event) -> None:
        stats = dict(world.endpoint.stats())
        if world.trainer is not None:
            stats["rejected"] += world.trainer.rejected
        reply = execute_async(tracker.heartbeat, world.rank, world.host, names, stats)
        # a beat in flight when rank 0 says stop/release must not hold this rank (rank 0 may be
        # gone without answering it, and rank 0's exit waits for this rank's MPI_Finalize)
        deadline = time.monotonic() + monitor["health_check"]["timeout"]
        while not until.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("rank 0 did not answer a heartbeat")
            if wait_futures([reply], timeout=min(0.1, remaining)).done:
                reply.result()
                return

    if not _heartbeat_until(beat, stop, monitor["health_check"]):
        verdict.update(reason="rank 0 stopped answering", code=1)
    if verdict["code"] not in (0, PREEMPTED_EXIT):
        print(
            f"error: rank {world.rank} ({', '.join(names)}) stopping: {verdict['reason']}",
            file=sys.stderr,
        )
    if not verdict["aborted"]:  # aborted: nothing to stop in order, the process is ending
        _stop_modules(modules, monitor["stop_timeout_s"])
        if trainer_thread is not None:  # trainer rank 0 stops and tells the other trainer ranks to
            trainer_stop.set()
            trainer_thread.join(monitor["stop_timeout_s"])
        stopped.set()
    if stop.is_set():  # rank 0 is alive and asked: wait for its go (or its end)
        _heartbeat_until(beat, released, monitor["health_check"], max_s=monitor["stop_timeout_s"])
    if not verdict["aborted"]:  # closing waits for the IO thread; an ending process need not
        world.endpoint.close()
    if released.is_set() and verdict["finalize"]:
        _finalize_mpi(monitor["stop_timeout_s"], int(verdict["code"]))
    return int(verdict["code"])


def _serve_trainer(trainer: Any, stop: threading.Event) -> None:
    try:
        trainer.serve(stop)
    except Exception as exc:  # the group broke (a trainer rank died): rank 0's clients get the error
        logger.error("trainer rank %d: trainer group broke: %s", trainer.rank, exc)


def _heartbeat_until(
    beat: Callable[[threading.Event], None],
    event: threading.Event,
    health: dict[str, Any],
    max_s: float | None = None,
) -> bool:
    """Heartbeat to rank 0 every interval until ``event`` is set or ``max_s`` passed (True), or
    rank 0 stops answering (False). A beat stops waiting for its reply once ``event`` is set."""
    interval, timeout = health["check_interval"], health["timeout"]
    last_ok = start = time.monotonic()
    while not event.wait(interval):
        try:
            beat(event)
            last_ok = time.monotonic()
        except Exception:
            if time.monotonic() - last_ok > timeout:
                return False
        if max_s is not None and time.monotonic() - start > max_s:
            return True
    return True


def _stop_modules(modules: list[Any], timeout: float) -> None:
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


def configure_rank_logging(run_dir: str, rank: int) -> None:
    """Rank 0 keeps Hydra's train.log (or opens it, started without Hydra: the Slurm launcher's
    tasks); other ranks log to logs/rank_<k>.log. Every line names its rank."""
    root = logging.getLogger()
    if not root.handlers:  # no Hydra: log to stderr (the task's log) and, on rank 0, to train.log
        root.setLevel(logging.INFO)
        root.addHandler(logging.StreamHandler())
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            root.addHandler(logging.FileHandler(os.path.join(run_dir, "train.log")))
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s")
    for handler in list(root.handlers):
        if rank != 0 and isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
        else:
            handler.setFormatter(fmt)
    if rank != 0:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        fh = logging.FileHandler(os.path.join(run_dir, "logs", f"rank_{rank}.log"))
        fh.setFormatter(fmt)
        root.addHandler(fh)


def run_mpi(config: RLTrainConfig, run_controller: Any, launcher_dir: str | None = None) -> int:
    """Every rank: bootstrap; rank 0 runs ``run_controller(config, runtime)``, the others serve.

    Rank 0's config (and so its run dir, which may hold a timestamp) is the job's config.
    Returns the process exit code: 2 when the placement does not fit (rank 0 says why).
    """
    _remove_stale_mpich_segments()
    timeout_s = config["runtime"]["bootstrap_timeout_s"]
    watchdog = threading.Timer(timeout_s, _bootstrap_timed_out, (config,))
    watchdog.daemon = True
    watchdog.start()
    # MPI_Init holds the GIL, so the timer above cannot fire while it hangs; faulthandler's C thread
    # can: it prints where this rank stood and exits 1 shortly after
    faulthandler.dump_traceback_later(timeout_s + _HARD_BOOTSTRAP_GRACE_S, exit=True, file=sys.stderr)
    MPI = start_mpi(config["runtime"]["mpi_env"])

    from nexrl_hpc.runtime.placement import PlacementError

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if comm.Get_size() == 1 and step_tasks > 1:  # every task would run the whole job into one run dir
        _cancel_bootstrap_watchdogs(watchdog)
        print(f"error: task {os.environ.get('SLURM_PROCID', '?')} of {step_tasks}: srun started "
              f"{step_tasks} tasks but MPI sees a world of 1: srun must start them with --mpi=pmi2 "
              f"(or SLURM_MPI_TYPE=pmi2; this step's type: {os.environ.get('SLURM_MPI_TYPE', 'the cluster default')})",
              file=sys.stderr)  # fmt: skip
        return 2
    config = comm.bcast(config if rank == 0 else None, root=0)
    run_dir = os.path.abspath(config["run_dir"])
    if rank != 0 and launcher_dir and os.path.abspath(launcher_dir) != run_dir:
        _remove_if_only_logs(launcher_dir)  # this rank's Hydra resolved another timestamp
    configure_rank_logging(run_dir, rank)
    try:
        world = bootstrap(config, comm)
    except PlacementError as err:
        _cancel_bootstrap_watchdogs(watchdog)
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    _cancel_bootstrap_watchdogs(watchdog)
    if rank != 0:
        from nexrl_hpc.launcher.preemption import ignore_preemption_signal

        ignore_preemption_signal(config["preemption"])  # Slurm signals every task; rank 0 decides
        return serve_rank(config, world)
    runtime = MPIRuntime(config, world)
    code = 1  # run_controller raised
    try:
        code = int(run_controller(config, runtime))
        return code
    finally:
        runtime.abort_startup()
        sys.stdout.flush()
        sys.stderr.flush()
        finalize = runtime.release_ranks()
        if not runtime.aborted:
            world.endpoint.close()
        if finalize:
            _finalize_mpi(config["runtime_monitor"]["stop_timeout_s"], code)


def start_mpi(mpi_env: dict[str, str | int | float | bool]) -> Any:
    """MPI_Init with ``runtime.mpi_env`` in the environment (MPICH reads its CVARs at init).

    Why the default MPIR_CVAR_CH4_NETMOD=ofi: with the UCX netmod, MPICH's PMI-1 exchange of
    business cards between nodes sometimes sends Slurm's pmi2 plugin a request it cannot parse
    (slurmstepd: "value not properly terminated in client request") and every rank then waits in
    MPI_Init forever; seen in 5 of 16 two-node starts and 1 of 6 heterogeneous-job runs. MPI only
    bootstraps here (small messages), so the netmod does not matter for speed.
    """
    for name, value in mpi_env.items():
        os.environ[name] = str(int(value)) if isinstance(value, bool) else str(value)
    import mpi4py

    mpi4py.rc.finalize = False  # exiting without MPI_Finalize: a dead peer cannot hang the exit
    from mpi4py import MPI

    return MPI


def _cancel_bootstrap_watchdogs(watchdog: threading.Timer) -> None:
    watchdog.cancel()
    faulthandler.cancel_dump_traceback_later()


def _remove_stale_mpich_segments(min_age_s: float = 5.0) -> None:
    """Unlink MPICH shared-memory segments that no live process maps. Their names derive from the
    PMI job/step, which comes back (a requeued job; job ids restarting on a fresh cluster), and a
    stale one left by killed processes breaks MPI_Init of the job that reuses the name (seen: every
    requeued job). Only this user's files, only ones older than ``min_age_s`` (a starting job maps
    its segment right after creating it)."""
    shm = "/dev/shm"
    try:
        names = [n for n in os.listdir(shm) if n.startswith("mpich_shm_")]
    except OSError:
        return
    if not names:
        return
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped.update(
                        line.rsplit("/", 1)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line
                    )
            except OSError:
                continue
    now, uid = time.time(), os.getuid()
    for name in names:
        path = os.path.join(shm, name)
        try:
            st = os.stat(path)
            if name not in mapped and st.st_uid == uid and now - st.st_mtime > min_age_s:
                os.unlink(path)
        except OSError:
            continue


def _finalize_mpi(timeout_s: float, exit_code: int) -> None:
    """MPI_Finalize (a barrier of all ranks) so that no rank's exit kills another; a peer that dies
    meanwhile cannot hang the exit: after ``timeout_s`` this process exits (``exit_code``) without it."""
    from mpi4py import MPI

    watchdog = threading.Timer(timeout_s, os._exit, (exit_code,))
    watchdog.daemon = True
    watchdog.start()
    MPI.Finalize()
    watchdog.cancel()


def exit_process(code: int, grace_s: float) -> NoReturn:
    """End this rank's process with ``code`` without Python's shutdown, which would join threads
    that may be waiting on a dead peer.

    A rank that called MPI_Finalize leaves through the C library's ``exit`` (its exit handlers run):
    leaving a finalized rank with ``_exit`` makes MPICH's Hydra SIGKILL the ranks still running
    (mpirun exits 9 after a finished run; measured with 4 ranks doing ``Finalize(); os._exit(0)``:
    4-13 of 16 jobs, against 0 of 16 through ``exit``, also with live zmq, torch and pool threads).
    Should an exit handler hang, faulthandler's own thread ends the process after ``grace_s``.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and mpi.Is_finalized():
        faulthandler.dump_traceback_later(grace_s, exit=True)
        ctypes.PyDLL(None).exit(code)  # PyDLL keeps the GIL: no Python thread runs during the teardown
    os._exit(code)


def _bootstrap_timed_out(config: RLTrainConfig) -> None:
    rank = os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "?"))
    print(
        f"error: rank {rank} ({socket.gethostname()}, pid {os.getpid()}): MPI start-up did not finish within "
        f"runtime.bootstrap_timeout_s={config['runtime']['bootstrap_timeout_s']}s (a peer failed MPI_Init?)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _remove_if_only_logs(path: str) -> None:
    try:
        entries = os.listdir(path)
        if all(e.endswith(".log") for e in entries):
            for e in entries:
                os.remove(os.path.join(path, e))
            os.rmdir(path)
    except OSError:
        pass
