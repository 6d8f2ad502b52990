"""Pick the LLM client for ``service.inference_service.backend``."""

from __future__ import annotations

from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig


def create_llm_client(config: RLTrainConfig, base_url: str | None, api_key: str | None) -> Any:
    service = config["service"]["inference_service"]
    if service["backend"] == "fake":
        from nexrl_hpc.inference.fake import FakeLLMServiceClient

        return FakeLLMServiceClient(service["model_tag"], seed=config["seed"])
    from nexrl_hpc.inference.client import LLMServiceClient

    return LLMServiceClient(service, base_url=base_url, api_key=api_key)
