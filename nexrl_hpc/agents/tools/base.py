"""Tool and ToolOutput: a named function the model can call, described by a JSON schema."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolOutput:
    """A tool's result or its error; an error is an observation for the model, never an exception."""

    name: str
    output: Any = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_string(self) -> str:
        """What the model sees."""
        if self.error is not None:
            return f"Error: {self.error}"
        return "" if self.output is None else str(self.output)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "output": self.output,
            "error": self.error,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolOutput:
        return cls(data["name"], data.get("output"), data.get("error"), dict(data.get("metadata") or {}))


class Tool:
    """Subclass and implement ``forward`` (or ``async_forward``), or pass ``function``.

    ``parameters`` is the JSON schema of the keyword arguments; ``json`` is the OpenAI function
    description a chat template or a system prompt lists. ``__call__`` checks the arguments against
    the schema's required/known names and turns any exception into an error output, so a bad call
    costs the model a turn, not the episode.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    def __init__(
        self,
        name: str | None = None,
        description: str | None = None,
        function: Callable[..., Any] | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self.name = name or self.name or type(self).__name__
        self.description = description if description is not None else self.description
        if parameters is not None:
            self.parameters = parameters
        self.function = function

    @property
    def json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def primary_argument(self) -> str | None:
        """The argument a bare-text call (``<calc>3+4</calc>``) fills: the first required one."""
        required = self.parameters.get("required") or []
        return required[0] if required else None

    def forward(self, **kwargs: Any) -> ToolOutput:
        if self.function is None:
            raise NotImplementedError(f"tool {self.name!r} implements neither forward nor function")
        return ToolOutput(self.name, output=self.function(**kwargs))

    async def async_forward(self, **kwargs: Any) -> ToolOutput:
        """Default: ``forward`` in a worker thread, so slow tools do not block the event loop."""
        return await asyncio.to_thread(self.forward, **kwargs)

    def check_arguments(self, kwargs: dict[str, Any]) -> str | None:
        """An error message naming the tool and the argument, or None when the call fits the schema."""
        props = self.parameters.get("properties") or {}
        missing = [k for k in self.parameters.get("required") or [] if k not in kwargs]
        if missing:
            return f"tool {self.name!r} is missing required argument(s) {missing}"
        unknown = sorted(k for k in kwargs if k not in props)
        if unknown and props:
            return f"tool {self.name!r} got unknown argument(s) {unknown}; it takes {sorted(props)}"
        return None

    def __call__(self, **kwargs: Any) -> ToolOutput:
        error = self.check_arguments(kwargs)
        if error is not None:
            return ToolOutput(self.name, error=error)
        try:
            return self.forward(**kwargs)
        except Exception as exc:  # a tool bug must not end the episode
            return ToolOutput(self.name, error=f"tool {self.name!r} failed: {type(exc).__name__}: {exc}")

    async def acall(self, **kwargs: Any) -> ToolOutput:
        error = self.check_arguments(kwargs)
        if error is not None:
            return ToolOutput(self.name, error=error)
        try:
            return await self.async_forward(**kwargs)
        except Exception as exc:
            return ToolOutput(self.name, error=f"tool {self.name!r} failed: {type(exc).__name__}: {exc}")
