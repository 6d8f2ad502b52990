"""One rank of a trainer group: rank 0 serves clients, the other ranks follow rank 0.

Rank 0 binds one ZMQ ROUTER. A client sends a whole batch there (``data``); rank 0 keeps it and
ACKs, and only an ``execute`` for that op id, relayed by the API server (standalone), starts the
work. The embedded client (inside the MPI job, no API server between) marks its batch ``execute``
instead and rank 0 starts on receipt, saving the ACK round trip. Either way rank 0 broadcasts the
operation to the group, plans the batch into per-rank shards and scatters them, every rank
computes on its shard, rows and per-rank status gather on rank 0, and the result goes back to the
client that sent the data. An ``update_actor`` may carry ``export_path``: once every rank has
updated, the group exports the weights it made before rank 0 answers (one round trip for the
client, and a batch sent behind it cannot be trained before the export). Messages are taken one at
a time: a batch sent while another trains waits in the socket and starts the moment the one before
it is answered. Idle, rank 0 broadcasts a tick every ``idle_tick_s`` so the followers' waits stay
short and a dead rank is noticed. A collective that fails breaks the group for good:
every later request gets that error (torch.distributed groups cannot heal).

Rank 0's ROUTER keeps the run's pre-authentication limits (``nexrl_hpc/rpc/preauth.py``): PLAIN
with the password derived from the group key, checked on its ``ConnectionWatch``'s thread (so a
handshake never waits for a training step), frames at most the budget, connections waiting to
authenticate capped. Messages must name rank 0's address as their recipient.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any

import torch
import zmq

from nexrl_hpc.rpc.limits import Rejections
from nexrl_hpc.rpc.preauth import WireLimits, ensure_fd_room
from nexrl_hpc.rpc.watch import ConnectionWatch
from nexrl_hpc.trainer.batch_plan import data_parallel_rows
from nexrl_hpc.trainer.group_comm import GroupComm
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.protocol import BATCH_OPERATIONS, CALL_OPERATIONS, SignedChannel

logger = logging.getLogger(__name__)
_STOPPED: dict[str, Any] = {"ok": True, "error": None}
_MAX_PENDING = 4  # batches held between their ACK and their execute signal
Client = tuple[bytes, str]  # a client of rank 0: its ROUTER routing id and its channel's sender id


def _batch_args(operation: str, args: Any) -> tuple[dict[str, Any], str | None]:
    """A batch's arguments: ``update_actor`` may name where to export the weights it makes."""
    if args is None or args == {}:
        return {}, None
    if (
        operation == "update_actor"
        and isinstance(args, dict)
        and set(args) == {"export_path"}
        and isinstance(args["export_path"], str)
        and args["export_path"]
    ):
        return {"export_path": args["export_path"]}, None
    return (
        {},
        f"{operation}: unexpected arguments {sorted(args) if isinstance(args, dict) else type(args).__name__}",
    )


