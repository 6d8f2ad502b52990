"""A calculator tool: arithmetic on numbers by walking the AST, never by ``eval``.

Only number literals, + - * / // % ** and unary +/- are allowed; everything else (names, calls,
attributes, strings) is an error that names the expression. Sizes are bounded so ``9**9**9``
cannot hang a rollout worker.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from nexrl_hpc.agents.tools.base import Tool, ToolOutput
from nexrl_hpc.agents.tools.registry import register_tool

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _format(value: int | float) -> str:
    """Integers as integers (``6/3`` -> ``2``): what a tiny model can copy into its answer."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def evaluate(expression: str, max_length: int = 200, max_exponent: int = 64, max_abs: float = 1e30) -> str:
    """The value of ``expression`` as text; raises CalculatorError naming the expression."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters: {expression[:40]!r}...")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _format(_Evaluator(expression, max_exponent, max_abs).walk(tree))


class _Evaluator:
    """Walks a parsed expression: numbers and the operators of ``_UNARY`` / ``_BINARY`` only."""

    def __init__(self, expression: str, max_exponent: int, max_abs: float) -> None:
        self.expression = expression
        self.max_exponent = max_exponent
        self.max_abs = max_abs

    def walk(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return self.walk(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and type(node.value) is not bool
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._binary(node)
        what = type(node).__name__
        if isinstance(node, ast.Name):
            what = f"name {node.id!r}"
        elif isinstance(node, ast.Constant):
            what = f"{type(node.value).__name__} literal"
        raise CalculatorError(
            f"{what} is not allowed in {self.expression!r}; only numbers and + - * / // % **"
        )

    def _binary(self, node: ast.BinOp) -> int | float:
        expression = self.expression
        left, right = self.walk(node.left), self.walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
            raise CalculatorError(f"exponent {right} too large in {expression!r} (limit {self.max_exponent})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError(f"division by zero in {expression!r}") from None
        except OverflowError:
            raise CalculatorError(f"overflow in {expression!r}") from None
        if isinstance(value, complex):
            raise CalculatorError(f"complex result in {expression!r}")
        if abs(value) > self.max_abs or (isinstance(value, float) and not math.isfinite(value)):
            raise CalculatorError(f"result out of range (|x| > {self.max_abs:g}) in {expression!r}")
        return value


@register_tool("calculator")
class CalculatorTool(Tool):
    """Exact integer / float arithmetic for math tasks."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*12"}},
        "required": ["expression"],
    }

    def forward(self, expression: str) -> ToolOutput:  # type: ignore[override]
        try:
            return ToolOutput(self.name, output=evaluate(str(expression)))
        except CalculatorError as exc:
            return ToolOutput(self.name, error=str(exc))
