"""The trainer's peak memory, reported with every update (verl's ``perf/max_memory_*_gb`` keys).

A long-response run that is about to run out of GPU memory shows it here first; the peak is the
process's since it started (not reset per step), the number an out-of-memory error compares with.
"""

from __future__ import annotations

import resource
import sys

import torch

GIB = float(1 << 30)


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """``perf/max_rss_gb`` (the process's peak resident memory) always; on CUDA also the caching
    allocator's peak ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb``."""
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_unit = 1.0 if sys.platform == "darwin" else 1024.0  # bytes on macOS, KiB on Linux
    metrics = {"perf/max_rss_gb": rss_kib * per_unit / GIB}
    if device.type == "cuda" and torch.cuda.is_available():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GIB
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GIB
    return metrics
