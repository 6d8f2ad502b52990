"""What the other modules call on a data loader: the seam between the loader and its peers.

A peer holds a loader as a module reference (the loader itself in local mode, a handle to it on
another rank) and calls it through ``execute``; typed as this Protocol, mypy checks every such call
against the signatures below, and the controller's wiring checks ``DatasetLoader`` against it (the
controller, the composition root, holds the concrete classes). Imports only lower floors.
"""

from __future__ import annotations

from typing import Any, Protocol


class DataLoaderRef(Protocol):
    # --- rollout workers: tasks out, acknowledgements and returns back ---------------------------
    def get_next_items(
        self, max_items: int, wait_s: float = 0.0, consumer: str | None = None
    ) -> list[dict[str, Any]]: ...

    def complete_items(self, consumer: str, keys: list[str], delivered: bool = True) -> None: ...

    def add_item_front(self, item: dict[str, Any]) -> None: ...

    # --- the dispatch budget (its one writer: the rollout scheduler) ------------------------------
    def set_dispatch_budget(self, budget: int | None) -> None: ...

    def add_dispatch_budget(self, items: int) -> None: ...

    def num_untrained(self) -> int: ...

    # --- trained tasks (the pool's filtered groups, the train worker's batches) ------------------
    def release_items(self, keys: list[str]) -> None: ...

    def can_return_item(self) -> bool: ...

    # --- progress and state (validator, train worker) --------------------------------------------
    def total_tasks(self) -> int: ...

    def is_finished(self) -> bool: ...

    def outstanding(self) -> dict[str, int]: ...

    def get_skipped_rows(self) -> int: ...

    def get_filtered_long_prompts(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...
