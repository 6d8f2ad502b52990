"""TrainGroupClient: the TrainBackend of a trainer group (the training service's direct-ZMQ client).

Batches go to trainer rank 0 only, over one signed ZMQ connection; the control plane decides how
a batch is started (``Control.submit``), then the client waits for the result:

- ``DirectControl`` (embedded: trainer ranks inside the MPI job): the execute signal travels with
  the batch (rank 0 runs it on receipt: no ACK round trip) and the
  batch-less calls go to rank 0 over the same connection.
- ``ApiServerControl`` (standalone): the client waits for rank 0's ACK of the batch, then the
  execute signal and the batch-less calls go to the API server over HTTP with the bearer token,
  which relays them; the server also reports each rank's heartbeat, so a dead rank is named.

Every wait is bounded: ``zmq_recv_timeout_ms`` for one answer, ``zmq_total_timeout_ms`` for a
whole operation; the error names the rank that did not answer.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from typing import Any

import torch
import zmq

from nexrl_hpc.rpc.preauth import WireLimits
from nexrl_hpc.trainer.backend import TrainBackend, UpdateInFlight
from nexrl_hpc.trainer.batch_contract import check_batch
from nexrl_hpc.trainer.protocol import SignedChannel, TrainerRankError

_LIVENESS_CHECK_S = 1.0


class Control(ABC):
    """How the execute signal and batch-less operations reach the trainer group."""

    heartbeat_timeout_s = 0.0

    @abstractmethod
    def submit(
        self, client: TrainGroupClient, data: dict[str, Any], tensors: dict[str, Any], timeout_s: float
    ) -> None:
        """Hand the batch to rank 0 and start its operation (the client waits for the result).
        ``data``: the batch's header (kind "data", op_id, operation, args), made by the client."""

    @abstractmethod
    def call(
        self, client: TrainGroupClient, operation: str, args: dict[str, Any], timeout_s: float
    ) -> Any: ...

    def dead_ranks(self) -> str | None:
        """A description of ranks known to be gone, or None (checked while waiting)."""
        return None


class DirectControl(Control):
    def submit(
        self, client: TrainGroupClient, data: dict[str, Any], tensors: dict[str, Any], timeout_s: float
    ) -> None:
        client.send({**data, "execute": True}, tensors)  # rank 0 starts on receipt: no ACK round trip

    def call(self, client: TrainGroupClient, operation: str, args: dict[str, Any], timeout_s: float) -> Any:
        op_id = client.new_op_id(operation)
        client.send({"kind": "call", "op_id": op_id, "operation": operation, "args": args})
        value, _ = client.wait_result(op_id, operation, timeout_s)
        return value


