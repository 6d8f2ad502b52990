"""The OpenAI-compatible API of the local inference server: request models, and what each route
does around the shared ``HFEngine`` (limits checked, requests cut into engine batches, responses in
vLLM's shape: ``return_token_ids`` adds ``prompt_token_ids``/``token_ids`` per choice, ``logprobs``
gives ``token_logprobs``). ``inference.server`` puts it behind its gate and serves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from nexrl_hpc.inference.engine import GenerationOutput, HFEngine, SamplingParams

logger = logging.getLogger("nexrl_hpc.inference.server")
CONFIG_KEY = "service.inference_service.local"


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (``service.inference_service.local.max_*``)."""

    max_n: int
    max_prompts: int
    max_body_bytes: int


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    logprobs: int | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's: each prompt token's log-prob
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    stream: bool = False
    seed: int | None = None  # the request's own sampling stream (reproducible, as vLLM's)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    logprobs: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    stream: bool = False
    seed: int | None = None  # the request's own sampling stream (reproducible, as vLLM's)


class TokenSamplingParams(BaseModel):
    """``sampling_params`` of vLLM's token-in/token-out ``/inference/v1/generate``: what this
    server samples with, plus vLLM's fields that only shape text (accepted, no effect on tokens).
    Any other vLLM sampling field is refused by name, not ignored."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(default=16, ge=1)  # vLLM's default; None: up to the context
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=0)  # 0 or -1: every token (vLLM's "off")
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=1)  # the sampled token's; no top candidates
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class GenerateRequest(BaseModel):
    """vLLM's ``/inference/v1/generate`` (token ids in, token ids out), as far as this server goes:
    one prompt of token ids, ``output_mode`` "tokens", no streaming, no multimodal features."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = None
    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: TokenSamplingParams = Field(default_factory=TokenSamplingParams)
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: Literal[False] | None = False
    cache_salt: str | None = None  # a prefix-cache salt: this server has no prefix cache
    priority: Literal[0] = 0


class UpdateWeightsRequest(BaseModel):
    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None


class BroadcastWeightsRequest(BaseModel):
    group: dict[str, Any]  # weight_sync/wire.py's group spec
    rank: int
    weight_version: int


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": err_type, "code": status}}
    )


def _json(payload: dict[str, Any]) -> Response:
    return Response(content=json.dumps(payload, separators=(",", ":")), media_type="application/json")


