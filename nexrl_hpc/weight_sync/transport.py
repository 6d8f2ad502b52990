"""How new weights reach the inference service: an interface and transports picked by a factory.

The algorithm never branches on the engine: each inference service calls its transport's
``publish`` with an HF-layout directory and a version when the publisher (publisher.py) asks it to
reload. ``DiskReloadTransport`` speaks SGLang's ``/update_weights_from_disk`` (which nexrl_hpc's
local server implements too; ``SGLangDiskTransport`` is the same class). ``VLLMReloadTransport`` drives vLLM's dev-mode endpoints: pause, reload the
weights from the directory, drop the prefix cache (its KV was computed with the old weights),
resume. vLLM has no weight version: the transport records which version it made the server serve.
Any failure raises ``WeightSyncError`` naming the server, so the caller does not bump the version.

With ``weight.transport=broadcast`` (``uses_broadcast``) nothing is reloaded from disk: the
publisher has the trainer broadcast the weights (broadcast.py, wire.py) and each service's
transport ``receive``s them — ``LocalBroadcastTransport`` (the local server's
``/update_weights_from_broadcast``) or ``VLLMBroadcastTransport`` (vLLM's weight-transfer API).
"""

from __future__ import annotations

import logging
import socket
import time
from abc import ABC, abstractmethod
from typing import Any

import httpx

from nexrl_hpc.checkpoint.adapter import is_adapter_dir
from nexrl_hpc.config.schema import RLTrainConfig

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A reload failed: the version must not be bumped."""


class WeightTransport(ABC):
    broadcast = False  # True: ``receive`` takes the weights from the trainer's broadcast (broadcast.py)

    @abstractmethod
    def publish(self, model_path: str, version: int) -> None:
        """Make the inference service serve the weights in ``model_path`` as ``version``."""

    def set_endpoint(self, base_url: str, api_key: str | None) -> None:  # noqa: B027 - optional
        pass

    def receivers(self) -> int:
        """How many ranks of the broadcast group this server's workers take (broadcast transports)."""
        raise NotImplementedError(f"{type(self).__name__} does not receive broadcasts")

    def receive(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        """Join the sync's group (``spec``) at ``rank_offset`` and serve what the trainer sends as
        ``version`` (broadcast transports; raises ``WeightSyncError`` naming the server)."""
        raise NotImplementedError(f"{type(self).__name__} does not receive broadcasts")


class DiskReloadTransport(WeightTransport):
    """POST /update_weights_from_disk {model_path, weight_version}; checks ``success`` and the version."""

    def __init__(self, timeout_s: float):
        self._timeout = timeout_s
        self._base_url: str | None = None
        self._headers: dict[str, str] = {}
        self._http = _http_client()

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


SGLangDiskTransport = DiskReloadTransport


def _http_client() -> httpx.Client:
    # one kept-alive connection, no Nagle: a reload is a few ms, not a TCP setup + delayed ACK
    return httpx.Client(
        transport=httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    )


class VLLMReloadTransport(WeightTransport):
    """POST /pause?mode=M, /collective_rpc reload_weights(weights_path), /update_weight_version,
    check GET /weight_info, POST /reset_prefix_cache, /resume (vLLM >= 0.32, VLLM_SERVER_DEV_MODE=1).

    If any step fails the server stays paused: after a failed reload it may hold a mix of old and
    new tensors, and no sample must come from that. The next successful ``publish`` resumes it.

    A LoRA policy's adapter directory (``lora_adapter_name`` set: the server was started with LoRA)
    is loaded in place of the adapter of that name (``/v1/load_lora_adapter``, ``load_inplace``)
    between the same pause and resume: the server holds one adapter whatever the number of syncs.
    """

    def __init__(self, timeout_s: float, pause_mode: str, lora_adapter_name: str | None = None):
        self._timeout = timeout_s
        self._pause_mode = pause_mode
        self._adapter_name = lora_adapter_name
        self._base_url: str | None = None
        self._headers: dict[str, str] = {}
        self._http = _http_client()
        self.served_version: int | None = None  # the version this transport last made the server serve
        self.last_timings: dict[str, float] = {}  # seconds per step of the last publish (benchmarks)

    def set_endpoint(self, base_url: str, api_key: str | None) -> None:
        self._base_url = base_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        url = f"{self._base_url}{path}"
        for attempt in (0, 1):
            try:
                resp = self._http.request(method, url, headers=self._headers, timeout=self._timeout, **kwargs)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                # a kept-alive connection the server had closed (vLLM resets it after an error
                # answer, uvicorn after idling): every step is idempotent, so once more on a new one
                self._renew()
                if attempt:
                    raise WeightSyncError(
                        f"weight reload: {url} failed ({type(exc).__name__}: {exc})"
                    ) from exc
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"weight reload: {url} failed ({type(exc).__name__}: {exc})") from exc
        if resp.status_code != 200:
            self._renew()
            raise WeightSyncError(
                f"weight reload: {url} answered {resp.status_code}: {resp.text[:500]}; server left paused"
            )
        try:
            return resp.json()
        except ValueError:
            return None

    def _renew(self) -> None:
        self._http.close()
        self._http = _http_client()

    def publish(self, model_path: str, version: int) -> None:
        if self._base_url is None:
            raise WeightSyncError("no inference endpoint set for weight sync")
        if is_adapter_dir(model_path):
            self._load_adapter(model_path, version)
            return
        t0 = time.perf_counter()
        self._call("POST", "/pause", params={"mode": self._pause_mode})
        t1 = time.perf_counter()
        answer = self._call(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": model_path}},
        )
        # one entry per worker (reload_weights returns None); anything else is not a finished reload
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or any(r is not None for r in results):
            raise WeightSyncError(
                f"weight reload of {model_path} at {self._base_url}/collective_rpc: unexpected answer "
                f"{answer!r}; server left paused"
            )
        t2 = time.perf_counter()
        self._label_version_and_resume(version, "loading")
        t3 = time.perf_counter()
        self.last_timings = {"pause": t1 - t0, "reload": t2 - t1, "version_resume": t3 - t2, "total": t3 - t0}

    def _load_adapter(self, adapter_dir: str, version: int) -> None:
        if self._adapter_name is None:
            raise WeightSyncError(
                f"{adapter_dir} is a LoRA adapter, and the vLLM server at {self._base_url} was not "
                "started for one (service.train_service.actor.lora.rank > 0 with a server the run starts)"
            )
        t0 = time.perf_counter()
        self._call("POST", "/pause", params={"mode": self._pause_mode})
        t1 = time.perf_counter()
        body = {"lora_name": self._adapter_name, "lora_path": adapter_dir, "load_inplace": True}
        self._call("POST", "/v1/load_lora_adapter", json=body)
        t2 = time.perf_counter()
        self._label_version_and_resume(version, "loading the adapter of")
        t3 = time.perf_counter()
        self.last_timings = {"pause": t1 - t0, "reload": t2 - t1, "version_resume": t3 - t2, "total": t3 - t0}

    def _label_version_and_resume(self, version: int, after: str) -> None:
        """Label the loaded weights ``version``, check the server reports it, drop the prefix cache
        (its KV came from the old weights) and resume serving."""
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        served = (self._call("GET", "/weight_info") or {}).get("weight_version")
        if served != str(version):
            raise WeightSyncError(
                f"{self._base_url}/weight_info reports version {served!r} after {after} version {version}; "
                "server left paused"
            )
        self._call("POST", "/reset_prefix_cache")
        self._call("POST", "/resume")
        self.served_version = version


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
        self._label_version_and_resume(version, "receiving")
        t3 = time.perf_counter()
        self.last_timings = {
            "pause_join": t1 - t0,
            "receive": t2 - t1,
            "version_resume": t3 - t2,
            "total": t3 - t0,
        }


