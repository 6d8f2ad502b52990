"""OpenAI-compatible HTTP server around ``HFEngine`` (FastAPI + uvicorn).

Request and response fields follow vLLM's so one client talks to both: ``return_token_ids`` adds
``prompt_token_ids``/``token_ids`` per choice, ``logprobs`` gives ``token_logprobs``. Weights reload
through SGLang's ``/update_weights_from_disk``. Every endpoint but ``/health`` requires the bearer
key from ``NEXRL_INFERENCE_API_KEY`` when it is set. Binds to the given host (loopback by default).

What one request may cost is bounded (``RequestLimits``, from ``service.inference_service.local``):
its body size (checked after the key, before a byte of the body is buffered past the cap), ``n``,
the number of prompts; each prompt is checked against the model (vocabulary, context length) before
anything is queued, and a request is cut into engine batches of at most ``max_batch_size``
sequences. Over a limit is a 400 naming the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nexrl_hpc.inference.engine import GenerationOutput, HFEngine, SamplingParams
from nexrl_hpc.inference.prewarm import API_KEY_ENV, SPEC_FROM_STDIN, read_spec
from nexrl_hpc.runtime.gc_tuning import GcSettings, freeze_imports, settle_after_setup

logger = logging.getLogger("nexrl_hpc.inference.server")
CONFIG_KEY = "service.inference_service.local"


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (``service.inference_service.local.max_*``)."""

    max_n: int
    max_prompts: int
    max_body_bytes: int


