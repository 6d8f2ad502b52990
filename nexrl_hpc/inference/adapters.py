"""Per-engine request and response fields for token ids + behaviour log-probs.

Why: every engine asks for (and returns) the ids and log-probs training needs in its own fields.
The client (``LLMServiceClient``) stays engine-agnostic: it sends what an adapter builds and
reads back ``EngineChoice``s; ``create_engine_adapter`` picks the adapter for
``service.inference_service.backend``. Every field of an answer is read through
``response_fields.AnswerReader``: a missing or mistyped one is an ``InferenceResponseError`` naming
the server and the field.

- ``OpenAITokenIdsAdapter`` (backend ``vllm`` and ``local``): OpenAI ``/v1/completions`` and
  ``/v1/chat/completions`` with vLLM's extension ``return_token_ids`` and ``logprobs``; each
  choice carries ``prompt_token_ids``, ``token_ids``, ``logprobs.token_logprobs``. nexrl_hpc's
  local server implements the same fields.
- ``SGLangAdapter`` (backend ``sglang``): SGLang's native ``/generate`` with ``return_logprob``
  and ``return_prompt_token_ids``; the answer (one dict, or a list for a batch or n > 1) has
  ``output_ids``, ``prompt_token_ids`` and ``meta_info.output_token_logprobs`` as
  ``[logprob, token_id, text]`` rows, ``meta_info.finish_reason.type`` and
  ``meta_info.weight_version``. SGLang cannot be installed on this project's CPU machines: the
  adapter is tested against a fake that returns responses of that recorded shape
  (tests/test_engine_adapters.py), not against a real SGLang server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from nexrl_hpc.inference.errors import InferenceResponseError, InferenceServiceError, MissingTokenIdsError
from nexrl_hpc.inference.response_fields import AnswerReader


@dataclass
class EngineChoice:
    """One sampled sequence, in the engine's own token ids."""

    text: str
    finish_reason: str | None
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    weight_version: Any = None
    message: dict[str, Any] = field(default_factory=dict)  # chat: content, reasoning, tool_calls


