"""Telling a service lost meanwhile (policy continue, or a joined rank that leaves) from one that
failed a sync.

A rank declared dead fails every call to it with ``PeerDeadError``; the controller then removes its
services from the publisher and the verifier (``membership.RolloutMembership.continue_without``), a moment later and
on another thread. Whoever saw the error waits for that removal, bounded: a lost service the
controller keeps (any other policy) is the sync's failure, and the run stops anyway. A joined rank
that leaves (cancelled, preempted) says so before its server goes, and the controller removes it
within a poll or two; a call that meanwhile failed on its server in another way (the server
closing the connection) is told apart the same way, with a shorter wait (``removed_of``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from nexrl_hpc.rpc.calls import PeerDeadError

# the controller removes a lost rank's services in the health check that declares it dead
REMOVAL_GRACE_S = 10.0


# a leaving joined rank's notice reaches the controller before its server goes; it acts on it at its
# next poll (runtime_monitor.poll_interval_s)
DEPARTURE_GRACE_S = 5.0


def removed_of(failed: dict[str, BaseException], current: Callable[[], list[str]]) -> set[str]:
    """The services of ``failed`` (name -> the error of its call) that the controller removed
    meanwhile: those whose rank was declared dead (``PeerDeadError``) within ``REMOVAL_GRACE_S``,
    the others within ``DEPARTURE_GRACE_S``."""
    dead = {n for n, e in failed.items() if isinstance(e, PeerDeadError)}
    removed = removed_meanwhile(dead, current)
    return removed | removed_meanwhile(set(failed) - dead, current, DEPARTURE_GRACE_S)


def removed_meanwhile(
    lost: Iterable[str], current: Callable[[], list[str]], grace_s: float | None = None
) -> set[str]:
    """Those of ``lost`` (service names) no longer in ``current()`` within ``grace_s``
    (``REMOVAL_GRACE_S`` by default)."""
    lost = set(lost)
    if not lost:
        return set()
    deadline = time.monotonic() + (REMOVAL_GRACE_S if grace_s is None else grace_s)
    while True:
        removed = lost - set(current())
        if removed == lost or time.monotonic() > deadline:
            return removed
        time.sleep(0.05)
