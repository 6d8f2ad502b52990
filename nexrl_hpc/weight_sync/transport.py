"""How new weights reach the inference service: an interface and transports picked by a factory.

The algorithm never branches on the engine: the weight sync controller calls ``publish`` with an
HF-layout directory and a version. ``DiskReloadTransport`` speaks SGLang's
``/update_weights_from_disk`` (which nexrl_hpc's local server implements too).
"""

from __future__ import annotations

import logging
import socket
from abc import ABC, abstractmethod

import httpx

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A reload failed: the version must not be bumped."""


class WeightTransport(ABC):
    @abstractmethod
    def publish(self, model_path: str, version: int) -> None:
        """Make the inference service serve the weights in ``model_path`` as ``version``."""

    def set_endpoint(self, base_url: str, api_key: str | None) -> None:  # noqa: B027 - optional
        pass


class DiskReloadTransport(WeightTransport):
    """POST /update_weights_from_disk {model_path, weight_version}; checks ``success`` and the version."""

    def __init__(self, timeout_s: float):
        self._timeout = timeout_s
        self._base_url: str | None = None
        self._headers: dict[str, str] = {}
        # one kept-alive connection, no Nagle: a reload is a few ms, not a TCP setup + delayed ACK
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        )

    def set_endpoint(self, base_url: str, api_key: str | None) -> None:
        self._base_url = base_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def publish(self, model_path: str, version: int) -> None:
        if self._base_url is None:
            raise WeightSyncError("no inference endpoint set for weight sync")
        url = f"{self._base_url}/update_weights_from_disk"
        try:
            resp = self._http.post(
                url,
                json={"model_path": model_path, "weight_version": version},
                headers=self._headers,
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"weight reload at {url} failed: {exc}") from exc
        try:
            body = resp.json()
        except ValueError:
            body = {"success": False, "message": resp.text[:500]}
        if resp.status_code != 200 or not body.get("success"):
            raise WeightSyncError(
                f"weight reload at {url} refused ({resp.status_code}): {body.get('message')}"
            )
        served = body.get("weight_version")
        if served is not None and int(served) != version:
            raise WeightSyncError(f"{url} reports version {served} after loading version {version}")


class NoopTransport(WeightTransport):
    """For the fake inference backend (benchmarks, tests): nothing to reload."""

    def publish(self, model_path: str, version: int) -> None:
        return None


def create_weight_transport(backend: str, timeout_s: float) -> WeightTransport:
    if backend == "local":
        return DiskReloadTransport(timeout_s)
    if backend == "fake":
        return NoopTransport()
    raise ValueError(f"no weight transport for service.inference_service.backend={backend!r}")
