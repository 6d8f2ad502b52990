"""Errors of the inference client (a module of their own so the engine adapters can raise them).

Three ways a request fails, told apart because only two of them are worth another attempt:
the server could not be reached (``InferenceUnreachableError``) or did not answer in time
(``InferenceTimeoutError``), both retried; or the server answered with an error of its own
(``InferenceServerError``: it received the request, tried it and failed, or refused it), raised at
once with the server's message: asking again would generate again and fail again. A fourth, also
raised at once: the server answered, but not in its engine's protocol (``InferenceResponseError``).
"""

from __future__ import annotations


class InferenceServiceError(RuntimeError):
    """The inference service failed or could not be reached; the message names its URL."""


class InferenceResponseError(InferenceServiceError):
    """The server answered, but with a body its engine's protocol does not allow (not JSON, a field
    missing or of the wrong type); the message names the server and the field. Not retried: the
    same server would answer the same way."""


class MissingTokenIdsError(InferenceResponseError):
    """The server answered without the token ids training needs (wrong engine or version)."""


class InferenceUnreachableError(InferenceServiceError):
    """No answer from the server: connection refused or reset, or a gateway saying it is unavailable."""


class InferenceTimeoutError(InferenceServiceError):
    """The server did not answer within the request's timeout, on every attempt."""


class InferenceServerError(InferenceServiceError):
    """The server's own error (an HTTP 4xx/5xx answer): ``status_code`` and the server's ``server_message``."""

    def __init__(self, message: str, status_code: int, server_message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.server_message = server_message

    def __reduce__(self) -> tuple[type, tuple[str, int, str]]:  # picklable with its three fields
        return (type(self), (str(self), self.status_code, self.server_message))
