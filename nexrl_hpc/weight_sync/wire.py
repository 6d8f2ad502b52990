"""The broadcast transport's wire: one process group, buckets of named tensors, from rank 0 to all.

Self-contained (torch and the standard library only) because it runs in three kinds of process:
the trainer (the sender, rank 0), nexrl_hpc's local inference server, and vLLM's worker processes
in vLLM's own venv (``vllm_weight_plugin`` is copied there with this file beside it). All of them
speak exactly this format, so the trainer never needs to know which engine listens.

The group: a fresh ``torch.distributed`` process group per sync, separate from any group the
process already has (the trainer's own, vLLM's), made from a ``TCPStore`` the publisher hosts
(``host``/``port``) under a ``prefix`` unique to the sync. gloo on CPU, NCCL on GPUs; every
collective is bounded by ``timeout_s``, so a peer that dies or never comes fails the sync instead
of hanging it. Members first meet at a barrier in the store (``join``, bounded by ``timeout_s``)
that the publisher can call off (``ABORT_KEY``): a member known lost (its rank declared dead) does
not keep the others waiting for it the whole ``timeout_s``. Past the barrier every member is there,
and a gloo group must connect within ``form_timeout_s``, and is given up as soon as the sync is
called off: a member that died just after joining fails the sync then, whether it died before
publishing its address (the store's wait) or after (gloo's pair connect retries for about five
times its timeout, so the group is formed on a thread of its own and waited for in slices; NCCL
connects lazily, at the first broadcast, under ``timeout_s``). A gloo member also looks at the
call-off while it waits for a collective (``BroadcastGroup.broadcast``).

The stream, per bucket: an int64 length, the bucket's JSON header (``[[name, dtype, shape], ...]``),
then each tensor broadcast in place (no packing copy on the sender). A length of 0 ends the stream.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

GroupSpec = dict[str, Any]  # backend, host, port, prefix, world_size, timeout_s, form_timeout_s
ABORT_KEY = "abort"  # under the sync's prefix: why the publisher called the sync off
_JOINED_KEY = "joined"


class BroadcastAborted(RuntimeError):
    """The publisher called the sync off (a side failed, or a member was lost): raised to a member
    joining the group, forming it, or waiting in a collective (gloo)."""


class BroadcastGroup:
    """One sync's process group; rank 0 sends. ``device``: where tensors live for the backend."""

    def __init__(self, spec: GroupSpec, rank: int, device: str = "cpu"):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
        form = datetime.timedelta(seconds=float(spec["form_timeout_s"]))  # <= timeout_s (broadcast.py)
        self.rank = rank
        self.device = torch.device(device)
        store = dist.TCPStore(
            spec["host"], int(spec["port"]), None, False, timeout=form, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(str(spec["prefix"]), store)
        world = int(spec["world_size"])
        join(prefixed, world, float(spec["timeout_s"]))
        if spec["backend"] == "nccl" and _shares_a_gpu(prefixed, rank, world, self.device):
            self.device = torch.device("cpu")  # one GPU cannot hold two ranks of one NCCL group
            self._pg: Any = _gloo_group(spec, prefixed, rank, form, timeout)
        elif spec["backend"] == "nccl":
            store.set_timeout(timeout)  # NCCL meets in the store at its first broadcast
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        elif spec["backend"] == "gloo":
            self._pg = _gloo_group(spec, prefixed, rank, form, timeout)
        else:
            raise ValueError(f"weight broadcast backend {spec['backend']!r}: expected 'gloo' or 'nccl'")
        self._store, self._prefixed = store, prefixed
        self._polls = isinstance(self._pg, dist.ProcessGroupGloo)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One collective. A gloo one is waited for in slices, looking for the call-off between
        them: a peer killed while a send to it is in flight does not fail gloo's send before the
        group's whole timeout, but the publisher learns of the death at once (the peer's own call
        fails) and calls the sync off. The abandoned collective ends in gloo's own time, on a
        thread of its own (``_abandon``)."""
        work = self._pg.broadcast([tensor], _broadcast_options())
        if not self._polls:
            work.wait()
            return
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError as exc:
                if str(exc) != _WAIT_SLICE_ENDED:
                    raise
            if self._prefixed.check([ABORT_KEY]):
                reason = self._prefixed.get(ABORT_KEY).decode()
                self._abandon(work)
                raise BroadcastAborted(f"weight broadcast called off mid-stream: {reason}")

    def close(self) -> None:
        group, self._pg = self._pg, None
        _shut_down(group)

    def _abandon(self, work: Any) -> None:
        """Let the group go on a thread of its own once ``work`` (the collective in flight) ends, in
        gloo's time: at the group's timeout when its peer died mid-send. Destroying a gloo group
        joins its worker threads, so dropping it here would hold this thread until then."""
        group, self._pg = self._pg, None
        threading.Thread(
            target=_release_after, args=(group, work), name="weight-broadcast-abandoned", daemon=True
        ).start()


_POLL = datetime.timedelta(seconds=0.2)  # a gloo collective's wait slice between looks at the call-off
_WAIT_SLICE_ENDED = "Operation timed out!"  # c10d's Work.wait(timeout) when the slice ends first


def _release_after(group: Any, work: Any) -> None:
    try:
        work.wait()
    except Exception:  # the collective failed, as expected of one called off
        pass
    _shut_down(group)  # the last reference goes with this frame: the group is destroyed here


def _shut_down(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # a broken group: nothing left to release cleanly
            pass


def _gloo_group(
    spec: GroupSpec, watched: Any, rank: int, form: datetime.timedelta, timeout: datetime.timedelta
) -> Any:
    """A gloo group whose connections are made within ``form`` and whose collectives then wait up
    to ``timeout``. Formed on a thread of its own, with a store client of its own (``watched``, the
    caller's, stays free for looks at the call-off): gloo's set-up cannot be interrupted, and a peer
    that published its address and died keeps it retrying well past ``form``. The thread is left to
    end in gloo's time when the sync is called off or ``form`` (and a second's grace, so the
    store's own timeout names a peer that never published) has passed."""
    import time

    import torch.distributed as dist

    own = dist.TCPStore(spec["host"], int(spec["port"]), None, False, timeout=form, wait_for_workers=False)
    forming = _Forming()

    def make() -> None:
        try:
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(str(spec["prefix"]), own), rank, int(spec["world_size"]), form
            )
            group._set_default_timeout(timeout)
        except BaseException as exc:  # handed to the caller, or dropped with an abandoned group
            forming.finish(None, exc)
        else:
            forming.finish(group, None)

    threading.Thread(target=make, name="weight-broadcast-forming", daemon=True).start()
    deadline = time.monotonic() + form.total_seconds() + 1.0
    while not forming.done.wait(_POLL.total_seconds()):
        if watched.check([ABORT_KEY]):
            forming.abandon()
            reason = watched.get(ABORT_KEY).decode()
            raise BroadcastAborted(f"weight broadcast called off while its group formed: {reason}")
        if time.monotonic() > deadline:
            forming.abandon()
            raise TimeoutError(
                f"weight broadcast: rank {rank}'s gloo group of {spec['world_size']} did not connect "
                f"within {form.total_seconds():.0f}s (weight.broadcast_form_timeout_s): a member "
                "died after joining"
            )
    if forming.error is not None:
        raise forming.error
    return forming.group


