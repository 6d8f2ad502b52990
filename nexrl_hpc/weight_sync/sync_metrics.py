"""What one weight sync cost: ``weight_sync/seconds``, ``weight_sync/bytes``, ``weight_sync/gbps``.

``seconds``: from the publication's start until every engine serves the version (the verification
after it not included). ``bytes``: one copy of the weights (each engine receives that much, all of
them at once), read from the export's safetensors files, or for ``weight.transport=broadcast`` the bytes the
trainer sent; ``gbps``: bytes x 8 / seconds / 1e9, the delivery rate per engine.
"""

from __future__ import annotations

import os


def export_bytes(path: str) -> int | None:
    """Bytes of the ``*.safetensors`` files under ``path`` (None: no export there)."""
    if not os.path.isdir(path):
        return None
    return sum(
        os.path.getsize(os.path.join(path, name))
        for name in os.listdir(path)
        if name.endswith(".safetensors")
    )


def sync_metrics(seconds: float, nbytes: int | None) -> dict[str, float]:
    metrics = {"weight_sync/seconds": seconds}
    if nbytes is not None:
        metrics["weight_sync/bytes"] = float(nbytes)
        metrics["weight_sync/gbps"] = nbytes * 8 / max(seconds, 1e-9) / 1e9
    return metrics