class _Gate:
    """Pure ASGI, outermost: the key first (headers only, constant-time), then the body, read up
    to ``max_body_bytes`` and refused past it (a declared Content-Length over the cap is refused
    before any of it is read). A peer without the key never gets a byte of its body buffered."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        guarded = self.expected is not None and scope["path"] != "/health"
        if guarded and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected or b""):
            await _send_error(send, 401, "invalid or missing API key", "AuthenticationError")
            return
        too_big = f"request body over {self.max_body_bytes >> 20} MiB ({CONFIG_KEY}.max_request_mb)"
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body_bytes:
            await _send_error(send, 400, too_big)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await _send_error(send, 400, too_big)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _send_error(send: Send, status: int, message: str, err_type: str = "BadRequestError") -> None:
    payload = json.dumps({"error": {"message": message, "type": err_type, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    stream: bool = False


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


class UpdateWeightsRequest(BaseModel):
    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None


def _error(status: int, message: str, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": err_type, "code": status}}
    )


def _json(payload: dict[str, Any]) -> Response:
    return Response(content=json.dumps(payload, separators=(",", ":")), media_type="application/json")


def create_app(
    engine: HFEngine, served_model_name: str, api_key: str | None, limits: RequestLimits
) -> FastAPI:
    """The FastAPI app; ``engine`` is shared, ``api_key`` (if set) is required on every call but /health."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="nexrl_hpc local inference", lifespan=lifespan)
    tokenizer = engine.tokenizer
    id_to_token = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))

    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=limits.max_body_bytes)

    def over_limits(n: int, num_prompts: int) -> str | None:
        """Why a request asks for too much (a 400), or None."""
        if n > limits.max_n:
            return f"n={n} is over this server's limit of {limits.max_n} ({CONFIG_KEY}.max_n)"
        if num_prompts > limits.max_prompts:
            return (
                f"{num_prompts} prompts in one request, over this server's limit of {limits.max_prompts} "
                f"({CONFIG_KEY}.max_prompts_per_request)"
            )
        return None

    def envelope(
        prefix: str, kind: str, choices: list[dict[str, Any]], n_prompt: int, outputs: list[GenerationOutput]
    ) -> dict[str, Any]:
        """The response around the choices: id, usage, and the weight version that produced them."""
        n_completion = sum(len(o.token_ids) for o in outputs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": served_model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            },
            "weight_version": outputs[0].weight_version if outputs else engine.weight_version,
        }

    async def run(prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """Checked whole first (ValueError: a 400, nothing queued), then cut into engine batches."""
        engine.validate(prompts, params)
        futures = [asyncio.wrap_future(engine.submit(part)) for part in engine.split(prompts, params)]
        return [out for part in await asyncio.gather(*futures) for out in part]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "owned_by": "nexrl_hpc",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        if req.stream:
            return _error(400, "stream=true is not supported by this server")
        prompt = req.prompt
        many = bool(prompt) and not isinstance(prompt, str) and not isinstance(prompt[0], int)
        if problem := over_limits(req.n, len(prompt) if many else 1):
            return _error(400, problem)
        if isinstance(prompt, str):
            prompt_ids = [tokenizer(prompt).input_ids]
        elif prompt and isinstance(prompt[0], int):
            prompt_ids = [list(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompt_ids = tokenizer(list(prompt)).input_ids
        else:
            prompt_ids = [list(p) for p in cast("list[list[int]]", prompt)]
        if not prompt_ids:
            return _error(400, "prompt is empty")
        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            n=req.n,
            stop_token_ids=tuple(req.stop_token_ids or ()),
        )
        try:
            outputs = await run(prompt_ids, params)
        except ValueError as exc:
            return _error(400, str(exc))
        choices = []
        texts = tokenizer.batch_decode([o.token_ids for o in outputs], skip_special_tokens=True)
        for index, (out, text) in enumerate(zip(outputs, texts)):
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "finish_reason": out.finish_reason,
                "stop_reason": None,
            }
            if req.logprobs is not None:
                toks = [id_to_token[t] for t in out.token_ids]
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
            choices.append(choice)
        return _json(
            envelope("cmpl", "text_completion", choices, sum(len(p) for p in prompt_ids) * req.n, outputs)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        if req.stream:
            return _error(400, "stream=true is not supported by this server")
        if not tokenizer.chat_template:
            return _error(400, "the model's tokenizer has no chat template; use /v1/completions")
        if problem := over_limits(req.n, 1):
            return _error(400, problem)
        try:
            # token ids, or a BatchEncoding holding them (the return type varies across transformers versions)
            prompt: Any = tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:
            return _error(400, f"could not apply the chat template: {exc}")
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        max_tokens = req.max_completion_tokens or req.max_tokens or (engine.max_model_len - len(prompt))
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            n=req.n,
            stop_token_ids=tuple(req.stop_token_ids or ()),
        )
        try:
            outputs = await run([list(prompt)], params)
        except ValueError as exc:
            return _error(400, str(exc))
        choices = []
        for index, out in enumerate(outputs):
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "finish_reason": out.finish_reason,
                "stop_reason": None,
            }
            if req.logprobs:
                toks = tokenizer.convert_ids_to_tokens(out.token_ids)
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
            choices.append(choice)
        payload = envelope("chatcmpl", "chat.completion", choices, len(prompt), outputs)
        if req.return_token_ids:
            payload["prompt_token_ids"] = list(prompt)
        return _json(payload)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsRequest) -> Response:
        version = int(req.weight_version) if req.weight_version is not None else None
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

    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # inherited by accepted connections: no Nagle/delayed-ACK stalls (40 ms) on keep-alive requests
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _exit_with_parent(parent_pid: int) -> None:
    """A server started by a run must not outlive it (e.g. when the run is SIGKILLed)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                logger.warning("parent process %d is gone; exiting", parent_pid)
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nexrl_hpc local OpenAI-compatible inference server")
    parser.add_argument("--model", required=True, help="HF-layout model directory")
    parser.add_argument("--served-model-name", default="policy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (written to --ready-file)")
    parser.add_argument(
        "--ready-file", default=None, help="JSON {host, port, pid} is written here once serving"
    )
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--attn-implementation", default=None, choices=["eager", "sdpa", "flash_attention_2"])
    parser.add_argument(
        "--engine-stop-timeout-s",
        type=float,
        required=True,
        help="at shutdown, wait this long for the engine loop (service.inference_service.local.engine_stop_timeout_s)",
    )
    parser.add_argument("--max-n", type=int, required=True, help=f"{CONFIG_KEY}.max_n")
    parser.add_argument(
        "--max-prompts-per-request", type=int, required=True, help=f"{CONFIG_KEY}.max_prompts_per_request"
    )
    parser.add_argument("--max-request-mb", type=int, required=True, help=f"{CONFIG_KEY}.max_request_mb")
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (no orphans after kill -9)",
    )
    parser.add_argument(
        "--gc-freeze-after-setup",
        action="store_true",
        help="runtime.gc_freeze_after_setup, once the model is loaded",
    )
    args = parser.parse_args(argv)
    # the thresholds were set before the imports (nexrl_hpc.inference.server_process)
    gc_settings = GcSettings(gc_thresholds=[], gc_freeze_after_setup=args.gc_freeze_after_setup)
    freeze_imports(gc_settings)  # the module's imports are done (also in a prewarmed process)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    # Slurm sends its notification signals (preemption, time limit) to every process of the job:
    # the run that owns this server decides what to do and stops it; the default action would kill it
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.num_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    engine = HFEngine(
        args.model,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        seed=args.seed,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        attn_implementation=args.attn_implementation,
        stop_timeout_s=args.engine_stop_timeout_s,
    )
    engine.weight_version = args.weight_version
    limits = RequestLimits(args.max_n, args.max_prompts_per_request, args.max_request_mb << 20)
    app = create_app(engine, args.served_model_name, os.environ.get(API_KEY_ENV) or None, limits)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    settle_after_setup(gc_settings)
    logger.info(
        "garbage collector: thresholds %s, %d start-up objects frozen",
        gc.get_threshold(),
        gc.get_freeze_count(),
    )

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=60)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if args.ready_file and server.started:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                json.dump({"host": host, "port": port, "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)
        logger.info("serving %s on http://%s:%d", args.model, host, port)
        await task

    asyncio.run(serve())


def main_from_stdin() -> None:
    """A server started before its model existed (``nexrl_hpc.inference.prewarm``): its imports
    are done; wait for the run to say what to serve, or leave when the run closes the pipe."""
    spec = read_spec(sys.stdin.buffer)
    if spec is None:
        return
    main(list(spec["argv"]))


if __name__ == "__main__":
    if sys.argv[1:] == [SPEC_FROM_STDIN]:
        main_from_stdin()
    else:
        main()