class _Forming:
    """A gloo group being formed on its own thread: its result, or its release if abandoned."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.group: Any = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def finish(self, group: Any, error: BaseException | None) -> None:
        with self._lock:
            if not self._abandoned:
                self.group, self.error = group, error
                group = None
        if group is not None:
            _shut_down(group)  # formed too late: nobody will use it
        self.done.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True


def join(store: Any, world: int, timeout_s: float, poll_s: float = 0.05) -> None:
    """Wait until all ``world`` members have joined; raises ``BroadcastAborted`` as soon as the
    publisher sets ``ABORT_KEY``, ``TimeoutError`` after ``timeout_s``."""
    import time

    store.add(_JOINED_KEY, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([ABORT_KEY]):
            raise BroadcastAborted(f"weight broadcast called off: {store.get(ABORT_KEY).decode()}")
        joined = int(store.add(_JOINED_KEY, 0))
        if joined >= world:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"weight broadcast: {joined} of {world} members joined within {timeout_s:.0f}s"
            )
        time.sleep(poll_s)


def _shares_a_gpu(store: Any, rank: int, world: int, device: torch.device) -> bool:
    """Whether two ranks of the group sit on one GPU (every rank computes the same answer from
    what all of them wrote): then the group falls back to gloo through host memory."""
    import socket

    index = device.index if device.index is not None else torch.cuda.current_device()
    identity = f"{socket.gethostname()}/{torch.cuda.get_device_properties(index).uuid}"
    store.set(f"gpu/{rank}", identity)
    keys = [f"gpu/{r}" for r in range(world)]
    store.wait(keys)
    identities = [store.get(key).decode() for key in keys]
    return len(set(identities)) < world


def _broadcast_options() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def send_bucket(group: BroadcastGroup, named: list[tuple[str, torch.Tensor]]) -> int:
    """Rank 0: one bucket (header, then each tensor); returns its bytes."""
    header = [[name, _dtype_name(t.dtype), list(t.shape)] for name, t in named]
    _send_header(group, json.dumps(header).encode())
    sent = 0
    for _, tensor in named:
        wire = tensor.detach()
        if wire.device != group.device or not wire.is_contiguous():
            wire = wire.to(group.device).contiguous()
        group.broadcast(wire)
        sent += wire.numel() * wire.element_size()
    return sent


def send_end(group: BroadcastGroup) -> None:
    _send_header(group, b"")


def _send_header(group: BroadcastGroup, payload: bytes) -> None:
    length = torch.tensor([len(payload)], dtype=torch.int64, device=group.device)
    group.broadcast(length)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(group.device)
        group.broadcast(data)


def receive_buckets(
    group: BroadcastGroup, into: Callable[[str, torch.dtype, list[int]], torch.Tensor | None] | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Ranks > 0: every bucket as ``[(name, tensor)]`` until the sender ends the stream. ``into``
    (name, dtype, shape; called for a whole bucket's header before any of its tensors is received)
    may name the tensor to receive in place, e.g. the live weight, saving a copy; it may raise to
    refuse the bucket. A tensor it names that does not fit (dtype, shape, layout, device) is not
    written: that entry is received into a new tensor."""
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=group.device)
        group.broadcast(length)
        size = int(length.item())
        if size == 0:
            return
        data = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(data)
        header = [
            (name, getattr(torch, dtype), shape)
            for name, dtype, shape in json.loads(bytes(data.cpu().tolist()).decode())
        ]
        targets = [_fitting(into, name, dtype, shape, group.device) for name, dtype, shape in header]
        bucket = []
        for (name, dtype, shape), target in zip(header, targets):
            tensor = torch.empty(shape, dtype=dtype, device=group.device) if target is None else target
            group.broadcast(tensor)
            bucket.append((name, tensor))
        yield bucket


