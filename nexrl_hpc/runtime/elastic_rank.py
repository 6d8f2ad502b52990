"""A rollout rank that joins a running job from outside its MPI world (``nexrl-join RUN_DIR``).

It reads ``<run_dir>/elastic/join.json`` (the door and this start's credential) and the run's
``config.yaml``, proves the credential at the door (runtime/elastic.py), gets its rank and the job
key, opens its signed RPC endpoint, builds a rollout worker and its inference service as a rollout
rank does, starts the server, reports ready, and waits for rank 0 to wire it in between tasks (rank
0 loads it the current weights and adds it to the weight-sync set and the dispatch). Then it serves
like a rollout rank: heartbeats to rank 0 until told to stop, or rank 0 stops answering.

Leaving is normal: on SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 (``scancel``, preemption, the time
limit) it kills its server, tells rank 0 it leaves (its tasks in flight are re-issued there), and
exits 0. Dying silently is the same to rank 0, only later (``health_check.timeout``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import yaml

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.execute import execute_async
from nexrl_hpc.core.module import NexRLModule, abort_modules
from nexrl_hpc.rpc.endpoint import RPC_MODULE, RpcEndpoint
from nexrl_hpc.rpc.handles import Directory, ModuleRegistry
from nexrl_hpc.rpc.preauth import WireLimits
from nexrl_hpc.runtime.bootstrap import TRACKER
from nexrl_hpc.runtime.elastic import (
    PROTOCOL,
    JoinCredential,
    JoinRefused,
    mac,
    read_credential,
    recv_frame,
    send_frame,
    wrap_key,
)
from nexrl_hpc.runtime.network import resolve_bind_address
from nexrl_hpc.runtime.roles import RoleRegistry, RunContext
from nexrl_hpc.types import NexRLRole

logger = logging.getLogger(__name__)

LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class Admission:
    """What the door told a proven joiner."""

    rank: int
    key: bytes
    names: list[str]
    body: dict[str, Any]
    conn: socket.socket
    nonces: tuple[str, str]


def prove_membership(cred: JoinCredential, timeout_s: float, started_at: float | None = None) -> Admission:
    """Steps 1-3 of the handshake: the challenge answered, the door's own proof checked.
    ``started_at``: when this joiner started (its join time's origin, for the status)."""
    conn = socket.create_connection((cred.host, cred.port), timeout=timeout_s)
    try:
        challenge = recv_frame(conn)
        if challenge.get("proto") != PROTOCOL:
            raise JoinRefused(f"the door speaks {challenge.get('proto')!s:.32}, not {PROTOCOL}")
        door_nonce, nonce = str(challenge["nonce"]), secrets.token_hex(16)
        send_frame(
            conn,
            {
                "run_id": cred.run_id,
                "generation": cred.generation,
                "nonce": nonce,
                "proof": mac(cred.secret, "join", door_nonce, nonce, cred.run_id, cred.generation),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "job": os.environ.get("SLURM_JOB_ID"),
                "started_at": started_at if started_at is not None else time.time(),
            },
        )
        reply = recv_frame(conn)
        if "refused" in reply:
            raise JoinRefused(f"the run refused this joiner: {reply['refused']}")
        encoded = str(reply["body"])
        if not secrets.compare_digest(
            str(reply.get("proof")), mac(cred.secret, "door", door_nonce, nonce, encoded)
        ):
            raise JoinRefused("the door did not prove it holds the credential: not this run's driver")
    except BaseException:
        conn.close()
        raise
    body = json.loads(encoded)
    key = wrap_key(cred.secret, bytes.fromhex(body["wrapped_key"]), door_nonce, nonce)
    return Admission(int(body["rank"]), key, list(body["names"]), body, conn, (door_nonce, nonce))


class JoinedRank:
    """One joined rollout rank's life: ``serve()`` returns the process exit code."""

    def __init__(self, run_dir: str, roles: RoleRegistry, started_at: float | None = None) -> None:
        """``started_at``: when ``nexrl-join`` started (or found the run's door): the join time's origin."""
        self._started_at = started_at
        self._run_dir = os.path.abspath(run_dir)
        self._roles = roles
        self._stop = threading.Event()  # rank 0 said shutdown/abort, or a signal said leave
        self._released = threading.Event()
        self._leaving = ""  # the signal that ends this rank (it tells rank 0)
        self._modules: list[NexRLModule] = []
        self._code = 0

    @property
    def left(self) -> bool:
        """It ended on a leave signal (cancelled, preempted, its time up), not because the run stopped."""
        return bool(self._leaving)

    def serve(self) -> int:
        cred = read_credential(self._run_dir)
        config = load_run_config(self._run_dir)
        elastic = config["runtime"]["elastic"]
        started = time.monotonic()
        admission = prove_membership(cred, elastic["handshake_timeout_s"], self._started_at)
        for sig in LEAVE_SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            endpoint = self._start(config, admission, cred)
        except BaseException:
            abort_modules(self._modules)
            admission.conn.close()
            raise
        logger.info(
            "elastic: joined the run as rank %d in %.1f s (%s)",
            admission.rank,
            time.monotonic() - started,
            ", ".join(admission.names),
        )
        self._serve_until_stopped(config, admission, endpoint)
        if self._leaving:
            # rank 0 first: it retires this rank (its calls here fail as a lost rank's, its tasks
            # are re-issued) before the server goes, so a sync or canary in flight here is not
            # mistaken for an engine that failed
            try:
                endpoint.call_async(
                    0, RPC_MODULE, "elastic_leave", (admission.rank, self._leaving), {}, 5.0
                ).result(timeout=5.0)
            except Exception:
                pass  # rank 0 sees it silent instead
            for module in self._modules:  # a broadcast in flight ends first (the group's timeout bounds it)
                wait_for_receives = getattr(module, "wait_for_receives", None)  # the inference service's
                if wait_for_receives is not None:
                    wait_for_receives(config["weight"]["broadcast_timeout_s"])
            abort_modules(self._modules)
            return 0
        _stop_quietly(self._modules)
        self._released.wait(config["runtime_monitor"]["stop_timeout_s"])
        endpoint.close()
        return self._code

    def _start(self, config: RLTrainConfig, admission: Admission, cred: JoinCredential) -> RpcEndpoint:
        """Endpoint, modules, server, start-up report; returns once rank 0 wired this rank in."""
        body = admission.body
        rpc = config["runtime"]["rpc"]
        bind = resolve_bind_address(rpc["interface"], "runtime.rpc.interface")
        registry = ModuleRegistry()
        locations: dict[str, tuple[int, type]] = {
            name: (int(rank), self._roles.role_class(NexRLRole(role), config))
            for name, (rank, role) in body["locations"].items()
        }
        locations[TRACKER] = (0, ActivityTracker)
        box: list[Directory] = []
        endpoint = RpcEndpoint(
            admission.rank,
            bind.address,
            admission.key,
            max_message_bytes=rpc["max_message_mb"] << 20,
            server_threads=rpc["server_threads"],
            call_timeout_s=rpc["call_timeout_s"],
            direct_sockets_per_peer=rpc["direct_sockets_per_peer"],
            long_poll_threads=rpc["long_poll_threads_per_peer"],
            lookup=registry.lookup,
            resolve_handle=lambda name: box[0].resolve(name),
            limits=WireLimits.from_config(rpc),
        )
        box.append(Directory(admission.rank, endpoint, registry, locations))
        registry.add_builtin("ping", lambda: True)
        registry.add_builtin("shutdown", self._shutdown)
        registry.add_builtin("abort", self._abort)
        registry.add_builtin("release", lambda finalize=False: self._released.set())
        ctx = RunContext(**body["context"])
        proxy = ActivityTrackerProxy(box[0].resolve(TRACKER))
        worker_name, service_name = admission.names
        for name, role in (
            (service_name, NexRLRole.INFERENCE_SERVICE),
            (worker_name, NexRLRole.ROLLOUT_WORKER),
        ):
            module = self._roles.build_module(role, config, ctx)
            module.set_module_name(name)
            module.set_activity_tracker(proxy)
            registry.add(name, module)
            self._modules.append(module)
        service = registry.get(service_name)
        assert service is not None
        service.launch()
        service.wait_ready()
        endpoint.connect({0: body["driver"]["address"]}, {0: body["driver"]["lane_address"]})
        door_nonce, nonce = admission.nonces
        send_frame(
            admission.conn,
            {
                "address": endpoint.address,
                "lane_address": endpoint.lane_address,
                "proof": mac(
                    cred.secret,
                    "ready",
                    door_nonce,
                    nonce,
                    admission.rank,
                    endpoint.address,
                    endpoint.lane_address,
                ),
            },
        )
        with admission.conn:
            admission.conn.settimeout(config["runtime"]["elastic"]["admit_timeout_s"] + 30.0)
            verdict = recv_frame(admission.conn)
        if not verdict.get("admitted"):
            raise JoinRefused(f"the run did not wire this joiner in: {verdict.get('refused')}")
        return endpoint

    def _serve_until_stopped(
        self, config: RLTrainConfig, admission: Admission, endpoint: RpcEndpoint
    ) -> None:
        """Heartbeat to rank 0 until told to stop, a leave signal, or rank 0 silent for the timeout."""
        health = config["runtime_monitor"]["health_check"]
        tracker = Directory(
            admission.rank, endpoint, ModuleRegistry(), {TRACKER: (0, ActivityTracker)}
        ).resolve(TRACKER)
        last_ok = time.monotonic()
        while not self._stop.wait(health["check_interval"]):
            reply = execute_async(
                tracker.heartbeat, admission.rank, socket.gethostname(), admission.names, endpoint.stats()
            )
            done, _ = wait_futures([reply], timeout=health["timeout"])
            if done and reply.exception() is None:
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > health["timeout"]:
                print(f"error: joined rank {admission.rank}: rank 0 stopped answering", file=sys.stderr)
                self._code = 1
                self._released.set()
                break

    # --- rank built-ins and signals --------------------------------------------------------------
    def _shutdown(self, reason: str, exit_code: int) -> bool:
        self._code = 0 if exit_code == 0 else int(exit_code)
        self._stop.set()
        return True

    def _abort(self, reason: str, exit_code: int) -> bool:
        abort_modules(self._modules)
        self._code = int(exit_code)
        self._released.set()
        self._stop.set()
        return True

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._leaving = f"{signal.Signals(signum).name}: the joined rank is leaving"
        self._stop.set()


def load_run_config(run_dir: str) -> RLTrainConfig:
    """The run's own config (the controller writes it at start-up)."""
    path = os.path.join(run_dir, "config.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or "runtime" not in config:
        raise JoinRefused(f"{path}: not a run's config")
    return config  # type: ignore[return-value]


def _stop_quietly(modules: list[NexRLModule]) -> None:
    for module in reversed(modules):  # the worker first, then its server
        try:
            module.stop()  # type: ignore[attr-defined]
        except Exception:
            logger.exception("stopping %s", module.get_module_name())
