"""How the controller stops modules: in parallel by a deadline, and shutdown steps that must not raise."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from nexrl_hpc.core.execute import execute_async

logger = logging.getLogger(__name__)


def stop_all(handles: Sequence[Any], deadline: float) -> None:
    """Stop modules in parallel (remote ones may be slow or gone) by ``deadline``."""
    futures = [execute_async(h.stop) for h in handles]
    for f in futures:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            logger.exception("error during shutdown")


def quietly(fn: Callable[[], object]) -> None:
    """Run one shutdown step; its error is logged, never raised (the next steps still run)."""
    try:
        fn()
    except Exception:
        logger.exception("error during shutdown")