def _fitting(
    into: Callable[[str, torch.dtype, list[int]], torch.Tensor | None] | None,
    name: str,
    dtype: torch.dtype,
    shape: list[int],
    device: torch.device,
) -> torch.Tensor | None:
    target = None if into is None else into(name, dtype, shape)
    if target is None or target.dtype != dtype or list(target.shape) != list(shape):
        return None
    if target.device != device or not target.is_contiguous():
        return None
    return target


def prefetched(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``buckets`` received one ahead on a thread of their own: the next bucket crosses the wire
    while the engine loads this one (one bucket more in memory). An error on the thread is raised
    here, at the bucket it stopped at."""
    import queue
    import threading

    handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
    done = object()

    def receive() -> None:
        try:
            for bucket in buckets:
                handoff.put(bucket)
            handoff.put(done)
        except BaseException as exc:  # handed to the loading thread
            handoff.put(exc)

    thread = threading.Thread(target=receive, name="weight-receive", daemon=True)
    thread.start()
    while True:
        item = handoff.get()
        if item is done:
            break
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so each group's bytes stay within ``bucket_bytes`` (a tensor larger
    than that is a bucket of its own)."""
    buckets: list[list[str]] = []
    current: list[str] = []
    held = 0
    for name, nbytes in sizes:
        if current and held + nbytes > bucket_bytes:
            buckets.append(current)
            current, held = [], 0
        current.append(name)
        held += nbytes
    if current:
        buckets.append(current)
    return buckets
