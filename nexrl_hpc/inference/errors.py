"""Errors of the inference client (a module of their own so the engine adapters can raise them)."""

from __future__ import annotations


class InferenceServiceError(RuntimeError):
    """The inference service failed or could not be reached; the message names its URL."""


class MissingTokenIdsError(InferenceServiceError):
    """The server answered without the token ids training needs (wrong engine or version)."""
