"""Telling a service lost meanwhile (policy continue) from one that failed a sync.

A rank declared dead fails every call to it with ``PeerDeadError``; the controller then removes its
services from the publisher and the verifier (``membership.RolloutMembership.continue_without``), a moment later and
on another thread. Whoever saw the error waits for that removal, bounded: a lost service the
controller keeps (any other policy) is the sync's failure, and the run stops anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# the controller removes a lost rank's services in the health check that declares it dead
REMOVAL_GRACE_S = 10.0


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
