"""The publish step: every inference service serves an exported weight version, old exports go.

The trainer exports version ``v`` (HF layout) under ``sync_weight_dir(weight.sync_weight_path, v)``;
``WeightPublisher.publish(v)`` has every inference service reload that directory (each through the
transport its backend needs, see transport.py: the publisher never branches on it), and ``prune``
then keeps the newest ``weight.keep_versions`` exports (after the clients are let go: a reload holds
them, a prune need not). It moves data only: when a version may be published
and what a publication unblocks is the rollout scheduler's business (scheduler/).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nexrl_hpc.config.schema import WeightConfig
from nexrl_hpc.core.execute import execute, execute_async
from nexrl_hpc.weight_sync.transport import WeightSyncError

if TYPE_CHECKING:
    from nexrl_hpc.inference.interfaces import InferenceServiceRef

logger = logging.getLogger(__name__)


def sync_weight_dir(base: str, version: int) -> str:
    """Where version ``version`` of the weights is exported for the inference service."""
    return os.path.join(base, f"version_{version}")


class WeightPublisher:
    """Reloads a version on every inference service (in parallel); any failure fails the publication."""

    def __init__(self, config: WeightConfig):
        self._sync_path = self.sync_path = config["sync_weight_path"]
        self._keep_versions = config["keep_versions"]
        self._inference_services: list[InferenceServiceRef] = []

    def set_inference_services(self, services: Sequence[InferenceServiceRef]) -> None:
        """The inference services that must serve every new version (all rollout ranks' engines)."""
        self._inference_services = list(services)

    def publish(self, version: int) -> None:
        """Every service serves ``version``; raises ``WeightSyncError`` naming the services that do not."""
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
