"""Tools the agent model can call; importing this registers ``calculator`` and ``python``."""

from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.calculator import CalculatorTool
from nexrl_hpc.agents.tools.multi_tool import MultiTool
from nexrl_hpc.agents.tools.python_tool import PythonTool
from nexrl_hpc.agents.tools.registry import TOOL_REGISTRY, get_tool_class, register_tool
from nexrl_hpc.agents.types import ToolCall

__all__ = [
    "TOOL_REGISTRY",
    "CalculatorTool",
    "MultiTool",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolOutput",
    "get_tool_class",
    "register_tool",
]
