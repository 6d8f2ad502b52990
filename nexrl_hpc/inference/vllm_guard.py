"""An ASGI middleware for the vLLM server a run starts: every path but ``/health`` needs the run's key.

Why: the weight reload needs ``VLLM_SERVER_DEV_MODE=1``, whose endpoints (``/pause``,
``/collective_rpc``, ``/resume``, ``/reset_prefix_cache``...) vLLM serves without any key, and its
own ``--api-key`` covers only ``/v1``: anyone who could reach the port could load other weights into
the policy or stall the run. vLLM's ``--middleware`` puts this class outermost, in front of every
route (``nexrl_hpc.inference.vllm_server`` copies this file into a private directory on the
server's ``PYTHONPATH``). It runs in vLLM's venv: standard library only, nothing of nexrl_hpc.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

KEY_ENV = "VLLM_API_KEY"  # what the run sets (vLLM's own variable: not on the command line)
OPEN_PATHS = frozenset({"/health"})


class RequireKey:
    """Refuse (401, or a closed websocket) any request without ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"nexrl_vllm_guard: {KEY_ENV} is not set; refusing to serve without a key")
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS:
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps(
                    {
                        "error": {
                            "message": "invalid or missing API key",
                            "type": "AuthenticationError",
                            "code": 401,
                        }
                    }
                ).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