class EngineAdapter(ABC):
    """Builds an engine's request body and maps its answer to ``EngineChoice``s."""

    def __init__(self, server: str):
        self.server = server  # named in every error

    @abstractmethod
    def completion_request(
        self, model: str, prompts: list[Any], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """(path below the server root, JSON body) completing every prompt in ``prompts``."""

    @abstractmethod
    def completion_choices(self, payload: Any, n_prompts: int, n: int) -> list[EngineChoice]:
        """The ``n_prompts * n`` choices, prompt-major (the n samples of prompt i at i*n .. i*n+n-1)."""

    @abstractmethod
    def chat_request(
        self, model: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """(path below the server root, JSON body) for one chat completion."""

    @abstractmethod
    def chat_choice(self, payload: Any) -> EngineChoice:
        """The first choice of a chat completion, with its message fields."""


class OpenAITokenIdsAdapter(EngineAdapter):
    """vLLM's OpenAI server (and nexrl_hpc's local server, which speaks the same fields)."""

    def completion_request(
        self, model: str, prompts: list[Any], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "prompt": prompts if len(prompts) > 1 else prompts[0]}
        body.update(kwargs)  # standard keys and vLLM extensions (top_k, stop_token_ids, ...) alike
        body["logprobs"] = 1
        body["return_token_ids"] = True
        return "v1/completions", body

    def completion_choices(self, payload: Any, n_prompts: int, n: int) -> list[EngineChoice]:
        read = AnswerReader(self.server, "a completion request")
        choices = read.items(read.field(payload, "choices", list, "", required=False) or [], dict, "choices")
        if len(choices) != n_prompts * n:
            raise InferenceResponseError(
                f"{self.server}: asked for {n_prompts * n} choices, got {len(choices)}"
            )
        by_index: dict[int, dict[str, Any]] = {}
        for i, choice in enumerate(choices):
            index = read.field(choice, "index", int, f"choices[{i}]")
            if not 0 <= index < len(choices) or index in by_index:
                raise read.error(f"choices[{i}].index", f"is {index}: each of 0..{len(choices) - 1} once")
            by_index[index] = choice
        version = read.field(payload, "weight_version", int, "", required=False)
        return [
            self._completion_choice(read, by_index[i], f"choices[{i}]", version) for i in range(len(choices))
        ]

    def _completion_choice(
        self, read: AnswerReader, choice: dict[str, Any], path: str, version: Any
    ) -> EngineChoice:
        if choice.get("token_ids") is None or choice.get("prompt_token_ids") is None:
            raise MissingTokenIdsError(
                f"{self.server} returned no token ids; the server must support 'return_token_ids' "
                "(vLLM >= 0.10.2 or nexrl_hpc's server)"
            )
        response_ids = read.ints(choice["token_ids"], f"{path}.token_ids")
        logprobs = read.field(choice, "logprobs", dict, path, required=False) or {}
        token_logprobs = logprobs.get("token_logprobs")
        if (
            token_logprobs is None
            or not isinstance(token_logprobs, list)
            or len(token_logprobs) != len(response_ids)
        ):
            raise InferenceResponseError(
                f"{self.server} returned no per-token logprobs for the completion ({path})"
            )
        return EngineChoice(
            text=read.field(choice, "text", str, path),
            finish_reason=read.field(choice, "finish_reason", str, path, required=False),
            prompt_ids=read.ints(choice["prompt_token_ids"], f"{path}.prompt_token_ids"),
            response_ids=response_ids,
            logprobs=read.floats(token_logprobs, f"{path}.logprobs.token_logprobs"),
            weight_version=version,
        )

    def chat_request(
        self, model: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "messages": messages}
        body.update(kwargs)
        body["logprobs"] = True
        body["return_token_ids"] = True
        return "v1/chat/completions", body

    def chat_choice(self, payload: Any) -> EngineChoice:
        read = AnswerReader(self.server, "a chat completion request")
        choices = read.items(read.field(payload, "choices", list, ""), dict, "choices")
        if not choices:
            raise read.error("choices", "is empty")
        choice = choices[0]
        prompt_ids = payload.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if choice.get("token_ids") is None or prompt_ids is None:
            raise MissingTokenIdsError(
                f"{self.server} returned no token ids; the server must support 'return_token_ids'"
            )
        content = (
            read.field(
                read.field(choice, "logprobs", dict, "choices[0]", required=False) or {},
                "content",
                list,
                "choices[0].logprobs",
                required=False,
            )
            or []
        )
        logprobs = [
            float(read.field(item, "logprob", float, f"choices[0].logprobs.content[{i}]"))
            for i, item in enumerate(content)
        ]
        message = read.field(choice, "message", dict, "choices[0]")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return EngineChoice(
            text=read.field(message, "content", str, "choices[0].message", required=False) or "",
            finish_reason=read.field(choice, "finish_reason", str, "choices[0]", required=False),
            prompt_ids=read.ints(prompt_ids, "prompt_token_ids"),
            response_ids=read.ints(choice["token_ids"], "choices[0].token_ids"),
            logprobs=logprobs,
            weight_version=read.field(payload, "weight_version", int, "", required=False),
            message={
                "reasoning": None
                if reasoning is None
                else read.check(reasoning, str, "choices[0].message.reasoning"),
                "tool_calls": read.field(message, "tool_calls", list, "choices[0].message", required=False)
                or [],
            },
        )


class SGLangAdapter(EngineAdapter):
    """SGLang's native ``/generate`` (token ids in, token ids + log-probs out)."""

    _RENAMED = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}

    def completion_request(
        self, model: str, prompts: list[Any], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        sampling = {self._RENAMED.get(k, k): v for k, v in kwargs.items()}
        batch = len(prompts) > 1
        key = "text" if isinstance(prompts[0], str) else "input_ids"
        body: dict[str, Any] = {
            key: prompts if batch else prompts[0],
            "sampling_params": sampling,
            "return_logprob": True,
            "return_prompt_token_ids": True,
        }
        return "generate", body

    def completion_choices(self, payload: Any, n_prompts: int, n: int) -> list[EngineChoice]:
        items = payload if isinstance(payload, list) else [payload]
        if len(items) != n_prompts * n:
            raise InferenceResponseError(
                f"{self.server}: asked for {n_prompts * n} outputs, got {len(items)}"
            )
        read = AnswerReader(self.server, "a /generate request")
        return [
            self._choice(read, item, f"[{i}]" if isinstance(payload, list) else "")
            for i, item in enumerate(items)
        ]

    def _choice(self, read: AnswerReader, item: Any, path: str) -> EngineChoice:
        read.check(item, dict, path or "the answer")
        meta = read.field(item, "meta_info", dict, path, required=False) or {}
        rows = meta.get("output_token_logprobs")
        prompt_ids = item.get("prompt_token_ids")
        if rows is None or prompt_ids is None:
            raise MissingTokenIdsError(
                f"{self.server} returned no token ids/logprobs; /generate needs 'return_logprob' and "
                "'return_prompt_token_ids' (a recent SGLang)"
            )
        where = f"{path}.meta_info.output_token_logprobs" if path else "meta_info.output_token_logprobs"
        for i, row in enumerate(read.items(rows, list, where)):
            if len(row) < 2:
                raise read.error(f"{where}[{i}]", f"is {row!r:.60}, not [logprob, token_id, text]")
            read.check(row[0], float, f"{where}[{i}][0]")
            read.check(row[1], int, f"{where}[{i}][1]")
        response_ids = [int(r[1]) for r in rows]
        output_ids = item.get("output_ids")
        if output_ids is not None and read.ints(output_ids, f"{path}.output_ids".lstrip(".")) != response_ids:
            raise InferenceServiceError(f"{self.server}: output_ids and output_token_logprobs disagree")
        reason = meta.get("finish_reason")
        return EngineChoice(
            text=read.field(item, "text", str, path, required=False) or "",
            finish_reason=reason.get("type") if isinstance(reason, dict) else reason,
            prompt_ids=read.ints(prompt_ids, f"{path}.prompt_token_ids".lstrip(".")),
            response_ids=response_ids,
            logprobs=[float(r[0]) for r in rows],
            weight_version=_int_version(read, meta.get("weight_version"), f"{path}.meta_info.weight_version"),
        )

    def chat_request(
        self, model: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        raise InferenceServiceError(
            f"{self.server}: backend=sglang serves completions through /generate only; apply the chat "
            "template in the rollout worker and call completion() with the token ids"
        )

    def chat_choice(self, payload: Any) -> EngineChoice:
        raise NotImplementedError


def _int_version(read: AnswerReader, value: Any, path: str) -> int | None:
    """SGLang reports the version it was given as a string ("default" when never set)."""
    if isinstance(value, str):
        return int(value) if value.isdigit() else None
    return None if value is None else int(read.check(value, int, path.lstrip(".")))


_ADAPTERS: dict[str, type[EngineAdapter]] = {
    "local": OpenAITokenIdsAdapter,
    "vllm": OpenAITokenIdsAdapter,
    "sglang": SGLangAdapter,
}


def create_engine_adapter(backend: str, server: str) -> EngineAdapter:
    """The adapter for ``service.inference_service.backend``; ``server`` is named in errors."""
    try:
        return _ADAPTERS[backend](server)
    except KeyError:
        raise ValueError(
            f"no engine adapter for service.inference_service.backend={backend!r} (one of {sorted(_ADAPTERS)})"
        ) from None
