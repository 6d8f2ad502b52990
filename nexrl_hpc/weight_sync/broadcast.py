"""The broadcast transport (``weight.transport=broadcast``): weights over one process group, no files.

One sync: the publisher (publisher.py) hosts a rendezvous store, names a fresh group for the sync
(``spec``: backend, the store's address, a prefix, the world size, the timeout, the bucket size)
and, at once, asks the trainer to send (its rank 0 is the group's rank 0:
``trainer/weight_broadcast.py``) and every inference service to receive at its rank offset. The
wire is ``wire.py``. A group per sync: a server that was restarted or requeued simply takes part
in the next one, and a group that broke (a server died mid-broadcast, within ``timeout_s``) leaves
nothing behind.

- ``LocalBroadcastTransport``: nexrl_hpc's local server, ``POST /update_weights_from_broadcast``.
- ``VLLMBroadcastTransport``: vLLM's own weight-transfer API (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) with the engine the run
  registers in vLLM (``inference/vllm_weight_plugin.py``, started with ``--weight-transfer-config``),
  between pause and resume as the disk reload does.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import time
from typing import Any

import httpx

from nexrl_hpc.weight_sync.transport import (
    VLLMReloadTransport,
    WeightSyncError,
    WeightTransport,
    _http_client,
)

logger = logging.getLogger(__name__)

VLLM_ENGINE_NAME = "nexrl_broadcast"  # the name the plugin registers its engine under in vLLM


class BroadcastRendezvous:
    """The TCPStore every sync's group meets at (in the publisher's process), and the specs."""

    def __init__(self, host: str, backend: str, timeout_s: float, bucket_mb: int):
        import torch.distributed as dist

        self._store = dist.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.host, self.port = host, int(self._store.port)
        self._backend, self._timeout_s, self._bucket_bytes = backend, timeout_s, bucket_mb << 20
        self._syncs = itertools.count()

    def spec(self, world_size: int, version: int) -> dict[str, Any]:
        return {
            "backend": self._backend,
            "host": self.host,
            "port": self.port,
            "prefix": f"v{version}.{next(self._syncs)}",
            "world_size": world_size,
            "timeout_s": self._timeout_s,
            "bucket_bytes": self._bucket_bytes,
        }


class LocalBroadcastTransport(WeightTransport):
    """POST /update_weights_from_broadcast {spec, rank, weight_version} to nexrl_hpc's local server."""

    broadcast = True

    def __init__(self, timeout_s: float):
        self._timeout = timeout_s
        self._base_url: str | None = None
        self._headers: dict[str, str] = {}
        self._http = _http_client()

    def set_endpoint(self, base_url: str, api_key: str | None) -> None:
        self._base_url = base_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def publish(self, model_path: str, version: int) -> None:
        raise WeightSyncError(f"{self._base_url}: weight.transport=broadcast does not reload {model_path}")

    def receivers(self) -> int:
        return 1

    def receive(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        if self._base_url is None:
            raise WeightSyncError("no inference endpoint set for weight sync")
        url = f"{self._base_url}/update_weights_from_broadcast"
        body = {"group": spec, "rank": rank_offset, "weight_version": version}
        try:  # the group's own timeout bounds the wait; the HTTP one only outlives it
            resp = self._http.post(
                url, json=body, headers=self._headers, timeout=self._timeout + spec["timeout_s"]
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"weight broadcast to {url} failed: {type(exc).__name__}: {exc}") from exc
        try:
            answer = resp.json()
        except ValueError:
            answer = {"success": False, "message": resp.text[:500]}
        if resp.status_code != 200 or not answer.get("success"):
            raise WeightSyncError(
                f"weight broadcast to {url} refused ({resp.status_code}): {answer.get('message')}"
            )
        if int(answer.get("weight_version", -1)) != version:
            raise WeightSyncError(
                f"{url} reports version {answer.get('weight_version')} after receiving {version}"
            )


class VLLMBroadcastTransport(VLLMReloadTransport):
    """vLLM's weight-transfer API with the run's engine; the server stays paused after a failure (its
    weights may be half replaced), as the disk reload leaves it."""

    broadcast = True

    def __init__(self, timeout_s: float, pause_mode: str, tensor_parallel: int):
        super().__init__(timeout_s, pause_mode)
        self._request_timeout_s = timeout_s
        self._workers = tensor_parallel

    def publish(self, model_path: str, version: int) -> None:
        raise WeightSyncError(f"{self._base_url}: weight.transport=broadcast does not reload {model_path}")

    def receivers(self) -> int:
        return self._workers

    def receive(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        if self._base_url is None:
            raise WeightSyncError("no inference endpoint set for weight sync")
        self._timeout = self._request_timeout_s + spec["timeout_s"]  # joining and receiving wait on the group
        t0 = time.perf_counter()
        self._call("POST", "/pause", params={"mode": self._pause_mode})
        init = dict(spec, rank_offset=rank_offset)
        self._call("POST", "/init_weight_transfer_engine", json={"init_info": init})
        t1 = time.perf_counter()
        self._call("POST", "/start_weight_update")
        self._call("POST", "/update_weights", json={"update_info": {}})
        self._call("POST", "/finish_weight_update", json={"weight_version": str(version)})
        t2 = time.perf_counter()
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        served = (self._call("GET", "/weight_info") or {}).get("weight_version")
        if served != str(version):
            raise WeightSyncError(
                f"{self._base_url}/weight_info reports version {served!r} after receiving version {version}; "
                "server left paused"
            )
        self._call("POST", "/reset_prefix_cache")  # cached KV was computed with the old weights
        self._call("POST", "/resume")
        t3 = time.perf_counter()
        self.served_version = version
        self.last_timings = {
            "pause_join": t1 - t0,
            "receive": t2 - t1,
            "version_resume": t3 - t2,
            "total": t3 - t0,
        }
