"""``nexrl_chat``: a harness that runs the conversation in the worker's own process.

verifiers' own harnesses (``null``, ``bash``, ...) launch a program in a runtime, bootstrapped with
``uv`` from the network: not possible on a compute node without one. verifiers lets a harness run its
loop in-process instead, as long as every model call goes through the interception ``endpoint`` with
its ``secret`` (``Harness.launch``'s contract); the trace then records each call's token ids and
log-probs. This one sends the task's prompt (with its system prompt) and takes the model's reply: one
turn. Replies asking for tools end the episode: the environment's MCP tool servers are not wired in yet.
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult


class NexrlChatConfig(vf.HarnessConfig):
    id: str = "nexrl_chat"


class NexrlChat(vf.Harness[NexrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        **_: Any,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=endpoint, headers=headers, timeout=None) as http:
            reply = await http.post("/chat/completions", json={"model": ctx.model, "messages": messages})
        if reply.status_code != 200:
            return ProgramResult(exit_code=1, stdout="", stderr=reply.text)
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["NexrlChat"]
