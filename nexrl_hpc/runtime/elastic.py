"""The door of a running MPI job for rollout ranks started later (``nexrl-join RUN_DIR``).

The job key is broadcast over MPI at start and never written to disk; a rank outside the MPI world
proves instead that it can read the run dir: rank 0 writes ``<run_dir>/elastic/join.json`` (mode
0600, in a 0700 folder) with its door's address, the run's id, the start's generation (one more at
every start in the same run dir: a requeue) and a random secret new at every start. A joiner
connects to the door and answers a challenge with an HMAC of both sides' nonces under the secret;
rank 0 answers with the job key wrapped under the secret (XOR with an HMAC of the nonces: the key
and the secret never cross the wire in clear) and proves it holds the secret too. A joiner of
another run, of an older start (a stale file, a copy of the run dir) or without the secret is
refused, counted (``refused``) and logged without the secret.

Handshake (length-prefixed JSON frames, each at most ``MAX_FRAME`` bytes, the whole of it within
``runtime.elastic.handshake_timeout_s``):

1. door -> joiner: ``run_id``, ``generation``, ``nonce``
2. joiner -> door: ``run_id``, ``generation``, ``nonce``, ``proof``, who it is (host, pid, Slurm job)
3. door -> joiner: its rank, the wrapped key, where every module lives, the run context, ``proof``
4. joiner -> door (its modules built, its server up): its RPC addresses, ``proof``
5. door -> joiner, once the controller wired it in between tasks: ``admitted`` (or ``refused``)

Threads: the accept thread and one handshake thread per connection (at most
``runtime.rpc.preauth_max_connections`` at once) hand proven joiners to the controller's thread
through ``_lock``-guarded lists; ``take_arrivals`` / ``take_departures`` / ``welcome`` run on the
controller's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nexrl_hpc.config.schema import ElasticConfig

logger = logging.getLogger(__name__)

DOOR_DIR = "elastic"
DOOR_FILE = "join.json"
MEMBERS_FILE = "members.json"  # every joiner's state, for launch.status (no secrets)
MAX_FRAME = 64 << 10
PROTOCOL = "nexrl-join/1"
_LEN = struct.Struct(">I")


class JoinRefused(RuntimeError):
    """The run did not admit this joiner (the reason says why; it never holds the secret)."""


@dataclass(frozen=True)
class JoinCredential:
    """What ``join.json`` holds: the door's address and the secret of this start of the run."""

    run_id: str
    generation: int
    secret: bytes
    host: str
    port: int


def door_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), DOOR_DIR, DOOR_FILE)


