"""OpenAI-compatible HTTP server around ``HFEngine`` (FastAPI + uvicorn).

Request and response fields follow vLLM's so one client talks to both: ``return_token_ids`` adds
``prompt_token_ids``/``token_ids`` per choice, ``logprobs`` gives ``token_logprobs``. Weights reload
through SGLang's ``/update_weights_from_disk``. Every endpoint but ``/health`` requires the bearer
key from ``NEXRL_INFERENCE_API_KEY`` when it is set. Binds to the given host (loopback by default).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, cast

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from nexrl_hpc.inference.engine import GenerationOutput, GenerationRequest, HFEngine, SamplingParams

logger = logging.getLogger("nexrl_hpc.inference.server")
API_KEY_ENV = "NEXRL_INFERENCE_API_KEY"


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


def create_app(engine: HFEngine, served_model_name: str, api_key: str | None) -> FastAPI:
    """The FastAPI app; ``engine`` is shared, ``api_key`` (if set) is required on every call but /health."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="nexrl_hpc local inference", lifespan=lifespan)
    tokenizer = engine.tokenizer
    id_to_token = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            supplied = request.headers.get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "invalid or missing API key", "AuthenticationError")
        return await call_next(request)

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
        future = engine.submit(GenerationRequest(prompts=prompts, params=params))
        return await asyncio.wrap_future(future)

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
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (no orphans after kill -9)",
    )
    args = parser.parse_args(argv)
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
    app = create_app(engine, args.served_model_name, os.environ.get(API_KEY_ENV) or None)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]

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


if __name__ == "__main__":
    main()
