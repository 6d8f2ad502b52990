"""The standalone train-service API server: worker groups, execute signals, heartbeats.

Training data never passes through here: clients send batches to trainer rank 0 over ZMQ. The
server keeps, per identifier (``student``, ``teacher``, ...), the group's size, each rank's endpoint,
host, pid and last heartbeat; it relays ``execute`` and the batch-less operations (initialize,
init_model, save/load checkpoint, export) to rank 0 over ZMQ, signed with the key derived from the
bearer token and the group's session: a random value drawn each time a group registers (every
start of it), handed to its ranks and clients with the group's info, so that messages captured
before a restart fail the signature after it. Every endpoint requires ``Authorization: Bearer
<token>``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from nexrl_hpc.rpc.preauth import WireLimits
from nexrl_hpc.trainer.protocol import SignedChannel, key_from_token

logger = logging.getLogger(__name__)
# the most ranks a worker group may register: every group's info lists each rank (an unbounded size
# let one registration cost minutes and hundreds of MiB), and no torchrun group comes near it
MAX_GROUP_WORLD_SIZE = 4096


@dataclass
class WorkerGroup:
    identifier: str
    world_size: int
    session: str = field(default_factory=lambda: secrets.token_hex(16))  # new at every registration
    endpoints: dict[int, str | None] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    relay: Any = None  # (socket, channel) to rank 0, opened on first use

    def info(self, heartbeat_timeout_s: float) -> dict[str, Any]:
        now = time.monotonic()
        ranks = []
        for r in range(self.world_size):
            age = now - self.last_seen[r] if r in self.last_seen else None
            ranks.append(
                {
                    "rank": r,
                    "host": self.hosts.get(r),
                    "pid": self.pids.get(r),
                    "endpoint": self.endpoints.get(r),
                    "heartbeat_age_s": age,
                    "alive": age is not None and age <= heartbeat_timeout_s,
                }
            )
        return {
            "identifier": self.identifier,
            "world_size": self.world_size,
            "session": self.session,
            "ready": len(self.endpoints) == self.world_size and self.endpoints.get(0) is not None,
            "endpoints": {str(r): e for r, e in self.endpoints.items() if e},
            "ranks": ranks,
        }


class RegisterGroup(BaseModel):
    identifier: str
    world_size: int


class ReportEndpoint(BaseModel):
    identifier: str
    rank: int
    endpoint: str | None = None
    host: str = ""
    pid: int = 0


class Heartbeat(BaseModel):
    identifier: str
    rank: int


class Execute(BaseModel):
    identifier: str
    op_id: str


class Operation(BaseModel):
    identifier: str
    args: dict[str, Any] = {}


class WorkerGroups:
    """The registered worker groups, and the signed ZMQ relay to each group's rank 0."""

    def __init__(self, token: str, heartbeat_timeout_s: float, max_message_bytes: int, limits: WireLimits):
        self._token = token
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._max_message_bytes = max_message_bytes
        self._limits = limits
        self._groups: dict[str, WorkerGroup] = {}
        self._lock = threading.Lock()
        self._zctx = zmq.Context()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def register(self, identifier: str, world_size: int) -> WorkerGroup:
        """A new group under ``identifier`` (a new session); the relay of the one it replaces is closed."""
        with self._lock:
            old = self._groups.get(identifier)
            if old is not None and old.relay is not None:
                old.relay[0].close(linger=0)
            group = WorkerGroup(identifier, world_size)
            self._groups[identifier] = group
        return group

    def group_of(self, identifier: str) -> WorkerGroup:
        with self._lock:
            group = self._groups.get(identifier)
        if group is None:
            raise HTTPException(status_code=404, detail=f"no worker group {identifier!r} registered")
        return group

    def relay(self, group: WorkerGroup, header: dict[str, Any], expect: str, timeout_s: float) -> Any:
        """Send ``header`` to rank 0 and wait for ``expect`` with the same op id."""
        endpoint = group.endpoints.get(0)
        if not endpoint:
            raise HTTPException(
                status_code=503, detail=f"{group.identifier}: rank 0 has not reported its endpoint"
            )
        with group.lock:
            sock, chan = self._relay_to(group, endpoint)
            chan.send(sock, header, endpoint)
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise self._no_answer(group, header, timeout_s)
                message = chan.feed(sock.recv_multipart(copy=False))
                if message is None:
                    continue
                _, _, reply, _ = message
                if reply.get("op_id") != header["op_id"] or reply["kind"] not in (expect, "result"):
                    continue
                if reply["kind"] == "result" and not reply["ok"]:
                    raise HTTPException(status_code=500, detail=reply["error"])
                return reply.get("value")

    def _relay_to(self, group: WorkerGroup, endpoint: str) -> tuple[Any, SignedChannel]:
        """The group's socket to rank 0 at ``endpoint`` (a new one when rank 0 moved); under ``group.lock``."""
        if group.relay is None or group.relay[2] != endpoint:
            sock = self._zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            key = key_from_token(self._token, group.identifier, group.session)
            chan = SignedChannel(key, self._max_message_bytes, self._limits, name="api")
            chan.prepare_client(sock)
            sock.connect(endpoint)
            group.relay = (sock, chan, endpoint)
        sock, chan, _ = group.relay
        return sock, chan

    def _no_answer(self, group: WorkerGroup, header: dict[str, Any], timeout_s: float) -> HTTPException:
        """The 504 for a rank 0 that did not answer in time, naming the ranks without a heartbeat."""
        dead = [r for r in group.info(self._heartbeat_timeout_s)["ranks"] if not r["alive"]]
        named = "; ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']}) no heartbeat" for r in dead)
        return HTTPException(
            status_code=504,
            detail=f"{group.identifier}: trainer rank 0 did not answer {header.get('operation', header['kind'])} "
            f"within {timeout_s:.0f}s" + (f"; {named}" if named else ""),
        )