def sampling_params(
    max_tokens: int, req: CompletionRequest | ChatCompletionRequest | TokenSamplingParams
) -> SamplingParams:
    """The engine's sampling settings from a request's fields (every route names them alike)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        n=req.n,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        seed=req.seed,
    )


def _token_id_logprobs(out: GenerationOutput) -> list[dict[str, Any]]:
    """Each sampled token's log-prob, named by id as vLLM's generate route (``token_id``) and as
    ``renderers`` reads it (``token``: "token_id:N"); no top candidates."""
    return [
        {"token_id": t, "token": f"token_id:{t}", "logprob": lp, "rank": None, "top_logprobs": []}
        for t, lp in zip(out.token_ids, out.logprobs)
    ]


class OpenAIApi:
    """What the routes do, around the shared engine: requests checked against the limits, cut into
    engine batches, answered in vLLM's response shape."""

    def __init__(self, engine: HFEngine, served_model_name: str, limits: RequestLimits) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.limits = limits
        self.tokenizer = engine.tokenizer

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's token; "" for an id the tokenizer has no token for (a model's embedding padded
        past its tokenizer, as Qwen's: such ids are sampled, and decode to nothing)."""
        return [token or "" for token in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def over_limits(self, n: int, num_prompts: int) -> str | None:
        """Why a request asks for too much (a 400), or None."""
        limits = self.limits
        if n > limits.max_n:
            return f"n={n} is over this server's limit of {limits.max_n} ({CONFIG_KEY}.max_n)"
        if num_prompts > limits.max_prompts:
            return (
                f"{num_prompts} prompts in one request, over this server's limit of {limits.max_prompts} "
                f"({CONFIG_KEY}.max_prompts_per_request)"
            )
        return None

    def envelope(
        self,
        prefix: str,
        kind: str,
        choices: list[dict[str, Any]],
        n_prompt: int,
        outputs: list[GenerationOutput],
    ) -> dict[str, Any]:
        """The response around the choices: id, usage, and the weight version that produced them."""
        n_completion = sum(len(o.token_ids) for o in outputs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            },
            "weight_version": outputs[0].weight_version if outputs else self.engine.weight_version,
        }

    async def run(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """Checked whole first (ValueError: a 400, nothing queued), then cut into engine batches."""
        engine = self.engine
        engine.validate(prompts, params)
        futures = [asyncio.wrap_future(engine.submit(part)) for part in engine.split(prompts, params)]
        return [out for part in await asyncio.gather(*futures) for out in part]

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "owned_by": "nexrl_hpc",
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    def _completion_prompt_ids(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """A text, a list of texts, one prompt's token ids or a list of them: token ids per prompt."""
        if isinstance(prompt, str):
            return [self.tokenizer(prompt).input_ids]
        if prompt and isinstance(prompt[0], int):
            return [list(cast("list[int]", prompt))]
        if prompt and isinstance(prompt[0], str):
            return cast("list[list[int]]", self.tokenizer(list(prompt)).input_ids)
        return [list(p) for p in cast("list[list[int]]", prompt)]

    def _completion_choice(
        self, req: CompletionRequest, index: int, out: GenerationOutput, text: str
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "finish_reason": out.finish_reason,
            "stop_reason": None,
        }
        if req.logprobs is not None:
            toks = self.token_strings(out.token_ids)
            choice["logprobs"] = {
                "tokens": toks,
                "token_logprobs": out.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        else:
            choice["logprobs"] = None
        if req.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        return choice

    def _prompt_logprobs(self, ids: list[int], log_probs: list[float]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` shape: None for the first token, then {token id: {logprob, rank,
        decoded_token}} of the prompt's own token (the top alternatives are not computed)."""
        tokens = self.token_strings(ids)
        return [None] + [
            {str(t): {"logprob": lp, "rank": None, "decoded_token": s}}
            for t, lp, s in zip(ids[1:], log_probs, tokens[1:])
        ]

    async def completions(self, req: CompletionRequest) -> Response:
        if req.stream:
            return error_response(400, "stream=true is not supported by this server")
        prompt = req.prompt
        many = bool(prompt) and not isinstance(prompt, str) and not isinstance(prompt[0], int)
        if problem := self.over_limits(req.n, len(prompt) if many else 1):
            return error_response(400, problem)
        prompt_ids = self._completion_prompt_ids(prompt)
        if not prompt_ids:
            return error_response(400, "prompt is empty")
        params = sampling_params(req.max_tokens, req)
        try:
            outputs = await self.run(prompt_ids, params)
        except ValueError as exc:
            return error_response(400, str(exc))
        texts = self.tokenizer.batch_decode([o.token_ids for o in outputs], skip_special_tokens=True)
        choices = [
            self._completion_choice(req, index, out, text)
            for index, (out, text) in enumerate(zip(outputs, texts))
        ]
        if req.prompt_logprobs is not None:
            scored = await asyncio.to_thread(self.engine.prompt_log_probs, prompt_ids)
            for index, choice in enumerate(choices):
                choice["prompt_logprobs"] = self._prompt_logprobs(
                    prompt_ids[index // req.n], scored[index // req.n]
                )
        n_prompt = sum(len(p) for p in prompt_ids) * req.n
        return _json(self.envelope("cmpl", "text_completion", choices, n_prompt, outputs))

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template (token ids); raises what the template raises."""
        # token ids, or a BatchEncoding holding them (the return type varies across transformers versions)
        prompt: Any = self.tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        return cast("list[int]", prompt)

    def _chat_choice(self, req: ChatCompletionRequest, index: int, out: GenerationOutput) -> dict[str, Any]:
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "finish_reason": out.finish_reason,
            "stop_reason": None,
        }
        if req.logprobs:
            toks = self.token_strings(out.token_ids)
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(toks, out.logprobs)
                ]
            }
        else:
            choice["logprobs"] = None
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        return choice

    async def chat_completions(self, req: ChatCompletionRequest) -> Response:
        if req.stream:
            return error_response(400, "stream=true is not supported by this server")
        if not self.tokenizer.chat_template:
            return error_response(400, "the model's tokenizer has no chat template; use /v1/completions")
        if problem := self.over_limits(req.n, 1):
            return error_response(400, problem)
        try:
            prompt = self._chat_prompt(req)
        except Exception as exc:
            return error_response(400, f"could not apply the chat template: {exc}")
        max_tokens = req.max_completion_tokens or req.max_tokens or (self.engine.max_model_len - len(prompt))
        params = sampling_params(max_tokens, req)
        try:
            outputs = await self.run([list(prompt)], params)
        except ValueError as exc:
            return error_response(400, str(exc))
        choices = [self._chat_choice(req, index, out) for index, out in enumerate(outputs)]
        payload = self.envelope("chatcmpl", "chat.completion", choices, len(prompt), outputs)
        if req.return_token_ids:
            payload["prompt_token_ids"] = list(prompt)
        return _json(payload)

    async def generate(self, req: GenerateRequest) -> Response:
        """One prompt's token ids in, each sample's token ids (and their log-probs) out, in vLLM's
        ``GenerateResponse`` shape. Each log-prob entry names its token both as vLLM does
        (``token_id``) and as ``renderers`` (verifiers' training client) reads it (``token``:
        "token_id:N"), so either client parses the answer."""
        sp = req.sampling_params
        if problem := self.over_limits(sp.n, 1):
            return error_response(400, problem)
        prompt = list(req.token_ids)
        params = sampling_params(sp.max_tokens or max(self.engine.max_model_len - len(prompt), 1), sp)
        try:
            outputs = await self.run([prompt], params)
        except ValueError as exc:
            return error_response(400, str(exc))
        choices: list[dict[str, Any]] = []
        for index, out in enumerate(outputs):
            logprobs = None if sp.logprobs is None else {"content": _token_id_logprobs(out)}
            choice = {"index": index, "finish_reason": out.finish_reason, "stop_reason": None}
            choices.append({**choice, "token_ids": out.token_ids, "logprobs": logprobs})
        payload = self.envelope("gen", "generate", choices, len(prompt), outputs)
        payload["request_id"] = req.request_id or payload.pop("id")
        payload["output_mode"] = "tokens"
        if req.return_token_ids:
            payload["prompt_token_ids"] = prompt
        return _json(payload)

    async def update_weights_from_broadcast(self, req: BroadcastWeightsRequest) -> Response:
        from nexrl_hpc.inference.broadcast_receive import receive_into_engine

        try:
            message = await asyncio.to_thread(
                receive_into_engine, self.engine, req.group, req.rank, req.weight_version
            )
        except Exception as exc:
            logger.error("weight broadcast (version %d) failed: %s", req.weight_version, exc)
            return JSONResponse(
                status_code=400, content={"success": False, "message": f"{type(exc).__name__}: {exc}"}
            )
        return _json({"success": True, "message": message, "weight_version": self.engine.weight_version})

    async def update_weights_from_disk(self, req: UpdateWeightsRequest) -> Response:
        engine = self.engine
        version = req.weight_version
        if isinstance(version, str):
            if not version.strip().lstrip("-").isdigit():
                return JSONResponse(
                    status_code=400,
                    content={
                        "success": False,
                        "message": f"weight_version: {version[:40]!r} is not an integer",
                    },
                )
            version = int(version)
        try:
            message = await asyncio.to_thread(engine.load_weights_from_disk, req.model_path, version)
        except Exception as exc:
            logger.error("weight reload from %s failed: %s", req.model_path, exc)
            return JSONResponse(status_code=400, content={"success": False, "message": str(exc)})
        return _json(
            {
                "success": True,
                "message": message,
                "weight_version": engine.weight_version,
                "num_paused_requests": 0,
            }
        )