class TrainerRank:
    def __init__(
        self,
        policy_trainer: PolicyTrainer,
        device: torch.device,
        key: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_message_bytes: int,
        idle_tick_s: float,
        limits: WireLimits,
    ):
        self.policy_trainer = policy_trainer
        self.comm = GroupComm(device)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self._idle_tick_s = idle_tick_s
        self._channel = SignedChannel(key, max_message_bytes, limits, name=f"trainer{self.rank}")
        self._pending: dict[str, tuple[Client, str, dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.broken: str | None = None
        self.address: str | None = None
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._watch: ConnectionWatch | None = None
        self._dropped = Rejections("trainer rank 0")  # connections that never authenticated (the watch's)
        if self.rank == 0:
            ensure_fd_room(1, limits)
            self._ctx = zmq.Context()
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 1000)
            self._channel.prepare_server(self._router)
            self._watch = ConnectionWatch(self._router, key, limits, self._dropped.reject, "trainer rank 0")
            if port:
                self._router.bind(f"tcp://{host}:{port}")
                self.address = f"tcp://{host}:{port}"
            else:
                self.address = f"tcp://{host}:{self._router.bind_to_random_port(f'tcp://{host}')}"
            self._channel.me = self.address  # what clients name as the recipient

    @property
    def rejected(self) -> int:
        """Messages and connections dropped before anything was decoded."""
        return self._channel.rejected + self._dropped.count

    def _rank0_router(self) -> zmq.Socket:
        assert self._router is not None, "only trainer rank 0 serves clients"
        return self._router

    def serve(self, stop: threading.Event) -> None:
        """Run until ``stop`` (rank 0) or until rank 0 says stop (others). Raises if the group broke
        on a follower (the process should exit non-zero)."""
        if self.rank == 0:
            try:
                self._serve_clients(stop)
            finally:
                assert self._router is not None and self._ctx is not None and self._watch is not None
                self._watch.close()
                self._router.close()
                self._ctx.term()
        else:
            self._follow()

    # --- rank 0 -----------------------------------------------------------------------------------
    def _serve_clients(self, stop: threading.Event) -> None:
        router, watch = self._router, self._watch
        assert router is not None and watch is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        tick_s = self._idle_tick_s
        last_tick = time.monotonic()
        while not stop.is_set():
            events = dict(poller.poll(int(tick_s * 1000)))
            if router in events:
                frames = router.recv_multipart(copy=False)
                message = self._channel.feed(frames)
                if message is not None:
                    routing_id, sender, header, tensors = message
                    assert routing_id is not None
                    if watch.unmarked:  # connections wait to authenticate: this one has
                        watch.mark(frames[1].get(zmq.SRCFD))
                    self._on_message((routing_id, sender), header, tensors)
            elif self.broken is None and time.monotonic() - last_tick >= tick_s:
                last_tick = time.monotonic()
                self._group_step({"op": "tick"}, None, lambda: None)
        if self.broken is None:
            try:
                self.comm.broadcast_header({"op": "stop"})
                # every follower answers before rank 0 exits: an exit racing the followers' reads
                # could reset the connection under a stop they have not read yet (exit 1 there)
                self.comm.gather_status(_STOPPED)
            except Exception as exc:  # a follower already gone: nothing to stop there
                logger.warning("trainer group stop: %s", exc)

    def _on_message(self, client: Client, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        kind, op_id = header["kind"], str(header.get("op_id", ""))
        if kind == "data":
            operation = header.get("operation")
            if operation not in BATCH_OPERATIONS:
                self._reply(client, op_id, error=f"unknown batch operation {operation!r}")
                return
            args, problem = _batch_args(operation, header.get("args"))
            if problem is not None:
                self._reply(client, op_id, error=problem)
                return
            if header.get("execute") is True:  # the embedded client's batch with its execute signal
                self._run(client, op_id, operation, tensors, args)
                return
            while len(self._pending) >= _MAX_PENDING:  # clients that gave up never execute theirs
                dropped = next(iter(self._pending))
                del self._pending[dropped]
                logger.warning("trainer rank 0: dropped the data of %s (never executed)", dropped)
            self._pending[op_id] = (client, operation, tensors, args)
            logger.debug("data for %s %s received; ACK", operation, op_id)
            self._send(client, {"kind": "ack", "op_id": op_id})
        elif kind == "execute":
            entry = self._pending.pop(op_id, None)
            if entry is None:
                self._reply(client, op_id, error=f"execute for {op_id}: no data received for it (not ACKed)")
                return
            if client != entry[0]:  # relayed by the API server: it only needs to know it started
                self._send(client, {"kind": "started", "op_id": op_id})
            data_client, operation, batch, args = entry
            self._run(data_client, op_id, operation, batch, args)
        elif kind == "call":
            operation = header.get("operation")
            if operation not in CALL_OPERATIONS:
                self._reply(client, op_id, error=f"unknown operation {operation!r}")
                return
            self._run(client, op_id, operation, None, dict(header.get("args") or {}))
        else:
            self._reply(client, op_id, error=f"unknown message kind {kind!r}")

    def _run(
        self, client: Client, op_id: str, operation: str, batch: dict[str, torch.Tensor] | None, args: dict
    ) -> None:
        if self.broken is not None:
            self._reply(client, op_id, error=f"trainer group is broken: {self.broken}")
            return
        if operation == "ping":
            self._reply(client, op_id, value={"world_size": self.world_size})
            return
        out: dict[str, Any] = {}
        try:
            plan, shards = (
                self.policy_trainer.plan_batch(operation, batch) if batch is not None else (None, None)
            )
        except Exception as exc:  # bad batch: nothing was broadcast yet
            self._reply(client, op_id, error=f"{operation}: {type(exc).__name__}: {exc}")
            return
        header = {"op": operation, "args": {} if batch is not None else args, "plan": plan}
        if not self._group_ok(client, op_id, operation, self._group_step(header, shards, lambda: out)):
            return
        if args.get("export_path"):  # only once every rank has updated: the export is a collective too
            started = time.monotonic()
            export = {"op": "export_weights", "args": {"path": args["export_path"]}, "plan": None}
            if not self._group_ok(client, op_id, operation, self._group_step(export, None, dict)):
                return
            out["value"]["export_s"] = time.monotonic() - started
        self._reply(client, op_id, value=out.get("value"), tensors=out.get("tensors"))

    def _group_ok(
        self, client: Client, op_id: str, operation: str, statuses: list[dict[str, Any]] | None
    ) -> bool:
        """Every rank did its part; otherwise the client is told which rank failed and how."""
        if statuses is None:
            self._reply(client, op_id, error=f"{operation}: trainer group broke: {self.broken}")
            return False
        failed = [(r, s["error"]) for r, s in enumerate(statuses) if not s["ok"]]
        if failed:
            where = "; ".join(f"trainer rank {r}: {e}" for r, e in failed)
            self._reply(client, op_id, error=f"{operation} failed on {where}")
            return False
        return True

    def _group_step(self, header: dict[str, Any], shards: Any, out_box: Any) -> list[dict[str, Any]] | None:
        """Broadcast, (scatter), execute here, gather; None when a collective failed."""
        try:
            self.comm.broadcast_header(header)
            if header["op"] == "tick":
                return []
            shard = self.comm.scatter_shards(shards) if shards is not None else None
            status = self._execute(header, shard, out_box())
            return self.comm.gather_status(status)
        except Exception as exc:
            detail = str(exc).splitlines()[0][:300] if str(exc) else ""
            self.broken = f"a collective failed during {header['op']} ({type(exc).__name__}: {detail})"
            logger.error("trainer rank 0: %s", self.broken)
            return None

    def _reply(
        self,
        client: Client,
        op_id: str,
        value: Any = None,
        tensors: dict[str, torch.Tensor] | None = None,
        error: str | None = None,
    ) -> None:
        header = {"kind": "result", "op_id": op_id, "ok": error is None, "value": value, "error": error}
        try:
            self._send(client, header, tensors)
        except ValueError as exc:  # result over the size limit
            header.update(ok=False, value=None, error=str(exc))
            self._send(client, header)

    def _send(
        self, client: Client, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
    ) -> None:
        routing_id, sender = client
        self._channel.send(self._rank0_router(), header, sender, tensors, routing_id=routing_id)

    # --- every rank -------------------------------------------------------------------------------
    def _execute(
        self, header: dict[str, Any], shard: dict[str, torch.Tensor] | None, out: dict
    ) -> dict[str, Any]:
        """This rank's part of one operation; the collectives after it run whatever happened."""
        op, args, plan = header["op"], header["args"], header["plan"]
        trainer = self.policy_trainer
        status: dict[str, Any] = {"ok": True, "error": None}
        logp: torch.Tensor | None = None
        try:
            if op == "compute_log_prob":
                assert shard is not None
                logp = trainer.compute_log_prob_shard(shard, plan)
            elif op == "update_actor":
                assert shard is not None
                out["value"] = {"metrics": trainer.update_actor_shard(shard, plan)}
            elif op == "initialize_worker":
                trainer.initialize_worker(
                    args["config"], role=args.get("role", "actor"), world_size=args["world_size"]
                )
            elif op == "init_model":
                trainer.init_model()
            elif op == "save_checkpoint":
                trainer.save_checkpoint(
                    args["local_path"], args["global_step"], args.get("save_weight_only", False)
                )
            elif op == "load_checkpoint":
                trainer.load_checkpoint(args["local_path"], args.get("load_optimizer", True))
            elif op == "export_weights":
                trainer.export_weights(args["path"])
            elif op == "broadcast_weights":
                out["value"] = trainer.broadcast_weights(args["spec"])
            else:
                raise ValueError(f"unknown operation {op!r}")
        except Exception as exc:
            logger.error("trainer rank %d: %s failed:\n%s", self.rank, op, traceback.format_exc())
            status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if op == "compute_log_prob":  # the gather runs on every rank, failed or not
            assert shard is not None and plan is not None
            counts = plan["counts"][0]
            if logp is None:
                logp = torch.zeros((counts[self.rank], shard["responses"].shape[1]))
            rows = self.comm.gather_rows(logp, counts)
            if rows is not None:
                out["tensors"] = {
                    "old_log_probs": data_parallel_rows(rows, counts, plan["sequence_parallel"])
                }
        return status

    # --- ranks > 0 --------------------------------------------------------------------------------
    def _follow(self) -> None:
        while True:
            header = self.comm.broadcast_header(None)
            if header["op"] == "stop":
                self.comm.gather_status(_STOPPED)
                return
            if header["op"] == "tick":
                continue
            shard = self.comm.scatter_shards(None) if header["plan"] is not None else None
            status = self._execute(header, shard, {})
            self.comm.gather_status(status)
