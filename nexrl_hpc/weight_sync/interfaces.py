"""What the weight publisher calls on the trainer's side: the seam for the broadcast transport.

Imports only lower floors (none).
"""

from __future__ import annotations

from typing import Any, Protocol


class WeightSourceRef(Protocol):
    """The module that holds the trainer (the train worker): it sends the weights to a sync's group."""

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]: ...
