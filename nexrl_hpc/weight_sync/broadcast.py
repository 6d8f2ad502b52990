"""The broadcast transport (``weight.transport=broadcast``): weights over one process group, no files.

One sync: the publisher (publisher.py) hosts a rendezvous store, names a fresh group for the sync
(``spec``: backend, the store's address, a prefix, the world size, the timeouts, the bucket size)
and, at once, asks the trainer to send (its rank 0 is the group's rank 0:
``trainer/weight_broadcast.py``) and every inference service to receive at its rank offset. The
wire is ``wire.py``. A group per sync: a server that was restarted or requeued simply takes part
in the next one, and a group that broke (a server died mid-broadcast, within ``timeout_s``) leaves
nothing behind.

The receiving sides are transports (transport.py):

- ``LocalBroadcastTransport``: nexrl_hpc's local server, ``POST /update_weights_from_broadcast``.
- ``VLLMBroadcastTransport``: vLLM's own weight-transfer API (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) with the engine the run
  registers in vLLM (``inference/vllm_weight_plugin.py``, started with ``--weight-transfer-config``),
  between pause and resume as the disk reload does.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
from typing import Any


class BroadcastRendezvous:
    """The TCPStore every sync's group meets at (in the publisher's process), and the specs."""

    def __init__(
        self, host: str, backend: str, timeout_s: float, bucket_mb: int, form_timeout_s: float | None = None
    ):
        import torch.distributed as dist

        self._store = dist.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.host, self.port = host, int(self._store.port)
        self._backend, self._timeout_s, self._bucket_bytes = backend, timeout_s, bucket_mb << 20
        self._form_timeout_s = min(timeout_s, form_timeout_s or timeout_s)
        self._syncs = itertools.count()

    def abort(self, spec: dict[str, Any], reason: str) -> None:
        """Call the sync ``spec`` off: members still waiting to join raise with ``reason``."""
        from nexrl_hpc.weight_sync.wire import ABORT_KEY

        self._store.set(f"{spec['prefix']}/{ABORT_KEY}", reason)

    def spec(self, world_size: int, version: int) -> dict[str, Any]:
        """The next sync's group. Its prefix ends in 128 random bits: the store takes connections
        from anyone who can reach its port, and every key of the sync (each member's join, its
        gloo/NCCL addresses, the call-off) lives under the prefix, which travels only in the
        run's signed calls — a neighbour who cannot guess it can neither join, hijack nor call
        off a sync."""
        return {
            "backend": self._backend,
            "host": self.host,
            "port": self.port,
            "prefix": f"v{version}.{next(self._syncs)}.{secrets.token_hex(16)}",
            "world_size": world_size,
            "timeout_s": self._timeout_s,
            "form_timeout_s": self._form_timeout_s,
            "bucket_bytes": self._bucket_bytes,
        }
