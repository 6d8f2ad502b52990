"""Tools: the calculator never evaluates code, MultiTool turns every mistake into an error output."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nexrl_hpc.agents.sandbox import SandboxLimits
from nexrl_hpc.agents.tools import (
    TOOL_REGISTRY,
    CalculatorTool,
    MultiTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolOutput,
)
from nexrl_hpc.agents.tools.calculator import CalculatorError, evaluate
from nexrl_hpc.agents.tools.registry import register_tool


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3+4", "7"),
        ("(3+4)*12", "84"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("7//2", "3"),
        ("-7%3", "2"),
        ("2**10", "1024"),
        (" -(2) ", "-2"),
        ("0.1+0.2", "0.30000000000000004"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "Call is not allowed in \"__import__('os').system('true')\""),
        ("x+1", "name 'x' is not allowed in 'x+1'"),
        ("'a'*3", "str literal is not allowed in \"'a'*3\""),
        ("1/0", "division by zero in '1/0'"),
        ("9**9**9", "exponent 387420489 too large in '9**9**9'"),
        ("10**40", "result out of range"),
        ("3+", "cannot parse '3+'"),
        ("True+1", "bool literal is not allowed in 'True+1'"),
        ("(-8)**0.5", "complex result in '(-8)**0.5'"),
    ],
)
def test_calculator_rejects_with_the_expression_named(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert message in str(info.value)


def test_calculator_tool_returns_error_outputs_not_exceptions() -> None:
    calc = CalculatorTool()
    assert calc(expression="2*21") == ToolOutput("calculator", output="42")
    bad = calc(expression="open('/etc/passwd')")
    assert not bad.ok and "open('/etc/passwd')" in (bad.error or "")
    assert bad.to_string().startswith("Error: Call is not allowed")
    missing = calc()
    assert missing.error == "tool 'calculator' is missing required argument(s) ['expression']"
    extra = calc(expression="1", base=2)
    assert extra.error == "tool 'calculator' got unknown argument(s) ['base']; it takes ['expression']"


def test_tool_json_schema_and_function_tools() -> None:
    calc = CalculatorTool()
    assert calc.json == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": calc.description,
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*12"}},
                "required": ["expression"],
            },
        },
    }
    lookup = Tool(
        name="lookup",
        description="capital of a country",
        function=lambda country: {"fr": "paris"}[country],
        parameters={"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
    )
    assert lookup(country="fr").output == "paris"
    failed = lookup(country="xx")
    assert failed.error == "tool 'lookup' failed: KeyError: 'xx'"
    assert asyncio.run(lookup.acall(country="fr")).output == "paris"


def test_multitool_registry_and_unknown_tools() -> None:
    assert {"calculator", "python"} <= set(TOOL_REGISTRY)
    tools = MultiTool(tools=["calculator"], tool_map={"echo": Tool(function=lambda text: text)})
    assert tools.names == ["calculator", "echo"]
    assert [j["function"]["name"] for j in tools.json] == ["calculator", "echo"]
    assert tools("calculator", expression="1+1").output == "2"
    assert tools("echo", text="hi").output == "hi"
    unknown = tools("search", query="x")
    assert unknown.name == "search"
    assert unknown.error == "unknown tool 'search'; available: ['calculator', 'echo']"
    assert asyncio.run(tools.acall("nope")).error == "unknown tool 'nope'; available: ['calculator', 'echo']"
    out = tools.execute(ToolCall("calculator", {"expression": "6*7"}, id="call_3"))
    assert (out.output, out.metadata["tool_call_id"]) == ("42", "call_3")
    with pytest.raises(KeyError, match="unknown tool 'search'; registered: "):
        MultiTool(tools=["search"])


def test_register_tool_refuses_a_taken_name() -> None:
    class Other(Tool):
        pass

    with pytest.raises(ValueError, match="tool name 'calculator' is already registered to CalculatorTool"):
        register_tool("calculator")(Other)

    @register_tool("test_only_upper")
    class Upper(Tool):
        parameters: dict[str, Any] = {"type": "object", "properties": {"s": {}}, "required": ["s"]}

        def forward(self, s: str) -> ToolOutput:  # type: ignore[override]
            return ToolOutput(self.name, output=s.upper())

    try:
        assert MultiTool(tools=["test_only_upper"])("test_only_upper", s="ab").output == "AB"
    finally:
        del TOOL_REGISTRY["test_only_upper"]


def test_python_tool_runs_in_the_sandbox() -> None:
    tool = PythonTool(limits=SandboxLimits(wall_time_s=10.0, memory_mb=256), max_output_chars=10)
    ok = tool(code="print(sum(range(10)))")
    assert ok.ok and ok.output == "45\n" and ok.metadata["status"] == "ok"
    long = tool(code="print('y' * 100)")
    assert long.output == "y" * 10
    loop = PythonTool(limits=SandboxLimits(wall_time_s=1.5, cpu_time_s=10))(code="while True: pass")
    assert loop.error == "python killed after the wall-time limit"
    crash = tool(code="1/0")
    assert crash.error == "python exited with code 1: ZeroDivisionError: division by zero"
    net = tool(code="import socket; socket.create_connection(('151.101.0.223', 443), timeout=2)")
    assert net.error is not None and "Network is unreachable" in net.error
