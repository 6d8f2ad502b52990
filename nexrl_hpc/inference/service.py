"""InferenceService: the inference engine a rollout worker talks to, as a module on the worker's rank.

It starts nexrl_hpc's local server or a vLLM server in vLLM's own venv (``backend=local|vllm``
without ``base_url``) or stands for a given server (``base_url``; the only way for ``sglang``), hands the endpoint to colocated rollout workers (the per-run API key never
leaves the rank), and reloads weights through the transport its backend needs — so the weight
publisher publishes the same way whatever the engine and wherever it runs.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import httpx

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import long_poll, quick
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.inference.lora_adapter import vllm_max_lora_rank
from nexrl_hpc.weight_sync.transport import create_weight_transport, run_uses_broadcast

if TYPE_CHECKING:
    from nexrl_hpc.inference.local_server import LocalInferenceServer
    from nexrl_hpc.inference.vllm_server import VLLMServer

logger = logging.getLogger(__name__)


class InferenceService(NexRLModule):
    def __init__(self, config: RLTrainConfig, model_dir: str, run_dir: str):
        super().__init__()
        self._service = config["service"]["inference_service"]
        self._train = config["service"]["train_service"]
        self._attn = config["model"]["attn_implementation"]
        self._runtime = config["runtime"]
        # a verifiers environment's training client calls vLLM's token-in/token-out route
        self._token_route = config["rollout_worker"]["type"] == "verifiers"
        self._model_dir = model_dir
        self._run_dir = run_dir
        self._server: VLLMServer | LocalInferenceServer | None = None
        self._base_url: str | None = self._service["base_url"]
        self._api_key: str | None = self._service["api_key"]
        self._canary_http: httpx.Client | None = None  # weight verification's requests (score_canary)
        self._receiving = threading.Condition()  # held while a broadcast is being received
        self._receives = 0
        self._broadcast = run_uses_broadcast(config)  # a LoRA adapter: from disk
        lora_rank = int(self._train["actor"]["lora"]["rank"])
        # vLLM with a LoRA policy: adapters up to this rank (0: full fine-tuning)
        self._lora_max_rank = (
            vllm_max_lora_rank(self._service["vllm"]["max_lora_rank"], lora_rank) if lora_rank else 0
        )
        self._transport = create_weight_transport(
            self._service["backend"],
            self._service["request_timeout_s"],
            self._service["vllm"]["pause_mode"],
            broadcast=self._broadcast,
            tensor_parallel=self._service["vllm"]["tensor_parallel_size"],
            lora_adapter_name=self._service["model"] if lora_rank else None,
        )

    @property
    def _manages_server(self) -> bool:
        return self._service["backend"] in ("local", "vllm") and not self._service["base_url"]

    def launch(self) -> None:
        """Start the server process (if this service runs one) without waiting for it."""
        if not self._manages_server or self._server is not None:
            return
        if self._service["backend"] == "vllm":
            from nexrl_hpc.inference.vllm_server import VLLMServer

            self._server = VLLMServer(
                self._model_dir,
                self._service["vllm"],
                os.path.join(self._run_dir, "logs"),
                self._service["model"],
                log_name=f"{self._module_name}.log",
                keep_alive_s=self._runtime["rpc"]["preauth_timeout_s"],
                weight_broadcast=self._broadcast,
                lora_max_rank=self._lora_max_rank,
                token_route=self._token_route,
            )
            self._server.launch()
            return
        from nexrl_hpc.inference.local_server import LocalInferenceServer

        self._server = LocalInferenceServer(
            self._model_dir,
            self._service["local"],
            os.path.join(self._run_dir, "logs"),
            self._service["model"],
            device=self._train["device"],
            dtype=self._train["dtype"],
            attn_implementation=self._attn,
            log_name=f"{self._module_name}.log",
            runtime=self._runtime,
        )
        self._server.launch()

    @long_poll
    def wait_ready(self) -> str | None:
        """Block until the server answers; returns its base URL (None for the fake backend)."""
        if self._server is not None and self._base_url is None:
            self._base_url = self._server.wait_ready()
            self._api_key = self._server.api_key
        if self._base_url is not None:
            self._transport.set_endpoint(self._base_url, self._api_key)
        return self._base_url

    def get_endpoint(self) -> tuple[str | None, str | None]:
        """(base URL, API key) for the rollout workers on this rank."""
        return self.wait_ready(), self._api_key

    def reload_weights(self, model_path: str, version: int) -> None:
        """Serve the weights in ``model_path`` as ``version`` (raises WeightSyncError on failure)."""
        self._transport.publish(model_path, version)

    def score_canary(self, prompts: list[list[int]]) -> list[list[float]]:
        """The engine's log-probs of each canary prompt's tokens after the first (weight verification,
        weight_sync/verify.py), asked on this rank: the API key never leaves it."""
        from nexrl_hpc.weight_sync.verify import engine_prompt_log_probs

        base_url = self.wait_ready()
        if base_url is None:
            raise RuntimeError(f"{self._module_name}: no server to score the canary with")
        if self._canary_http is None:
            self._canary_http = httpx.Client()
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        return engine_prompt_log_probs(
            self._canary_http,
            base_url,
            headers,
            self._service["model"],
            prompts,
            self._service["request_timeout_s"],
        )

    def weight_receivers(self) -> int:
        """Ranks this server takes in a weight broadcast group (0: it reloads from disk)."""
        return self._transport.receivers() if self._transport.broadcast else 0

    def receive_weights(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        """Serve what the trainer broadcasts to the group ``spec`` as ``version`` (raises WeightSyncError)."""
        with self._receiving:
            self._receives += 1
        try:
            self._transport.receive(spec, rank_offset, version)
        finally:
            with self._receiving:
                self._receives -= 1
                self._receiving.notify_all()

    def wait_for_receives(self, timeout_s: float) -> bool:
        """Whether no broadcast is being received within ``timeout_s``. A joined rank that leaves
        lets the one in flight end before its server goes: killed inside a group that formed with
        it, it would hold the trainer's side until the group's timeout."""
        with self._receiving:
            return self._receiving.wait_for(lambda: self._receives == 0, timeout_s)

    @quick
    def health_check(self) -> bool:
        return self._server is None or self._server.is_alive()

    def describe(self) -> str:
        if self._server is not None:
            pid = self._server.process.pid if self._server.process else None
            return f"{self._base_url} (pid {pid}, log {self._server.log_path})"
        return str(self._base_url)

    def stop(self) -> None:
        if self._canary_http is not None:
            self._canary_http.close()
        if self._server is not None:
            self._server.stop()

    def abort(self) -> None:
        """The server's state is worth nothing now: its processes are killed, not shut down."""
        super().abort()
        if self._server is not None:
            self._server.kill()
