"""Pick the LLM client for ``service.inference_service.backend``."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING

from nexrl_hpc.config.schema import RLTrainConfig

if TYPE_CHECKING:
    from typing import TypeAlias

    from nexrl_hpc.inference.client import LLMServiceClient
    from nexrl_hpc.inference.fake import FakeLLMServiceClient

    LLMClient: TypeAlias = "LLMServiceClient | FakeLLMServiceClient"
    """What a rollout worker talks to: the real client, or the fake one (``backend=fake``)."""


CLIENT_MODULE = "nexrl_hpc.inference.client"


def import_llm_client_ahead(config: RLTrainConfig) -> threading.Thread | None:
    """Import the real client's module (with ``openai``: a noticeable import) on a thread of its own.

    Called while the run waits for its inference servers to start, so the first rollout finds it
    imported; ``create_llm_client`` then waits on the module's import lock if it is not done. An
    import error is left for that foreground import to raise."""
    if config["service"]["inference_service"]["backend"] == "fake" or CLIENT_MODULE in sys.modules:
        return None

    def import_client() -> None:
        try:
            importlib.import_module(CLIENT_MODULE)
        except Exception:  # reported by the import in create_llm_client
            pass

    thread = threading.Thread(target=import_client, name="import-llm-client", daemon=True)
    thread.start()
    return thread


def create_llm_client(config: RLTrainConfig, base_url: str | None, api_key: str | None) -> LLMClient:
    service = config["service"]["inference_service"]
    if service["backend"] == "fake":
        from nexrl_hpc.inference.fake import FakeLLMServiceClient

        model = config["model"]
        if model["path"] is None:
            from nexrl_hpc.models.run_tokenizer import build_tiny_tokenizer

            tokenizer = build_tiny_tokenizer(model["tiny"]["tokenizer"])  # the ids the run's model uses
        else:
            from nexrl_hpc.models.tiny import load_tokenizer

            tokenizer = load_tokenizer(model["path"])
        return FakeLLMServiceClient(
            service["model_tag"],
            tokenizer,
            seed=config["seed"],
            latency_s=service["fake_latency_ms"] / 1000.0,
        )
    from nexrl_hpc.inference.client import LLMServiceClient

    return LLMServiceClient(service, base_url=base_url, api_key=api_key)
