"""The publish step: every inference service serves an exported weight version, old exports go.

The trainer exports version ``v`` (HF layout) under ``sync_weight_dir(weight.sync_weight_path, v)``;
``WeightPublisher.publish(v)`` has every inference service reload that directory (each through the
transport its backend needs, see transport.py: the publisher never branches on it), and ``prune``
then keeps the newest ``weight.keep_versions`` exports (after the clients are let go: a reload holds
them, a prune need not). With ``weight.transport=broadcast`` nothing is exported: ``publish`` has the
trainer (the weight source) send its weights to one process group with every inference service
(broadcast.py), all at once, each side bounded by ``weight.broadcast_timeout_s``. It moves data only: when a version may be published
and what a publication unblocks is the rollout scheduler's business (scheduler/).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import WeightConfig
from nexrl_hpc.core.execute import execute, execute_async
from nexrl_hpc.runtime.network import resolve_bind_address
from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
from nexrl_hpc.weight_sync.lost import removed_of
from nexrl_hpc.weight_sync.transport import WeightSyncError, broadcast_backend

if TYPE_CHECKING:
    from nexrl_hpc.inference.interfaces import InferenceServiceRef
    from nexrl_hpc.weight_sync.interfaces import WeightSourceRef

logger = logging.getLogger(__name__)


def sync_weight_dir(base: str, version: int) -> str:
    """Where version ``version`` of the weights is exported for the inference service."""
    return os.path.join(base, f"version_{version}")


class WeightPublisher:
    """Reloads a version on every inference service (in parallel); any failure fails the publication."""

    def __init__(self, config: WeightConfig, launch_mode: str = "mpi"):
        self._sync_path = self.sync_path = config["sync_weight_path"]
        self._keep_versions = config["keep_versions"]
        self._config = config
        self._broadcast_backend = broadcast_backend(config["broadcast_backend"], launch_mode)
        self._inference_services: list[InferenceServiceRef] = []
        self._source: WeightSourceRef | None = None  # set: the engines that can receive a broadcast get one
        self._rendezvous: BroadcastRendezvous | None = None
        self.last_sync: dict[
            str, Any
        ] = {}  # the last broadcast's bytes, buckets, seconds ({} after a disk sync)
        # the services the last successful publish reached: a rank that joins while a version is
        # being published is not among them (its engine gets the next one)
        self.served: list[InferenceServiceRef] = []

    def set_inference_services(self, services: Sequence[InferenceServiceRef]) -> None:
        """The inference services that must serve every new version (all rollout ranks' engines)."""
        self._inference_services = list(services)

    def set_weight_source(self, source: WeightSourceRef) -> None:
        """The trainer's side of the broadcast transport (the train worker)."""
        self._source = source

    def publish(self, version: int) -> None:
        """Every service serves ``version``; raises ``WeightSyncError`` naming the services that do not.

        A service whose rank is lost meanwhile (its calls fail with ``PeerDeadError``) and that the
        controller then removes (policy continue) does not fail the publication: after a reload the
        others serve the version; a broadcast, whose group broke with it, is sent once more to the
        services left."""
        self.last_sync, self.served = {}, []
        for attempt in range(2):
            services = list(self._inference_services)
            names = [execute(s.get_module_name) for s in services]
            failures, others_served = self._publish_once(services, names, version)
            if not failures:
                self.served = services
                return
            removed = removed_of(  # services only: the trainer's side of a broadcast is never removed
                {n: e for n, e in failures if n in names},
                lambda: [execute(s.get_module_name) for s in self._inference_services],
            )
            for name in sorted(removed):
                logger.warning(
                    "%s was lost while publishing version %d: continuing without it", name, version
                )
            if removed and not others_served and attempt == 0:
                logger.warning(
                    "publishing version %d again, to the %d service(s) left",
                    version,
                    len(services) - len(removed),
                )
                continue
            if others_served:
                failures = [(n, e) for n, e in failures if n not in removed]
            if failures:
                how = "served" if others_served else "broadcast"
                raise WeightSyncError(
                    f"weight version {version} not {how}: " + "; ".join(f"{n}: {e}" for n, e in failures)
                )
            self.served = [s for s, n in zip(services, names) if n not in removed]
            return

    def _publish_once(
        self, services: list[InferenceServiceRef], names: list[str], version: int
    ) -> tuple[list[tuple[str, BaseException]], bool]:
        """One try: the failures ``(name, error)``, and whether the services not among them serve
        ``version`` (a reload: each on its own) or not (a broadcast: one group, broken by any)."""
        if self._source is not None and services:
            receivers: list[tuple[InferenceServiceRef, int]] = []
            for name, service in zip(names, services):
                try:
                    receivers.append((service, execute(service.weight_receivers)))
                except Exception as exc:
                    return [(name, exc)], False
            if any(n > 0 for _, n in receivers):
                return self._broadcast(version, receivers, names), False
        path = sync_weight_dir(self._sync_path, version)
        futures = [execute_async(s.reload_weights, path, version) for s in services]
        failures: list[tuple[str, BaseException]] = []
        for name, future in zip(names, futures):
            error = future.exception()
            if error is not None:
                failures.append((name, error))
        return failures, True

    def _broadcast(
        self, version: int, receivers: list[tuple[InferenceServiceRef, int]], names: list[str]
    ) -> list[tuple[str, BaseException]]:
        """One group: the trainer at rank 0, each service's workers at their offsets, all at once.
        The first side to fail calls the group off for the others, joining or mid-stream."""
        cfg = self._config
        if any(n == 0 for _, n in receivers):
            raise WeightSyncError(
                "weight.transport=broadcast: every inference service must receive a broadcast"
            )
        if self._rendezvous is None:
            host = resolve_bind_address(cfg["broadcast_host"], "weight.broadcast_host").address
            self._rendezvous = BroadcastRendezvous(
                host,
                self._broadcast_backend,
                cfg["broadcast_timeout_s"],
                cfg["bucket_mb"],
                cfg["broadcast_form_timeout_s"],
            )
        spec = self._rendezvous.spec(1 + sum(n for _, n in receivers), version)
        assert self._source is not None
        started = time.monotonic()
        # every side is bounded by the group's timeout; this outer bound only catches a lost answer
        bound = 2 * cfg["broadcast_timeout_s"] + 60.0
        with ThreadPoolExecutor(
            max_workers=len(receivers) + 1, thread_name_prefix="weight-broadcast"
        ) as pool:
            sender = pool.submit(execute, self._source.broadcast_weights, spec)
            offsets = [1 + sum(n for _, n in receivers[:i]) for i in range(len(receivers))]
            futures = [
                pool.submit(execute, s.receive_weights, spec, offset, version)
                for (s, _), offset in zip(receivers, offsets)
            ]
            sides: dict[Future[Any], str] = {sender: "trainer", **dict(zip(futures, names))}
            pending: set[Future[Any]] = set(sides)
            deadline = time.monotonic() + bound
            called_off = False
            while pending and time.monotonic() < deadline:
                done, pending = wait(pending, deadline - time.monotonic(), FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed and not called_off:
                    self._rendezvous.abort(spec, f"{sides[failed[0]]} failed: {failed[0].exception()}")
                    called_off = True
        failures: list[tuple[str, BaseException]] = []
        for future, name in sides.items():
            if not future.done():
                failures.append((name, TimeoutError(f"no answer within {bound:.0f}s")))
            elif (error := future.exception()) is not None:
                failures.append((name, error))
        if not failures:
            self.last_sync = dict(sender.result(), seconds=time.monotonic() - started)
        return failures

    def prune(self, current: int) -> None:
        """Keep the newest ``keep_versions`` exports (and ``current``)."""
        if not os.path.isdir(self._sync_path):
            return
        versions = []
        for name in os.listdir(self._sync_path):
            if name.startswith("version_") and name[8:].isdigit():
                versions.append(int(name[8:]))
        for v in sorted(versions)[: -self._keep_versions]:
            if v != current:
                shutil.rmtree(sync_weight_dir(self._sync_path, v), ignore_errors=True)
