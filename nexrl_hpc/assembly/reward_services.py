"""The model reward's services (``reward_model.placement=own_ranks``): started, and handed to the rollout workers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from nexrl_hpc.core.execute import execute
from nexrl_hpc.runtime.protocol import Runtime
from nexrl_hpc.types import NexRLRole

logger = logging.getLogger(__name__)


def start_reward_services(runtime: Runtime, rollout_workers: Sequence[Any]) -> list[Any]:
    """Launch every reward service (a judge's server), wait until each scores, give rollout worker
    ``i`` service ``i mod n``; the services, for the controller to stop (none: an empty list)."""
    services = list(runtime.get_actor_wrapper(NexRLRole.REWARD_SERVICE))
    for service in services:
        execute(service.launch)
    for service in services:
        logger.info("reward service ready: %s", execute(service.wait_ready))
    for i, worker in enumerate(rollout_workers if services else ()):
        execute(worker.set_reward_service, services[i % len(services)])
    return services
