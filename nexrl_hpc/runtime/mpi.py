"""MPI launch mode: ``mpirun -n N`` / ``srun --mpi=pmi2``; rank 0 runs the controller.

MPI only starts the job: plan the placement (every rank computes the same), split COMM_WORLD by
colocation group, broadcast a per-job random key (it never crosses the RPC sockets and is never
written to disk), gather every rank's ZMQ endpoint, broadcast the run context, build the modules,
barrier. From then on ranks talk through signed ZMQ calls only, so a dead rank cannot hang a
collective: other ranks see its heartbeats stop (or rank 0's replies stop) and act on it.

This module is a rank process's life: MPI_Init (``start_mpi``), the start-up watchdogs, logging,
then ``runtime.bootstrap`` -> rank 0 runs the controller with an ``MPIRuntime``, the others a
``RankServer`` -> MPI_Finalize when every rank is alive (``finalize_mpi``) -> ``exit_process``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.runtime.bootstrap import bootstrap
from nexrl_hpc.runtime.mpi_runtime import MPIRuntime
from nexrl_hpc.runtime.rank_server import RankServer
from nexrl_hpc.runtime.roles import RoleRegistry
from nexrl_hpc.runtime.run_lock import claim_run_dir, release_run_dir


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


def run_mpi(
    config: RLTrainConfig,
    run_controller: Callable[[RLTrainConfig, MPIRuntime], int],
    roles: RoleRegistry,
    launcher_dir: str | None = None,
) -> int:
    """Every rank: bootstrap; rank 0 runs ``run_controller(config, runtime)``, the others serve;
    ``roles`` (the composition's role registry) builds each rank's modules.

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
    hard_timeout_s = timeout_s + config["runtime"]["bootstrap_kill_after_s"]  # for a rank stuck in C code
    faulthandler.dump_traceback_later(hard_timeout_s, exit=True, file=sys.stderr)
    MPI = start_mpi(config["runtime"]["mpi_env"])

    from nexrl_hpc.config.validate import ConfigError
    from nexrl_hpc.runtime.placement import PlacementError

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if comm.Get_size() == 1 and step_tasks > 1:  # every task would run the whole job into one run dir
        _cancel_bootstrap_watchdogs(watchdog)
        print(
            f"error: task {os.environ.get('SLURM_PROCID', '?')} of {step_tasks}: srun started "
            f"{step_tasks} tasks but MPI sees a world of 1: srun must start them with --mpi=pmi2 "
            f"(or SLURM_MPI_TYPE=pmi2; this step's type: {os.environ.get('SLURM_MPI_TYPE', 'the cluster default')})",
            file=sys.stderr,
        )
        return 2
    config = comm.bcast(config if rank == 0 else None, root=0)
    run_dir = os.path.abspath(config["run_dir"])
    refusal = claim_run_dir(run_dir) if rank == 0 else None  # one writer per run dir (run_lock)
    if comm.bcast(refusal, root=0) is not None:
        _cancel_bootstrap_watchdogs(watchdog)
        if rank == 0:
            print(f"error: {refusal}", file=sys.stderr, flush=True)
        finalize_mpi(config["runtime_monitor"]["stop_timeout_s"], 2)
        return 2
    if rank != 0 and launcher_dir and os.path.abspath(launcher_dir) != run_dir:
        _remove_if_only_logs(launcher_dir)  # this rank's Hydra resolved another timestamp
    configure_rank_logging(run_dir, rank)
    try:
        world = bootstrap(config, comm, roles)
    except (PlacementError, ConfigError) as err:  # raised by every rank (placement, runtime.rpc.interface)
        _cancel_bootstrap_watchdogs(watchdog)
        if rank == 0:
            release_run_dir(run_dir)
            print(f"error: {err}", file=sys.stderr, flush=True)
        # every rank is here: finalize, so that no rank leaves while a message another rank still
        # waits for is unsent (across nodes MPICH sends only while the sender is inside MPI)
        finalize_mpi(config["runtime_monitor"]["stop_timeout_s"], 2)
        return 2
    _cancel_bootstrap_watchdogs(watchdog)
    if rank != 0:
        from nexrl_hpc.runtime.preemption import ignore_preemption_signal

        ignore_preemption_signal(config["preemption"])  # Slurm signals every task; rank 0 decides
        server = RankServer(config, world)
        code = server.serve()
        if server.finalize:
            finalize_mpi(config["runtime_monitor"]["stop_timeout_s"], code)
        return code
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
            finalize_mpi(config["runtime_monitor"]["stop_timeout_s"], code)


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
    _end_right_after_mpich_exit_handlers()  # before MPI_Init registers them: see exit_process
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


def finalize_mpi(timeout_s: float, exit_code: int) -> None:
    """MPI_Finalize (a barrier of all ranks) so that no rank's exit kills another; a peer that dies
    meanwhile cannot hang the exit: after ``timeout_s`` this process exits (``exit_code``) without it."""
    from mpi4py import MPI

    watchdog = threading.Timer(timeout_s, os._exit, (exit_code,))
    watchdog.daemon = True
    watchdog.start()
    MPI.Finalize()
    watchdog.cancel()


def _end_right_after_mpich_exit_handlers() -> None:
    """Register ``_exit(status)`` as a C exit handler now, just before MPI_Init: C ``exit`` runs its
    handlers in reverse order of registration, so it runs right after those MPI_Init registers
    (MPICH's, which tells the process manager the rank finalized) and before those of everything
    loaded earlier (torch's, libzmq's C++ static destructors, the libraries' finalizers), which
    are then never run. A pure C handler (``on_exit`` hands it the status): it must also work after
    Python's own finalization (a rank ending with ``sys.exit``)."""
    libc = ctypes.CDLL(None)
    if libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None) != 0:
        logging.getLogger(__name__).warning("on_exit failed: this rank's exit runs every C exit handler")


def exit_process(code: int, grace_s: float) -> NoReturn:
    """End this rank's process with ``code`` without Python's shutdown, which would join threads
    that may be waiting on a dead peer.

    A rank that called MPI_Finalize leaves through the C library's ``exit``: MPICH tells its process
    manager that the rank finalized from an exit handler (``cmd=finalize`` on the PMI socket, seen
    with strace), and a rank leaving a finalized MPI with ``_exit`` makes MPICH's Hydra SIGKILL the
    ranks still running (mpirun exits 9 after a finished run; measured with 4 ranks doing
    ``Finalize(); os._exit(0)``: 4-13 of 16 jobs, against 0 of 16 through ``exit``). But ``exit``
    then also ran every library's exit-time destructors while native threads (ZMQ IO threads serving
    whatever connects, torch's pools) were still using that state: after hostile traffic on its
    ports a preempted rank aborted in glibc (``free(): invalid next size``, rc 6 instead of 3). So
    the handler registered just before MPI_Init (``_end_right_after_mpich_exit_handlers``) ends
    the process with ``_exit(code)`` right after MPICH's handlers: the process manager hears the
    finalize, and no destructor runs beside a live thread. Python's buffers are flushed here first.
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
