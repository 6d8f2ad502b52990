"""MultiTool: dispatch a call to one of several tools by name."""

from __future__ import annotations

from typing import Any

from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.registry import get_tool_class
from nexrl_hpc.agents.types import ToolCall


class MultiTool:
    """Tools from the registry by name (``tools=[...]``) and/or given instances or classes (``tool_map``).

    Keys of ``tool_map`` become the tools' names. An unknown tool name at construction is a configuration error (raised); an unknown name in a
    model's call is the model's mistake and comes back as an error ToolOutput naming the tool.
    """

    def __init__(
        self, tools: list[str] | None = None, tool_map: dict[str, Tool | type[Tool]] | None = None
    ) -> None:
        self.tools: dict[str, Tool] = {}
        for name in tools or []:
            self.tools[name] = get_tool_class(name)(name=name)
        for name, tool in (tool_map or {}).items():
            instance = tool(name=name) if isinstance(tool, type) else tool
            instance.name = name  # the key is the name the model calls it by
            self.tools[name] = instance

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    @property
    def json(self) -> list[dict[str, Any]]:
        return [tool.json for tool in self.tools.values()]

    def _unknown(self, tool_name: str) -> ToolOutput:
        return ToolOutput(tool_name, error=f"unknown tool {tool_name!r}; available: {sorted(self.tools)}")

    def __call__(self, tool_name: str, **kwargs: Any) -> ToolOutput:
        tool = self.tools.get(tool_name)
        return self._unknown(tool_name) if tool is None else tool(**kwargs)

    async def acall(self, tool_name: str, **kwargs: Any) -> ToolOutput:
        tool = self.tools.get(tool_name)
        return self._unknown(tool_name) if tool is None else await tool.acall(**kwargs)

    def execute(self, call: ToolCall) -> ToolOutput:
        """Run a parsed call; the output carries the call id so the env can answer in the OpenAI shape."""
        output = self(call.name, **call.arguments)
        if call.id is not None:
            output.metadata.setdefault("tool_call_id", call.id)
        return output