class NoopTransport(WeightTransport):
    """For the fake inference backend (benchmarks, tests): nothing to reload."""

    def publish(self, model_path: str, version: int) -> None:
        return None


def reload_needs_tied_head(backend: str) -> bool:
    """Whether the weight exports for ``backend`` must hold a tied model's head under its own name
    (``lm_head.weight`` beside the embedding it shares): vLLM's in-place reload refreshes the head
    only from that entry (``checkpoint.trainer_io.with_tied_entries``). The local engine and SGLang
    re-tie the head to the embedding, so their exports, like checkpoints, hold it once."""
    return backend == "vllm"


def uses_broadcast(transport: str, backend: str, base_url: str | None, lora_rank: int = 0) -> bool:
    """Whether the weights reach this engine by broadcast: ``weight.transport=broadcast`` and an
    engine the run starts itself (local, vLLM); SGLang and a server given by ``base_url`` load from
    disk, and so does a LoRA policy's adapter (a few MB in PEFT layout, whatever the transport)."""
    return transport == "broadcast" and backend in ("local", "vllm") and not base_url and lora_rank == 0


def run_uses_broadcast(config: RLTrainConfig) -> bool:
    """``uses_broadcast`` for the run's own inference service and policy."""
    inference = config["service"]["inference_service"]
    lora_rank = config["service"]["train_service"]["actor"]["lora"]["rank"]
    return uses_broadcast(
        config["weight"]["transport"], inference["backend"], inference["base_url"], lora_rank
    )


def broadcast_backend(configured: str, launch_mode: str) -> str:
    """The group's backend: ``weight.broadcast_backend``, but gloo in local mode, where the trainer
    and its engines share the machine's (usually one) GPU: one GPU cannot hold two ranks of one
    NCCL group."""
    return "gloo" if launch_mode == "local" else configured


def create_weight_transport(
    backend: str,
    timeout_s: float,
    vllm_pause_mode: str,
    broadcast: bool = False,
    tensor_parallel: int = 1,
    lora_adapter_name: str | None = None,
) -> WeightTransport:
    if broadcast:
        if backend == "local":
            return LocalBroadcastTransport(timeout_s)
        return VLLMBroadcastTransport(timeout_s, vllm_pause_mode, tensor_parallel)
    if backend == "local":
        return DiskReloadTransport(timeout_s)
    if backend == "sglang":
        return SGLangDiskTransport(timeout_s)
    if backend == "vllm":
        return VLLMReloadTransport(timeout_s, vllm_pause_mode, lora_adapter_name)
    if backend == "fake":
        return NoopTransport()
    raise ValueError(f"no weight transport for service.inference_service.backend={backend!r}")
