"""A vLLM server seen as the weight verifier sees an inference service: its name, where it is, and
its canary scores under a served model name (tests/test_vllm.py, tests/test_vllm_lora.py)."""

from __future__ import annotations

import httpx

from nexrl_hpc.inference.vllm_server import VLLMServer
from nexrl_hpc.weight_sync.verify import engine_prompt_log_probs


class CanaryOnServer:
    def __init__(self, server: VLLMServer, model: str, name: str = "inference_service_1"):
        self._server, self._model, self._name = server, model, name

    def get_module_name(self) -> str:
        return self._name

    def describe(self) -> str:
        return str(self._server.base_url)

    def score_canary(self, prompts: list[list[int]]) -> list[list[float]]:
        headers = {"Authorization": f"Bearer {self._server.api_key}"}
        with httpx.Client() as http:
            return engine_prompt_log_probs(
                http, str(self._server.base_url), headers, self._model, prompts, 60.0
            )