def write_credential(run_dir: str, host: str, port: int) -> JoinCredential:
    """A new secret for this start of the run (same run id, next generation when the run dir has
    one already), written 0600 through a temporary file that nobody else could open first."""
    path = door_path(run_dir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    run_id, generation = secrets.token_hex(16), 1
    try:
        with open(path) as f:
            old = json.load(f)
        run_id, generation = str(old["run_id"]), int(old["generation"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none or unreadable: a new run id (joiners holding an old one are refused as another run's)
    cred = JoinCredential(run_id, generation, secrets.token_bytes(32), host, port)
    _write_private(
        path,
        {"run_id": run_id, "generation": generation, "secret": cred.secret.hex(), "host": host, "port": port},
    )
    return cred


def _write_private(path: str, content: dict[str, Any]) -> None:
    body = json.dumps(content).encode()
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_credential(run_dir: str) -> JoinCredential:
    """``join.json`` of ``run_dir``; refused when others could read it or it is not this user's."""
    path = door_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise JoinRefused(f"{path}: no such file (is the run in mpi mode and running?)") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid():
            raise JoinRefused(f"{path}: owned by uid {info.st_uid}, not by this user")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise JoinRefused(
                f"{path}: mode {stat.S_IMODE(info.st_mode):o}, others may read it (must be 600)"
            )
        data = json.loads(f.read(MAX_FRAME))
    if "secret" not in data:
        raise JoinRefused(
            f"{path}: start {data.get('generation')} of the run has ended; no joiner is admitted"
        )
    return JoinCredential(
        str(data["run_id"]),
        int(data["generation"]),
        bytes.fromhex(data["secret"]),
        str(data["host"]),
        int(data["port"]),
    )


# --- the wire ---------------------------------------------------------------------------------
def mac(secret: bytes, label: str, *parts: Any) -> str:
    """HMAC-SHA256 under ``secret`` over a label and parts (each length-prefixed: no re-cutting)."""
    h = hmac.new(secret, label.encode(), hashlib.sha256)
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        h.update(_LEN.pack(len(raw)) + raw)
    return h.hexdigest()


def wrap_key(secret: bytes, key: bytes, door_nonce: str, joiner_nonce: str) -> bytes:
    """The job key XOR a pad only holders of ``secret`` can compute (the nonces make it one-time)."""
    pad = hmac.digest(secret, f"key|{door_nonce}|{joiner_nonce}".encode(), "sha256")
    if len(key) != len(pad):
        raise ValueError(f"the job key is {len(key)} bytes, the pad {len(pad)}")
    return bytes(a ^ b for a, b in zip(key, pad))


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    raw = json.dumps(message).encode()
    if len(raw) > MAX_FRAME:
        raise ValueError(f"a join message of {len(raw)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_LEN.pack(len(raw)) + raw)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a join message of {size} bytes exceeds {MAX_FRAME}")
    message = json.loads(_recv_exact(sock, size))
    if not isinstance(message, dict):
        raise ConnectionError("a join message is not an object")
    return message


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 65536))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --- rank 0's side ------------------------------------------------------------------------------
@dataclass
class Member:
    """A joiner the door let in (or is letting in): what the controller wires and the status shows."""

    rank: int
    host: str
    pid: int
    job: str | None
    names: list[str]  # [rollout worker, inference service]
    state: str = "starting"  # starting -> joined -> left | refused (not wired in time)
    since: float = field(default_factory=time.time)
    reason: str = ""
    started_at: float = 0.0  # the joiner's process start (its clock), for the join time
    first_task_at: float | None = None  # when rank 0 first handed its worker a task
    address: str = ""
    lane_address: str = ""
    conn: socket.socket | None = None
    nonces: tuple[str, str] = ("", "")

    def public(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "job": self.job,
            "modules": self.names,
            "state": self.state,
            "since": self.since,
            "reason": self.reason,
            "started_at": self.started_at,
            "first_task_at": self.first_task_at,
        }


class JoinDoor:
    """Rank 0's listener for joiners: checks their proof, hands proven ones to the controller."""

    def __init__(
        self,
        config: ElasticConfig,
        run_dir: str,
        host: str,
        job_key: bytes,
        first_rank: int,
        welcome: dict[str, Any],
        max_handshakes: int,
    ) -> None:
        """``welcome``: what every admitted joiner is told (the driver's addresses, where every
        module lives, the run context); ``first_rank``: the first rank number joiners get."""
        self._config = config
        self._run_dir = os.path.abspath(run_dir)
        self._key = job_key
        self._welcome = welcome
        self._next_rank = first_rank
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # one writer of members.json at a time, each with the latest state
        self._members: dict[int, Member] = {}
        self._arrivals: list[Member] = []
        self._departures: list[tuple[int, str]] = []
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        self.refused = 0
        self._closed = threading.Event()
        self._listener = socket.create_server((host, 0), backlog=max_handshakes)
        self._listener.settimeout(0.2)
        self.credential = write_credential(run_dir, host, self._listener.getsockname()[1])
        self._write_members()
        self._thread = threading.Thread(target=self._accept_loop, name="join-door", daemon=True)
        self._thread.start()
        logger.info(
            "elastic: joiners admitted at %s:%d (generation %d; nexrl-join %s)",
            host,
            self.credential.port,
            self.credential.generation,
            self._run_dir,
        )

    # --- the controller's thread --------------------------------------------------------------
    def take_arrivals(self) -> list[Member]:
        """Proven joiners whose modules and server are up: the controller wires each in, then
        ``welcome``s it (or ``turn_away``s it)."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        return arrivals

    def take_departures(self) -> list[tuple[int, str]]:
        """(rank, reason) of joined ranks that said they leave (cancelled, preempted, stopping)."""
        with self._lock:
            departures, self._departures = self._departures, []
        return departures

    def welcome(self, member: Member) -> None:
        member.state, member.since = "joined", time.time()
        self._finish_handshake(member, {"admitted": True})
        self._write_members()

    def turn_away(self, member: Member, reason: str) -> None:
        self._refuse_member(member, reason)

    def left(self, rank: int, reason: str) -> None:
        """A joined rank is gone (it said so, or it stopped answering): for the status."""
        with self._lock:
            member = self._members.get(rank)
            if member is None or member.state == "left":
                return
            member.state, member.since, member.reason = "left", time.time(), reason
        self._write_members()

    def first_task(self, rank: int) -> None:
        """Rank 0 handed the joined rank's worker its first task (the end of its join time)."""
        with self._lock:
            member = self._members.get(rank)
            if member is None or member.first_task_at is not None:
                return
            member.first_task_at = time.time()
        self._write_members()

    def member_of(self, rank: int) -> Member | None:
        with self._lock:
            return self._members.get(rank)

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def live_ranks(self) -> list[int]:
        with self._lock:
            return [r for r, m in self._members.items() if m.state == "joined"]

    def leave_notice(self, rank: int, reason: str) -> bool:
        """The rank built-in ``elastic_leave`` (a joined rank's last call): queue its departure."""
        with self._lock:
            member = self._members.get(rank)
            if member is None or member.state != "joined":
                return False
            self._departures.append((rank, reason))
        logger.info("elastic: rank %d says it leaves: %s", rank, reason)
        return True

    def close(self) -> None:
        """No more joiners; the secret goes with the door (it opens nothing any more)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            for member in self._members.values():
                if member.state in ("joined", "starting"):
                    member.state, member.since, member.reason = "ended", time.time(), "the run ended"
        self._write_members()
        try:
            self._listener.close()
        except OSError:
            pass
        try:  # the run id and start stay (the next start counts on), the secret goes
            if read_credential(self._run_dir).secret == self.credential.secret:
                cred = self.credential
                _write_private(
                    door_path(self._run_dir), {"run_id": cred.run_id, "generation": cred.generation}
                )
        except (OSError, JoinRefused, ValueError, KeyError):
            pass

    # --- the door's threads -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # a flood of connections costs them, not the run
                continue
            threading.Thread(
                target=self._handshake,
                args=(conn, f"{peer[0]}:{peer[1]}"),
                name="join-handshake",
                daemon=True,
            ).start()

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        keep = False
        box: list[Member] = []
        try:
            conn.settimeout(self._config["handshake_timeout_s"])
            keep = self._admit(conn, peer, box)
        except (OSError, ValueError, KeyError, TypeError, ConnectionError) as exc:
            reason = f"handshake failed: {type(exc).__name__}: {exc}"
            if box:  # proven, then gone before it was wired in (killed while starting, a bad report)
                box[0].state, box[0].since, box[0].reason = "left", time.time(), reason
            self._count_refusal(peer, reason)
        finally:
            self._handshakes.release()
            if not keep:
                conn.close()

    def _admit(self, conn: socket.socket, peer: str, box: list[Member]) -> bool:
        cred = self.credential
        door_nonce = secrets.token_hex(16)
        send_frame(
            conn,
            {"proto": PROTOCOL, "run_id": cred.run_id, "generation": cred.generation, "nonce": door_nonce},
        )
        hello = recv_frame(conn)
        joiner_nonce = str(hello["nonce"])
        who = f"{peer} (host {hello.get('host')!s:.64}, pid {hello.get('pid')!s:.16})"
        problem = self._check_hello(hello, door_nonce, joiner_nonce)
        if problem:
            self._count_refusal(who, problem)  # counted before the joiner hears it
            send_frame(conn, {"refused": problem})
            return False
        with self._lock:
            rank, self._next_rank = self._next_rank, self._next_rank + 1
            self._members[rank] = member = Member(
                rank,
                str(hello.get("host"))[:255],
                int(hello.get("pid") or 0),
                None if hello.get("job") is None else str(hello["job"])[:64],
                [f"rollout_worker_e{rank}", f"inference_service_e{rank}"],
                nonces=(door_nonce, joiner_nonce),
                started_at=float(hello.get("started_at") or 0.0),
            )
            box.append(member)
        body = dict(
            self._welcome,
            rank=rank,
            names=member.names,
            wrapped_key=wrap_key(cred.secret, self._key, door_nonce, joiner_nonce).hex(),
        )
        encoded = json.dumps(body, sort_keys=True)
        send_frame(
            conn, {"body": encoded, "proof": mac(cred.secret, "door", door_nonce, joiner_nonce, encoded)}
        )
        conn.settimeout(self._config["admit_timeout_s"])  # its modules are built and its server starts
        ready = recv_frame(conn)
        address, lane = str(ready["address"]), str(ready["lane_address"])
        expected = mac(cred.secret, "ready", door_nonce, joiner_nonce, rank, address, lane)
        if not hmac.compare_digest(str(ready.get("proof")), expected):
            self._refuse_member(member, "its start-up report does not carry the credential's proof")
            return False
        member.address, member.lane_address, member.conn = address, lane, conn
        with self._lock:
            self._arrivals.append(member)
        logger.info("elastic: rank %d from %s proved the credential; wired in between tasks", rank, who)
        return True

    def _check_hello(self, hello: dict[str, Any], door_nonce: str, joiner_nonce: str) -> str:
        """Why this joiner is refused ("" when it is not). Never names the secret."""
        cred = self.credential
        if hello.get("run_id") != cred.run_id:
            return "its credential is another run's"
        if hello.get("generation") != cred.generation:
            return (
                f"its credential is of start {hello.get('generation')!s:.16} of this run, which is at "
                f"start {cred.generation} (a stale file or a copy of the run dir)"
            )
        expected = mac(cred.secret, "join", door_nonce, joiner_nonce, cred.run_id, cred.generation)
        if not hmac.compare_digest(str(hello.get("proof")), expected):
            return "its proof does not match the credential"
        with self._lock:
            live = sum(1 for m in self._members.values() if m.state in ("starting", "joined"))
        if live >= self._config["max_members"]:
            return f"runtime.elastic.max_members={self._config['max_members']} ranks have joined already"
        return ""

    def _count_refusal(self, who: str, reason: str) -> None:
        with self._lock:
            self.refused += 1
        logger.warning("elastic: refused a joiner from %s: %s", who, reason)
        self._write_members()

    def _refuse_member(self, member: Member, reason: str) -> None:
        member.state, member.since, member.reason = "refused", time.time(), reason
        self._count_refusal(f"rank {member.rank} ({member.host})", reason)
        self._finish_handshake(member, {"refused": reason})

    def _finish_handshake(self, member: Member, message: dict[str, Any]) -> None:
        conn, member.conn = member.conn, None
        if conn is None:
            return
        try:
            send_frame(conn, message)
        except OSError:
            pass
        finally:
            conn.close()

    def _write_members(self) -> None:
        """``<run_dir>/elastic/members.json``: every joiner's state (launch.status reads it)."""
        path = os.path.join(self._run_dir, DOOR_DIR, MEMBERS_FILE)
        with self._file_lock:
            with self._lock:
                state = {
                    "generation": self.credential.generation,
                    "refused": self.refused,
                    "members": [m.public() for m in self._members.values()],
                }
            try:
                with open(f"{path}.tmp", "w") as f:
                    json.dump(state, f, indent=1)
                os.replace(f"{path}.tmp", path)
            except OSError:
                logger.exception("elastic: could not write %s", path)
