"""The tool registry: tools by name, so configs and MultiTool can say ``tools: [calculator, python]``."""

from __future__ import annotations

from collections.abc import Callable

from nexrl_hpc.agents.tools.base import Tool

TOOL_REGISTRY: dict[str, type[Tool]] = {}


def register_tool(name: str) -> Callable[[type[Tool]], type[Tool]]:
    """Class decorator; registering a different class under a taken name is an error naming both."""

    def decorator(cls: type[Tool]) -> type[Tool]:
        existing = TOOL_REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"tool name {name!r} is already registered to {existing.__qualname__}")
        TOOL_REGISTRY[name] = cls
        return cls

    return decorator


def get_tool_class(name: str) -> type[Tool]:
    if name not in TOOL_REGISTRY:
        raise KeyError(f"unknown tool {name!r}; registered: {sorted(TOOL_REGISTRY)}")
    return TOOL_REGISTRY[name]
