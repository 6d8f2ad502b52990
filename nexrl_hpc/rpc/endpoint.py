"""One RPC endpoint per rank: signed calls to the other ranks' modules, and answers to theirs.

``RpcEndpoint`` is a facade over parts it owns, each in a module of its own with its lock rules:

- ``Calls`` (``calls.py``): the caller side — a DEALER per peer that any thread sends on (requests
  and the server's replies), the per-peer outbox that lets pipelined ``@quick`` requests leave
  together, and the pending calls with their deadlines; a call to a rank declared dead fails at
  once, and every call has a deadline, so nothing waits forever.
- ``DirectPool`` (``direct.py``): blocking calls to ``@quick`` methods (``call_direct``) on lane
  connections of the caller's own (``lane.py``), read by the caller itself — no thread hand-off.
- ``IoServer`` (``server.py``): the ROUTER every message arrives on and the IO thread that checks
  it before decoding, completes replies, dispatches requests (quick ones at once, long polls and
  the rest in thread pools) and sends small quick replies of a receive burst together.
- ``LaneServer`` (``lane_server.py``): the peer side of the direct lane, driven by the IO thread.
- ``ConnectionWatch`` (``watch.py``): the ROUTER's guard on a thread of its own (ZAP: the PLAIN
  password derived from the key; the cap on connections waiting to authenticate; every connection
  closed before it authenticated, counted), owned by the IO server.
- ``preauth.py``: the pre-authentication limits every listening port keeps (``WireLimits``).
- the limits (``limits.py``): the size limit and its error, batch bounds, and ``Rejections``, the
  count of everything dropped (``stats()["rejected"]``).

All of them share one ``SequenceGuard`` (``wire.py``): a message signed for one path is a replay on
every other. The facade holds no lock of its own; ``close`` stops the parts in order.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from nexrl_hpc.rpc.calls import Calls, new_call_ids
from nexrl_hpc.rpc.direct import DirectPool
from nexrl_hpc.rpc.invoke import Invoker
from nexrl_hpc.rpc.lane_server import LaneServer
from nexrl_hpc.rpc.limits import Rejections
from nexrl_hpc.rpc.preauth import WireLimits, ensure_fd_room
from nexrl_hpc.rpc.server import IoServer
from nexrl_hpc.rpc.wire import SequenceGuard

RPC_MODULE = "__rpc__"


class RpcEndpoint:
    def __init__(
        self,
        rank: int,
        host: str,
        key: bytes,
        max_message_bytes: int,
        server_threads: int,
        call_timeout_s: float,
        lookup: Callable[[str, str], Callable[..., Any]],
        resolve_handle: Callable[[str], Any] | None = None,
        *,
        direct_sockets_per_peer: int,
        long_poll_threads: int,
        limits: WireLimits,
    ):
        self.rank = rank
        ensure_fd_room(2, limits)  # the ROUTER and the lane
        self._ctx = zmq.Context()
        guard = SequenceGuard()
        self._rejections = Rejections(rank)
        reject = self._rejections.reject
        call_ids = new_call_ids()
        self._calls = Calls(rank, key, max_message_bytes, call_timeout_s, limits, call_ids, resolve_handle)
        self._direct = DirectPool(
            rank,
            key,
            max_message_bytes,
            call_timeout_s,
            direct_sockets_per_peer,
            guard,
            reject,
            self._calls.dead,
            call_ids,
            resolve_handle,
        )
        invoker = Invoker(rank, lookup, resolve_handle)
        self._lanes = LaneServer(rank, host, key, max_message_bytes, guard, invoker, reject, limits)
        self._server = IoServer(
            rank,
            self._ctx,
            host,
            key,
            max_message_bytes,
            server_threads,
            long_poll_threads,
            self._calls,
            self._lanes,
            invoker,
            guard,
            reject,
            limits,
        )
        self.address = self._server.address
        self.lane_address = self._lanes.address
        self._calls.io_thread = self._server.thread
        self._server.start()

    def connect(self, peers: dict[int, str], lanes: dict[int, str] | None = None) -> None:
        """Open a DEALER to every peer's ROUTER (the own rank is skipped). ``lanes``: the peers'
        direct lanes (``lane_address``); blocking quick calls to a peer without one go over ZMQ."""
        for rank, address in peers.items():
            if rank == self.rank or rank in self._calls.peers:
                continue
            self._calls.connect(self._ctx, rank, address)
            self._direct.add_peer(rank, (lanes or {}).get(rank))

    def call_async(
        self,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
        quick: bool = False,
    ) -> Future:
        """Send a request; the future resolves with the reply. A small request to a ``@quick``
        method while another to the same peer is unanswered waits in the peer's outbox and leaves
        with the others that queue meanwhile, as one signed message, when an answer comes in (or
        at 64 requests / 256 KiB, or when someone waits on one of them)."""
        return self._calls.call_async(rank, module, method, args, kwargs, timeout, quick)

    def call_direct(
        self,
        rank: int,
        module: str,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        timeout: float | None = None,
    ) -> Any:
        """Call a ``@quick`` method and wait for its result on a lane connection of this caller's
        own (the peer answers on its IO thread). Falls back to ``call_async`` when the peer has no
        lane or every connection to it is in use."""
        refused = self._calls.peer_for_call(rank, module, method)
        if isinstance(refused, Exception):
            raise refused
        direct = self._direct.borrow(rank, module, method)
        if direct is None:
            return self._calls.call_async(rank, module, method, args, kwargs, timeout).result()
        return self._direct.call(direct, rank, module, method, args, kwargs, timeout)

    def fail_peer(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead: fail its pending calls now, refuse new ones."""
        self._calls.fail_peer(rank, reason)

    def is_dead(self, rank: int) -> bool:
        return rank in self._calls.dead

    def stats(self) -> dict[str, int]:
        return {"rejected": self._rejections.count}

    def close(self) -> None:
        self._calls.closing = True
        self._direct.closing = True
        self._server.stop()
        lent = self._direct.close()
        self._calls.close()
        if lent:  # a caller still holds a connection (it gives it up within its 0.1 s poll): don't wait
            return
        try:
            self._ctx.term()
        except zmq.ZMQError:
            pass
