"""``nexrl_chat``: verifiers' own chat program (the ``null`` harness's), run in the worker's process.

verifiers' ``null`` harness runs its bundled chat program (a chat loop that calls the task's MCP
tool servers, ``verifiers.v1.harnesses.utils.core``) as a PEP 723 script: ``uv`` first downloads
the script's packages into an environment of its own, which a compute node without a network
cannot do. Those packages are the verifiers venv's own, so this harness runs the same loop in the
worker's process: the same tools (each MCP server of the task, listed and called as the program
does), the same messages, every model call through the interception ``endpoint`` with its
``secret`` (what ``Harness.launch``'s contract asks of an in-process harness), the loop ending on a
reply without tool calls or on a full context. Only the program's process is gone.
"""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack
from typing import Any

import httpx
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null.harness import NullHarness, NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult

# The program's text as verifiers bundles it (its MCP, compaction and chat-loop modules in one
# namespace), defined here without running its entry point: __name__ is not "__main__".
PROGRAM: dict[str, Any] = {"__name__": "verifiers_chat_program"}
exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), PROGRAM)


class NexrlChatConfig(NullHarnessConfig):
    id: str = "nexrl_chat"


class NexrlChat(NullHarness):
    """``null``'s capabilities (MCP tools, a system prompt, chat prompts), without its program."""

    config: NexrlChatConfig

    async def setup(self, runtime: Any) -> None:
        """Nothing to prepare: no script, no ``uv``."""

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        args = argparse.Namespace(  # the program's command line, as launch_chat_program gives it
            api_key=secret,
            model=ctx.model,
            tool_interception_url=tool_interception_url or "",
            bash=False,
            edit=False,
            search=False,
            serper_key="",
        )
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        # the venv's openai (2.x) takes httpx's Timeout; mypy checks against the run's openai 3
        timeout = httpx.Timeout(None, connect=5.0)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, timeout=timeout)  # type: ignore[arg-type]
        tool_client = (
            httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) if tool_interception_url else None
        )
        try:
            async with AsyncExitStack() as stack:
                tools, dispatch, connections = (
                    await PROGRAM["connect_mcp"]({"mcpServers": servers}, stack, set())
                    if servers
                    else ([], {}, {})
                )
                compactor = PROGRAM["Compactor"](client, ctx.model, tools, False, None)
                compactor.note_good(messages)
                await PROGRAM["run_chat_loop"](args, compactor, messages, dispatch, connections, tool_client)
        finally:
            await client.close()
            if tool_client is not None:
                await tool_client.aclose()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["NexrlChat"]