class TrainGroupClient(TrainBackend):
    def __init__(
        self,
        address: str,
        key: bytes,
        control: Control,
        recv_timeout_ms: int,
        total_timeout_ms: int,
        max_message_bytes: int,
        limits: WireLimits,
        model_path: str | None = None,
    ):
        self.address = address
        self._control = control
        self._recv_timeout_s = recv_timeout_ms / 1000
        self._total_timeout_s = total_timeout_ms / 1000
        self._model_path = model_path
        self._channel = SignedChannel(key, max_message_bytes, limits, name="client")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._channel.prepare_client(self._sock)
        self._sock.connect(address)
        # an unclosed client must not hang the garbage collector: collected in a reference cycle,
        # the context's __del__ no longer sees its socket (weakrefs are cleared first) and its
        # term() would wait for that socket forever; the finalizer holds both and closes in order
        self._release = weakref.finalize(self, _close_zmq, self._sock, self._ctx)
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # updates sent and not yet answered (start_update_actor)
        # their answers, read while waiting for another answer: (op id, kind) -> (header, tensors)
        self._early: dict[tuple[str, str], tuple[dict, dict]] = {}
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    # --- plumbing used by the controls ------------------------------------------------------------
    def new_op_id(self, operation: str) -> str:
        return f"{operation}-{self._prefix}-{next(self._ids)}"

    def send(self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        self._channel.send(self._sock, header, self.address, tensors)

    def wait_result(
        self, op_id: str, operation: str, timeout_s: float, kind: str = "result"
    ) -> tuple[Any, dict]:
        """Wait for ``kind`` of ``op_id`` (at most the receive timeout, within ``timeout_s``)."""
        start = time.monotonic()
        deadline = start + min(timeout_s, self._recv_timeout_s)
        next_check = start + _LIVENESS_CHECK_S
        early = self._early.pop((op_id, kind), None)
        if early is not None:
            return self._answer(early[0], kind, early[1])
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TrainerRankError(
                    f"{operation}: trainer rank 0 ({self.address}) did not answer within "
                    f"{now - start:.1f}s (zmq_recv_timeout_ms / zmq_total_timeout_ms)" + self._dead_suffix()
                )
            if now >= next_check:
                next_check = now + _LIVENESS_CHECK_S
                dead = self._control.dead_ranks()
                if dead:
                    raise TrainerRankError(f"{operation}: {dead}")
            if not self._sock.poll(int((min(deadline, next_check) - now) * 1000) + 1):
                continue
            message = self._channel.feed(self._sock.recv_multipart(copy=False))
            if message is None:
                continue  # part of a longer answer, or dropped and counted (never taken for the real one)
            _, _, header, tensors = message
            if header.get("op_id") != op_id or header["kind"] != kind:
                self._keep_if_in_flight(header, tensors)
                continue
            return self._answer(header, kind, tensors)

    def _keep_if_in_flight(self, header: dict, tensors: dict) -> None:
        """An answer to a batch sent earlier is kept for its caller; any other was given up on (timed out)."""
        if header.get("op_id") in self._in_flight:
            self._early[(str(header["op_id"]), str(header["kind"]))] = (header, tensors)

    def _answer(self, header: dict, kind: str, tensors: dict) -> tuple[Any, dict]:
        if kind == "result" and not header["ok"]:
            raise TrainerRankError(header["error"] + self._who_is_gone(header["error"]))
        return header.get("value"), tensors

    def _who_is_gone(self, error: str) -> str:
        """A broken group: wait (at most one heartbeat timeout) to learn which rank is gone."""
        if "trainer group" not in error or "brok" not in error:
            return ""
        deadline = time.monotonic() + self._control.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            if self._control.dead_ranks():
                # a launcher (torchrun) ends the other ranks when one dies, so their last heartbeats
                # land within one beat of each other: wait half a timeout and name every silent rank
                time.sleep(self._control.heartbeat_timeout_s / 2)
                return f"; {self._control.dead_ranks()}"
            time.sleep(0.25)
        return ""

    def _dead_suffix(self) -> str:
        dead = self._control.dead_ranks()
        return f"; {dead}" if dead else ""

    # --- TrainBackend -----------------------------------------------------------------------
    def _batch_operation(self, operation: str, tensors: dict[str, Any]) -> tuple[Any, dict]:
        op_id, start = self._send_batch(operation, tensors)
        return self._wait_batch(op_id, operation, start)

    def _send_batch(
        self, operation: str, tensors: dict[str, Any], args: dict[str, Any] | None = None
    ) -> tuple[str, float]:
        """Hand a batch to rank 0 (started by the control plane); its op id and when it was sent."""
        check_batch(operation, tensors)  # names and row counts, before a byte is sent
        with self._lock:
            start = time.monotonic()
            op_id = self.new_op_id(operation)
            self._in_flight.add(op_id)
            try:
                data = {"kind": "data", "op_id": op_id, "operation": operation, "args": args or {}}
                self._control.submit(self, data, tensors, self._total_timeout_s)
            except BaseException:
                self._in_flight.discard(op_id)
                raise
        return op_id, start

    def _wait_batch(self, op_id: str, operation: str, start: float) -> tuple[Any, dict]:
        """The answer to a batch sent at ``start``; queued behind batches sent before it, its budget
        counts from its own sending."""
        with self._lock:
            try:
                return self.wait_result(op_id, operation, self._total_timeout_s - (time.monotonic() - start))
            finally:
                self._in_flight.discard(op_id)
                self._early.pop((op_id, "result"), None)

    def _call(self, operation: str, **args: Any) -> Any:
        with self._lock:
            return self._control.call(self, operation, args, self._total_timeout_s)

    def initialize_worker(
        self, config_dict: dict[str, Any], role: str = "actor", world_size: int = 1
    ) -> None:
        if self._model_path is not None:
            config_dict = dict(config_dict, model_path=self._model_path)
        self._call("initialize_worker", config=config_dict, role=role, world_size=world_size)

    def init_model(self) -> None:
        self._call("init_model")

    def compute_log_prob(self, batch: dict[str, Any]) -> dict[str, Any]:
        _, tensors = self._batch_operation("compute_log_prob", batch["batch"])
        return {"batch": {"old_log_probs": tensors["old_log_probs"]}, "meta_info": {}}

    def update_actor(self, batch: dict[str, Any]) -> dict[str, Any]:
        value, _ = self._batch_operation("update_actor", batch["batch"])
        return {"meta_info": {"metrics": value["metrics"]}}

    queues_updates = True

    def start_update_actor(self, batch: dict[str, Any], export_path: str) -> UpdateInFlight:
        """Send the batch with its export path and return: rank 0 takes messages one at a time, so
        a batch sent behind this one starts when this one is exported (``_GroupUpdate.result``)."""
        args = {"export_path": export_path} if export_path else {}  # none: the weights are broadcast
        op_id, start = self._send_batch("update_actor", batch["batch"], args)
        return _GroupUpdate(self, op_id, start)

    def answered(self, op_id: str) -> bool:
        """Whether the batch ``op_id`` has been answered; reads (and keeps) what has arrived."""
        with self._lock:
            while (op_id, "result") not in self._early and self._sock.poll(0):
                message = self._channel.feed(self._sock.recv_multipart(copy=False))
                if message is not None:
                    self._keep_if_in_flight(message[2], message[3])
            return (op_id, "result") in self._early

    def save_checkpoint(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        self._call(
            "save_checkpoint",
            local_path=local_path,
            global_step=global_step,
            save_weight_only=save_weight_only,
        )

    def load_checkpoint(self, local_path: str, load_optimizer: bool = True) -> None:
        self._call("load_checkpoint", local_path=local_path, load_optimizer=load_optimizer)

    def export_weights(self, path: str) -> None:
        self._call("export_weights", path=path)

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("broadcast_weights", spec=spec))

    def health(self) -> bool:
        try:
            self._call("ping")
            return True
        except TrainerRankError:
            return False

    def close(self) -> None:
        self._release()


class _GroupUpdate(UpdateInFlight):
    def __init__(self, client: TrainGroupClient, op_id: str, start: float):
        self._client, self._op_id, self._start = client, op_id, start

    def result(self) -> dict[str, Any]:
        value, _ = self._client._wait_batch(self._op_id, "update_actor", self._start)
        return {"meta_info": {"metrics": value["metrics"], "export_s": value.get("export_s")}}

    def done(self) -> bool:
        return self._client.answered(self._op_id)


class ApiServerControl(Control):
    """Standalone: execute signals and batch-less operations through the API server (HTTP + token)."""

    _PATHS = {
        "initialize_worker": "initialize",
        "init_model": "init_model",
        "save_checkpoint": "save_checkpoint",
        "load_checkpoint": "load_checkpoint",
        "export_weights": "export_weights",
        "broadcast_weights": "broadcast_weights",
    }

    def __init__(self, url: str, token: str, identifier: str, heartbeat_timeout_s: float):
        import httpx

        self.url = url.rstrip("/")
        self.identifier = identifier
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0
        )

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        import httpx

        try:
            resp = self._http.post(path, json=body, timeout=timeout_s + 5)
        except httpx.HTTPError as exc:
            raise TrainerRankError(f"train service API server {self.url}{path}: {exc}") from exc
        if resp.status_code != 200:
            raise TrainerRankError(
                f"{self.url}{path} ({self.identifier}): HTTP {resp.status_code}: {_detail(resp)}"
            )
        return resp.json()

    def group_info(self) -> dict[str, Any]:
        resp = self._http.get("/get_worker_group_info", params={"identifier": self.identifier})
        if resp.status_code != 200:
            raise TrainerRankError(f"{self.url}/get_worker_group_info ({self.identifier}): {_detail(resp)}")
        return resp.json()

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The group's info once every rank has reported its endpoint."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                info = self.group_info()
                if info["ready"]:
                    return info
            except TrainerRankError as exc:
                if "HTTP 401" in str(exc):  # a wrong token will not get better by waiting
                    raise
            time.sleep(0.2)
        reported = len(info.get("endpoints", {})) if info else 0
        raise TrainerRankError(
            f"worker group {self.identifier!r} at {self.url} not ready after {timeout_s:.0f}s "
            f"(rank 0 endpoint reported: {bool(info.get('endpoints', {}).get('0'))}, {reported} endpoint(s))"
        )

    def submit(
        self, client: TrainGroupClient, data: dict[str, Any], tensors: dict[str, Any], timeout_s: float
    ) -> None:
        start = time.monotonic()
        client.send(data, tensors)
        client.wait_result(data["op_id"], data["operation"], timeout_s, kind="ack")
        self.execute(client, data["op_id"], timeout_s - (time.monotonic() - start))

    def execute(self, client: TrainGroupClient, op_id: str, timeout_s: float) -> None:
        self._post("/execute", {"identifier": self.identifier, "op_id": op_id}, timeout_s)

    def call(self, client: TrainGroupClient, operation: str, args: dict[str, Any], timeout_s: float) -> Any:
        if operation == "ping":
            return self.group_info()
        body = {"identifier": self.identifier, "args": args}
        return self._post(f"/{self._PATHS[operation]}", body, timeout_s)["value"]

    def dead_ranks(self) -> str | None:
        try:
            info = self.group_info()
        except Exception as exc:  # the API server itself is gone
            return f"train service API server {self.url} unreachable ({exc})"
        dead = sorted(
            (r for r in info["ranks"] if not r["alive"]),
            key=lambda r: -(r["heartbeat_age_s"] if r["heartbeat_age_s"] is not None else float("inf")),
        )  # the longest silent first: the likeliest to have gone first
        if not dead:
            return None
        return "; ".join(
            f"trainer rank {r['rank']} of {self.identifier!r} (host {r['host']}, pid {r['pid']}) sent no "
            f"heartbeat for {r['heartbeat_age_s'] or float('inf'):.1f}s"
            for r in dead
        )


def _detail(resp: Any) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except ValueError:
        return resp.text[:500]


def _close_zmq(sock: zmq.Socket, ctx: zmq.Context) -> None:
    sock.close(linger=0)
    ctx.term()