def create_app(
    token: str, heartbeat_timeout_s: float, relay_timeout_s: float, max_message_bytes: int, limits: WireLimits
) -> FastAPI:
    if not token:
        raise ValueError("the train service needs a bearer token (refusing to serve without one)")
    # no open schema or docs: they are served below, behind the token like every other route
    app = FastAPI(title="nexrl_hpc train service", docs_url=None, redoc_url=None, openapi_url=None)
    groups = WorkerGroups(token, heartbeat_timeout_s, max_message_bytes, limits)

    def authorize(authorization: str | None = Header(default=None)) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    _add_docs_routes(app, authorize)

    @app.get("/health")
    def health(_: None = Depends(authorize)) -> dict[str, Any]:
        return {"status": "ok", "groups": groups.names()}

    @app.post("/register_worker_group")
    def register_worker_group(body: RegisterGroup, _: None = Depends(authorize)) -> dict[str, Any]:
        if not 1 <= body.world_size <= MAX_GROUP_WORLD_SIZE:
            raise HTTPException(
                status_code=422,
                detail=f"register_worker_group: world_size={body.world_size} is outside 1..{MAX_GROUP_WORLD_SIZE}",
            )
        group = groups.register(body.identifier, body.world_size)
        logger.info("worker group %s registered (%d ranks)", body.identifier, body.world_size)
        return {"ok": True, "session": group.session}

    @app.post("/report_worker_endpoint")
    def report_worker_endpoint(body: ReportEndpoint, _: None = Depends(authorize)) -> dict[str, Any]:
        group = groups.group_of(body.identifier)
        if not 0 <= body.rank < group.world_size:
            raise HTTPException(status_code=422, detail=f"rank {body.rank} outside 0..{group.world_size - 1}")
        group.endpoints[body.rank] = body.endpoint
        group.hosts[body.rank], group.pids[body.rank] = body.host, body.pid
        group.last_seen[body.rank] = time.monotonic()
        return {"ok": True}

    @app.get("/get_worker_group_info")
    def get_worker_group_info(identifier: str, _: None = Depends(authorize)) -> dict[str, Any]:
        return groups.group_of(identifier).info(heartbeat_timeout_s)

    @app.post("/heartbeat")
    def heartbeat(body: Heartbeat, _: None = Depends(authorize)) -> dict[str, Any]:
        groups.group_of(body.identifier).last_seen[body.rank] = time.monotonic()
        return {"ok": True}

    @app.post("/execute")
    def execute(body: Execute, _: None = Depends(authorize)) -> dict[str, Any]:
        group = groups.group_of(body.identifier)
        groups.relay(group, {"kind": "execute", "op_id": body.op_id}, "started", relay_timeout_s)
        return {"ok": True}

    for path, operation in _OPERATIONS.items():
        _add_operation_route(app, authorize, groups, path, operation, relay_timeout_s)
    return app


# route -> the operation rank 0 runs (relayed with the body's args; the answer is its value)
_OPERATIONS = {
    "initialize": "initialize_worker",
    "init_model": "init_model",
    "save_checkpoint": "save_checkpoint",
    "load_checkpoint": "load_checkpoint",
    "export_weights": "export_weights",
    "broadcast_weights": "broadcast_weights",
}


def _add_docs_routes(app: FastAPI, authorize: Callable[..., None]) -> None:
    """The schema and the docs pages, behind the token like every other route."""

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_: None = Depends(authorize)) -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    def docs(_: None = Depends(authorize)) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", include_in_schema=False)
    def redoc(_: None = Depends(authorize)) -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)


def _add_operation_route(
    app: FastAPI,
    authorize: Callable[..., None],
    groups: WorkerGroups,
    path: str,
    operation: str,
    relay_timeout_s: float,
) -> None:
    def run(body: Operation, _: None = Depends(authorize)) -> dict[str, Any]:
        group = groups.group_of(body.identifier)
        op_id = f"{operation}-api-{time.monotonic_ns()}"
        header = {"kind": "call", "op_id": op_id, "operation": operation, "args": body.args}
        return {"ok": True, "value": groups.relay(group, header, "result", relay_timeout_s)}

    app.post(f"/{path}", name=path)(run)
