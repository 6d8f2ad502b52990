"""LLMServiceClient: the rollout side's only way to an inference server, built on the ``openai`` package.

It asks for what training needs in each engine's own request fields (an ``EngineAdapter`` from
``nexrl_hpc.inference.adapters``, picked by ``service.inference_service.backend``) and returns the
engine's token ids and behaviour log-probs (text is never re-tokenised). Concurrent
async calls with the same sampling parameters are coalesced into one completion request
with a list of prompts, which is what makes hundreds of in-flight rollouts cheap.

A failed call is one of three (``nexrl_hpc.inference.errors``): the server could not be reached
(refused, reset, or a gateway's 502/503/504/429) or did not answer within the request's timeout —
both retried with exponential backoff, then named with the server URL — or the server answered
with its own error (any other HTTP 4xx/5xx), raised at once with the server's message: a retry
would only generate again. A request's timeout grows with the work it asks for:
``request_timeout_s + request_timeout_per_token_s x max_tokens x prompts x n``, so a long
generation is not abandoned and submitted again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import openai

from nexrl_hpc.config.schema import InferenceServiceConfig
from nexrl_hpc.core.execute import aexecute, execute
from nexrl_hpc.inference.adapters import EngineChoice, create_engine_adapter
from nexrl_hpc.inference.errors import (
    InferenceResponseError,
    InferenceServerError,
    InferenceServiceError,
    InferenceTimeoutError,
    InferenceUnreachableError,
    MissingTokenIdsError,
)
from nexrl_hpc.inference.version import RolloutVersionLookup
from nexrl_hpc.types import RolloutServiceStatus

if TYPE_CHECKING:
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef

__all__ = [
    "InferenceResponseError",
    "InferenceServerError",
    "InferenceServiceError",
    "InferenceTimeoutError",
    "InferenceUnreachableError",
    "LLMServiceClient",
    "MissingTokenIdsError",
]

logger = logging.getLogger(__name__)

# answers that say "not now" rather than "this request failed": a proxy or gateway in front of the
# server, or a server that is starting or overloaded; retried like a refused connection
_UNAVAILABLE_STATUS = frozenset({429, 502, 503, 504})


@dataclass
class _Bucket:
    """Calls waiting to be sent together: same kwargs, a list of (prompt, future)."""

    kwargs: dict[str, Any]
    opened: float  # loop time of the first call
    items: list[tuple[Any, asyncio.Future]] = field(default_factory=list)
    seen: int = 0  # items when the flush timer last looked


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


class LLMServiceClient:
    """One client per rollout worker. ``completion``/``generate`` block; ``acompletion``/``agenerate`` coalesce."""

    def __init__(
        self, config: InferenceServiceConfig, base_url: str | None = None, api_key: str | None = None
    ):
        self._config = config
        self._model_tag = config["model_tag"]
        self._model = config["model"]
        url = base_url or config["base_url"]
        if not url:
            raise ValueError("service.inference_service.base_url is not set and no server was started")
        self._root = url.rstrip("/").removesuffix("/v1")  # adapters give paths below the server root
        self._base_url = self._root + "/v1"  # named in errors
        self._adapter = create_engine_adapter(config["backend"], self._base_url)
        self._api_key = api_key or config["api_key"] or "EMPTY"
        self._max_retries = config["max_retries"]
        self._backoff = config["retry_backoff_s"]
        self._timeout = config["request_timeout_s"]
        self._timeout_per_token = config["request_timeout_per_token_s"]
        self._freeze_for_weight_sync = config["freeze_for_weight_sync"]
        self._coalesce_wait_s = config["coalesce_wait_ms"] / 1000.0
        self._coalesce_max_wait_s = config["coalesce_max_wait_ms"] / 1000.0
        self._max_coalesce = config["max_coalesce"]
        self._scheduler: RolloutSchedulerRef | None = None  # the module, or a handle to it
        self._version_lookup = RolloutVersionLookup(self._model_tag)
        self._client = openai.OpenAI(
            base_url=self._root, api_key=self._api_key, max_retries=0, timeout=self._timeout
        )
        self._aclient: openai.AsyncOpenAI | None = None
        self._pending: dict[Any, _Bucket] = {}

    def set_scheduler(self, scheduler: RolloutSchedulerRef | None) -> None:
        """The rollout scheduler: the version requests record, and whether a reload holds them."""
        self._scheduler = scheduler
        self._version_lookup.set_scheduler(scheduler)

    # --- blocking API ---------------------------------------------------------------------------
    def completion(self, prompt: str | list[int], **kwargs: Any) -> dict[str, Any]:
        """One completion of ``prompt``: text, finish reason, prompt/response token ids, logprobs, version."""
        self._wait_for_weight_sync()
        version = self._rollout_version()
        path, body = self._adapter.completion_request(self._model, [prompt], kwargs)
        timeout = self._request_timeout(1, kwargs)
        payload = self._with_retries(lambda: self._post_sync(path, body, timeout), timeout)
        choices = self._adapter.completion_choices(payload, 1, kwargs.get("n", 1))
        return self._completion_result(prompt, choices[0], version, kwargs)

    def generate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """One chat completion: response text, tool calls, token ids, logprobs, version."""
        self._wait_for_weight_sync()
        version = self._rollout_version()
        path, body = self._adapter.chat_request(self._model, messages, kwargs)
        timeout = self._request_timeout(1, kwargs)
        payload = self._with_retries(lambda: self._post_sync(path, body, timeout), timeout)
        return self._chat_result(messages, self._adapter.chat_choice(payload), version, kwargs)

    # --- async API ------------------------------------------------------------------------------
    async def acompletion(self, prompt: str | list[int], **kwargs: Any) -> dict[str, Any]:
        """Like ``completion``; concurrent calls with equal kwargs share one HTTP request."""
        key = (isinstance(prompt, str), _freeze(kwargs))
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        bucket = self._pending.get(key)
        if bucket is None:
            bucket = self._pending[key] = _Bucket(kwargs=dict(kwargs), opened=loop.time())
            loop.call_later(self._coalesce_wait_s, self._flush_when_quiet, key, bucket)
        bucket.items.append((prompt, future))
        if len(bucket.items) >= self._max_coalesce:
            self._flush(key, bucket)
        return await future

    def _flush_when_quiet(self, key: Any, bucket: _Bucket) -> None:
        """Send once no call joined for ``coalesce_wait_ms`` (or ``coalesce_max_wait_ms`` after the
        first): the steps of a batch start over a few milliseconds of the loop's time (more on a
        slow machine), and a fixed window cut them into several requests, i.e. engine batches."""
        if self._pending.get(key) is not bucket:
            return  # already sent (size trigger)
        loop = asyncio.get_running_loop()
        grew = len(bucket.items) != bucket.seen
        bucket.seen = len(bucket.items)
        left = bucket.opened + self._coalesce_max_wait_s - loop.time()
        if grew and left > 0:
            loop.call_later(min(self._coalesce_wait_s, left), self._flush_when_quiet, key, bucket)
            return
        self._flush(key, bucket)

    async def agenerate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        await self._await_weight_sync()
        version = await self._version_lookup.read()
        path, body = self._adapter.chat_request(self._model, messages, kwargs)
        timeout = self._request_timeout(1, kwargs)
        payload = await self._with_retries_async(lambda: self._post_async(path, body, timeout), timeout)
        return self._chat_result(messages, self._adapter.chat_choice(payload), version, kwargs)

    def _flush(self, key: Any, bucket: _Bucket) -> None:
        if self._pending.get(key) is not bucket:
            return  # already sent
        del self._pending[key]
        asyncio.ensure_future(self._send_bucket(bucket))

    async def _send_bucket(self, bucket: _Bucket) -> None:
        prompts = [p for p, _ in bucket.items]
        kwargs = bucket.kwargs
        try:
            await self._await_weight_sync()
            version = await self._version_lookup.read()
            path, body = self._adapter.completion_request(self._model, prompts, kwargs)
            timeout = self._request_timeout(len(prompts), kwargs)
            payload = await self._with_retries_async(lambda: self._post_async(path, body, timeout), timeout)
            n = kwargs.get("n", 1)
            choices = self._adapter.completion_choices(payload, len(prompts), n)
            for i, (prompt, future) in enumerate(bucket.items):
                if future.done():
                    continue
                if n == 1:
                    future.set_result(self._completion_result(prompt, choices[i], version, kwargs))
                else:
                    group = choices[i * n : (i + 1) * n]
                    future.set_result([self._completion_result(prompt, c, version, kwargs) for c in group])
        except Exception as exc:
            for _, future in bucket.items:
                if not future.done():
                    future.set_exception(exc)

    # --- results --------------------------------------------------------------------------------
    def _completion_result(
        self, prompt: Any, choice: EngineChoice, version: int | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        result = dict(kwargs)
        result.update(
            prompt=prompt,
            response=choice.text,
            finish_reason=choice.finish_reason,
            prompt_ids=choice.prompt_ids,
            response_ids=choice.response_ids,
            logprobs=choice.logprobs,
            weight_version=version if choice.weight_version is None else choice.weight_version,
            model_tag=self._model_tag,
        )
        return result

    def _chat_result(
        self,
        messages: list[dict[str, Any]],
        choice: EngineChoice,
        version: int | None,
        kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        result = dict(kwargs)
        result.update(
            messages=messages,
            response=choice.text,
            reasoning=choice.message.get("reasoning"),
            tool_calls=choice.message.get("tool_calls") or [],
            finish_reason=choice.finish_reason,
            prompt_ids=choice.prompt_ids,
            response_ids=choice.response_ids,
            logprobs=choice.logprobs,
            weight_version=version if choice.weight_version is None else choice.weight_version,
            model_tag=self._model_tag,
        )
        return result

    # --- transport ------------------------------------------------------------------------------
    def _request_timeout(self, num_prompts: int, kwargs: dict[str, Any]) -> float:
        """Seconds one request may take: the base plus a share per token it may generate."""
        max_tokens = kwargs.get("max_tokens") or kwargs.get("max_completion_tokens") or 0
        rows = num_prompts * int(kwargs.get("n") or 1)
        return self._timeout + self._timeout_per_token * int(max_tokens) * rows

    def _post_sync(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        raw = self._client.post(f"/{path}", body=body, cast_to=bytes, options={"timeout": timeout})
        return self._decoded(path, raw)

    async def _post_async(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        if self._aclient is None:
            self._aclient = openai.AsyncOpenAI(
                base_url=self._root, api_key=self._api_key, max_retries=0, timeout=self._timeout
            )
        raw = await self._aclient.post(f"/{path}", body=body, cast_to=bytes, options={"timeout": timeout})
        return self._decoded(path, raw)

    def _decoded(self, path: str, raw: bytes) -> Any:
        """The answer's JSON; a body that is none is the server's malformed answer, named."""
        try:
            return json.loads(raw)
        except ValueError:
            raise InferenceResponseError(
                f"{self._base_url}: malformed answer to /{path}: not JSON ({bytes(raw[:80])!r})"
            ) from None

    def _retry_delay(self, exc: Exception, attempt: int, timeout: float) -> float:
        """Seconds to wait before the next attempt; raises when the call must not (or may no longer) be retried."""
        if isinstance(exc, openai.APIStatusError) and exc.status_code not in _UNAVAILABLE_STATUS:
            raise server_error(self._base_url, exc) from exc
        if not isinstance(exc, (openai.APIConnectionError, openai.APIStatusError)):
            raise exc
        if attempt >= self._max_retries:
            attempts = self._max_retries + 1
            if isinstance(exc, openai.APITimeoutError):
                raise InferenceTimeoutError(
                    f"inference service at {self._base_url} did not answer within {timeout:g}s, "
                    f"{attempts} attempts (service.inference_service.request_timeout_s + "
                    "request_timeout_per_token_s x tokens asked)"
                ) from exc
            raise InferenceUnreachableError(
                f"inference service at {self._base_url} unreachable after {attempts} attempts: {exc}"
            ) from exc
        delay = self._backoff * (2**attempt)
        logger.warning(
            "inference call to %s failed (%s); retry %d/%d in %.2fs",
            self._base_url,
            exc,
            attempt + 1,
            self._max_retries,
            delay,
        )
        return delay

    def _with_retries(self, call: Any, timeout: float) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return call()
            except Exception as exc:
                time.sleep(self._retry_delay(exc, attempt, timeout))
                attempt += 1

    async def _with_retries_async(self, call: Any, timeout: float) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return await call()
            except Exception as exc:
                await asyncio.sleep(self._retry_delay(exc, attempt, timeout))
                attempt += 1

    # --- held while the weights reload (the scheduler says when) ---------------------------------
    def _rollout_version(self) -> int | None:
        if self._scheduler is None:
            return None
        return execute(self._scheduler.get_rollout_model_version, self._model_tag)

    def _sync_in_progress(self) -> bool:
        if not self._freeze_for_weight_sync or self._scheduler is None:
            return False
        return (
            execute(self._scheduler.check_rollout_service_status, self._model_tag)
            == RolloutServiceStatus.BLOCK
        )

    def _wait_for_weight_sync(self) -> None:
        while self._sync_in_progress():
            time.sleep(self._config["weight_sync_poll_s"])

    async def _await_weight_sync(self) -> None:
        if not self._freeze_for_weight_sync or self._scheduler is None:
            return
        status = self._scheduler.check_rollout_service_status
        while await aexecute(status, self._model_tag) == RolloutServiceStatus.BLOCK:
            await asyncio.sleep(self._config["weight_sync_poll_s"])

    async def aclose(self) -> None:
        """Close the connections (call from the loop that made the async requests)."""
        if self._aclient is not None:
            await self._aclient.close()
            self._aclient = None
        self._client.close()


def server_message(exc: openai.APIStatusError) -> str:
    """What the server said: the ``message`` of an OpenAI-style error body (vLLM's, ours), FastAPI's
    ``detail``, or the body's text."""
    body = exc.body
    if isinstance(body, dict):
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    text = body if isinstance(body, str) else exc.response.text
    return text.strip() or exc.message


def server_error(base_url: str, exc: openai.APIStatusError) -> InferenceServerError:
    """The server's own error, its message first: a 4xx "rejected the request", a 5xx "failed"."""
    message = server_message(exc)
    verb = "rejected the request" if exc.status_code < 500 else "failed the request"
    return InferenceServerError(
        f"{base_url} {verb} (HTTP {exc.status_code}): {message}", exc.status_code, message
    )
