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
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from nexrl_hpc.config.schema import WeightConfig
from nexrl_hpc.core.execute import execute, execute_async
from nexrl_hpc.runtime.network import resolve_bind_address
from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
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

    def set_inference_services(self, services: Sequence[InferenceServiceRef]) -> None:
        """The inference services that must serve every new version (all rollout ranks' engines)."""
        self._inference_services = list(services)

    def set_weight_source(self, source: WeightSourceRef) -> None:
        """The trainer's side of the broadcast transport (the train worker)."""
        self._source = source

    def publish(self, version: int) -> None:
        """Every service serves ``version``; raises ``WeightSyncError`` naming the services that do not."""
        self.last_sync = {}
        if self._source is not None and self._inference_services:
            receivers = [(s, execute(s.weight_receivers)) for s in self._inference_services]
            if any(n > 0 for _, n in receivers):
                self._broadcast(version, receivers)
                return
        path = sync_weight_dir(self._sync_path, version)
        services = list(self._inference_services)
        futures = [(s, execute_async(s.reload_weights, path, version)) for s in services]
        failures = []
        for service, future in futures:
            try:
                future.result()
            except Exception as exc:
                name = execute(service.get_module_name)
                if name not in {execute(s.get_module_name) for s in self._inference_services}:
                    logger.warning("%s was removed while reloading version %d: %s", name, version, exc)
                    continue  # lost meanwhile (policy continue): the others serve the version
                failures.append(f"{name}: {exc}")
        if failures:
            raise WeightSyncError(f"weight version {version} not served: " + "; ".join(failures))

    def _broadcast(self, version: int, receivers: list[tuple[InferenceServiceRef, int]]) -> None:
        """One group: the trainer at rank 0, each service's workers at their offsets, all at once."""
        cfg = self._config
        if any(n == 0 for _, n in receivers):
            raise WeightSyncError(
                "weight.transport=broadcast: every inference service must receive a broadcast"
            )
        if self._rendezvous is None:
            host = resolve_bind_address(cfg["broadcast_host"], "weight.broadcast_host").address
            self._rendezvous = BroadcastRendezvous(
                host, self._broadcast_backend, cfg["broadcast_timeout_s"], cfg["bucket_mb"]
            )
        spec = self._rendezvous.spec(1 + sum(n for _, n in receivers), version)
        assert self._source is not None
        started = time.monotonic()
        names = [execute(s.get_module_name) for s, _ in receivers]
        with ThreadPoolExecutor(
            max_workers=len(receivers) + 1, thread_name_prefix="weight-broadcast"
        ) as pool:
            sender = pool.submit(execute, self._source.broadcast_weights, spec)
            offsets = [1 + sum(n for _, n in receivers[:i]) for i in range(len(receivers))]
            futures = [
                pool.submit(execute, s.receive_weights, spec, offset, version)
                for (s, _), offset in zip(receivers, offsets)
            ]
            # every side is bounded by the group's timeout; this outer bound only catches a lost answer
            bound = 2 * cfg["broadcast_timeout_s"] + 60.0
            pending: list[Future[Any]] = [sender, *futures]
            wait(pending, timeout=bound)
        failures = []
        for name, future in zip(names, futures):
            if not future.done():
                failures.append(f"{name}: no answer within {bound:.0f}s")
            elif future.exception() is not None:
                failures.append(f"{name}: {future.exception()}")
        if sender.done() and sender.exception() is not None:
            failures.append(f"trainer: {sender.exception()}")
        if failures:
            raise WeightSyncError(f"weight version {version} not broadcast: " + "; ".join(failures))
        self.last_sync = dict(sender.result(), seconds=time.monotonic() - started)

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
