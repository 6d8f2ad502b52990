"""A python tool: run model-written code in the sandbox and show it what the code printed."""

from __future__ import annotations

from nexrl_hpc.agents.sandbox import SandboxLimits, run_python
from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.registry import register_tool


@register_tool("python")
class PythonTool(Tool):
    """stdout on success; on failure an error with the sandbox's reason and the last stderr line."""

    name = "python"
    description = (
        "Run Python 3 code in a sandbox (no network, limited time and memory); returns what it prints."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete program; print the result"}},
        "required": ["code"],
    }

    def __init__(
        self,
        name: str | None = None,
        description: str | None = None,
        limits: SandboxLimits | None = None,
        max_output_chars: int = 2000,
    ) -> None:
        super().__init__(name=name, description=description)
        self.limits = limits  # None: the run's (rollout_worker.sandbox), read at each call
        self.max_output_chars = max_output_chars

    def forward(self, code: str) -> ToolOutput:  # type: ignore[override]
        result = run_python(str(code), "", self.limits)
        metadata = {"status": result.status, "wall_time_s": round(result.wall_time_s, 3)}
        if not result.ok:
            return ToolOutput(self.name, error=f"python {result.error_message()}", metadata=metadata)
        return ToolOutput(self.name, output=result.stdout[: self.max_output_chars], metadata=metadata)
