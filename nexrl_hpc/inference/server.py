"""OpenAI-compatible HTTP server around ``HFEngine`` (FastAPI + uvicorn).

Request and response fields follow vLLM's so one client talks to both: ``return_token_ids`` adds
``prompt_token_ids``/``token_ids`` per choice, ``logprobs`` gives ``token_logprobs``; vLLM's
token-in/token-out ``/inference/v1/generate`` is served too (``OpenAIApi.generate``). Weights
reload through SGLang's ``/update_weights_from_disk``. Every endpoint but ``/health`` requires the
bearer key from ``NEXRL_INFERENCE_API_KEY`` when it is set. Binds to the given host (loopback by
default).

What one request may cost is bounded (``RequestLimits``, from ``service.inference_service.local``):
its body size (checked after the key, before a byte of the body is buffered past the cap), ``n``,
the number of prompts; each prompt is checked against the model (vocabulary, context length) before
anything is queued, and a request is cut into engine batches of at most ``max_batch_size``
sequences. Over a limit is a 400 naming the setting; so is a field of the wrong type or value (the
field named, e.g. ``max_tokens``: NaN).

What a peer without the key costs is bounded as on the run's other ports (``runtime.rpc.preauth_*``,
``nexrl_hpc.rpc.http_guard``): a connection must deliver a request head within
``preauth_timeout_s`` (of its start, or of its previous response: idle keep-alive connections too),
at most ``preauth_max_connections`` connections wait for one at once (beyond, the oldest is closed),
and the soft descriptor limit is raised to hold them with room for the run's files.
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
from contextlib import asynccontextmanager
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nexrl_hpc.inference.engine import HFEngine
from nexrl_hpc.inference.openai_api import (
    CONFIG_KEY,
    BroadcastWeightsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIApi,
    RequestLimits,
    UpdateWeightsRequest,
    error_response,
)
from nexrl_hpc.inference.prewarm import API_KEY_ENV, SPEC_FROM_STDIN, read_spec
from nexrl_hpc.rpc.http_guard import guarded_protocol
from nexrl_hpc.rpc.preauth import WireLimits, ensure_fd_room
from nexrl_hpc.runtime.gc_tuning import GcSettings, freeze_imports, settle_after_setup

logger = logging.getLogger("nexrl_hpc.inference.server")
LISTEN_BACKLOG = 2048  # connections the kernel queues, and the most the event loop accepts in one go


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


def create_app(
    engine: HFEngine, served_model_name: str, api_key: str | None, limits: RequestLimits
) -> FastAPI:
    """The FastAPI app; ``engine`` is shared, ``api_key`` (if set) is required on every call but /health."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="nexrl_hpc local inference", lifespan=lifespan)
    api = OpenAIApi(engine, served_model_name, limits)
    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=limits.max_body_bytes)

    async def failed(request: Request, exc: Exception) -> Response:
        """A request the server failed: a 500 whose message is the error (the client shows it;
        Starlette also logs the traceback to the server's log)."""
        return error_response(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    async def invalid(request: Request, exc: Exception) -> Response:
        """A request whose fields do not validate: a 400 naming them (never a 500: the default
        answer echoes the input, which JSON cannot hold when it is NaN)."""
        return error_response(400, invalid_fields(exc))

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, failed)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        return await api.completions(req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        return await api.chat_completions(req)

    @app.post("/inference/v1/generate")
    async def generate(req: GenerateRequest) -> Response:
        return await api.generate(req)

    @app.post("/update_weights_from_broadcast")
    async def update_weights_from_broadcast(req: BroadcastWeightsRequest) -> Response:
        return await api.update_weights_from_broadcast(req)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsRequest) -> Response:
        return await api.update_weights_from_disk(req)

    return app


def invalid_fields(exc: Exception) -> str:
    """The fields of a request that failed validation, each with why (no input values echoed)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + ("; ".join(parts) or str(exc))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # inherited by accepted connections: no Nagle/delayed-ACK stalls (40 ms) on keep-alive requests
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
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


def _parser() -> argparse.ArgumentParser:
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
        "--preauth-timeout-s", type=float, required=True, help="runtime.rpc.preauth_timeout_s"
    )
    parser.add_argument(
        "--preauth-max-connections", type=int, required=True, help="runtime.rpc.preauth_max_connections"
    )
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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
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
    # the connection cap, a burst of accepts before it closes the extra ones, room for the reloads' files
    ensure_fd_room(1, wire_limits(args), accept_burst=LISTEN_BACKLOG)
    app = create_app(engine, args.served_model_name, os.environ.get(API_KEY_ENV) or None, limits)
    sock = _bind(args.host, args.port)
    settle_after_setup(gc_settings)
    logger.info(
        "garbage collector: thresholds %s, %d start-up objects frozen",
        gc.get_threshold(),
        gc.get_freeze_count(),
    )
    _serve(app, sock, args)


def wire_limits(args: argparse.Namespace) -> WireLimits:
    """The pre-authentication limits of the port (the bytes are ``max_request_mb``'s gate's)."""
    return WireLimits(args.max_request_mb << 20, args.preauth_timeout_s, args.preauth_max_connections, 0.0)


def _serve(app: FastAPI, sock: socket.socket, args: argparse.Namespace) -> None:
    """Serve on ``sock`` until stopped; the ready file (host, port, pid) is written once serving."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        backlog=LISTEN_BACKLOG,
        http=guarded_protocol(wire_limits(args), "inference server"),  # head deadline, connection cap
        timeout_keep_alive=max(1, int(args.preauth_timeout_s)),  # the guard's deadline ends idle ones first
    )
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
