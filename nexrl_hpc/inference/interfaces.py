"""What the other modules call on an inference service: the seam between it and its peers.

The controller starts it, the weight publisher reloads its weights, a rollout worker asks for
its endpoint. Peers hold it as a module reference (the service itself, or a handle to it on another
rank) and call it through ``execute``; typed as this Protocol, mypy checks every call, and the
controller's wiring checks ``InferenceService`` against it. Imports only lower floors (none).
"""

from __future__ import annotations

from typing import Any, Protocol


class InferenceServiceRef(Protocol):
    def get_module_name(self) -> str: ...

    def get_endpoint(self) -> tuple[str | None, str | None]: ...

    def reload_weights(self, model_path: str, version: int) -> None: ...

    def score_canary(self, prompts: list[list[int]]) -> list[list[float]]: ...

    def describe(self) -> str: ...

    def weight_receivers(self) -> int: ...

    def receive_weights(self, spec: dict[str, Any], rank_offset: int, version: int) -> None: ...
