"""The tests' process of an assert-style code test: what runs the solution, then the tests.

This file's source is shipped into the sandbox and run there in a namespace of its own whose
builtins are a copy taken before the solution runs (``runner.py`` in ``code.py``), so nothing the
solution rebinds (``builtins.exec``, ``builtins.compile``, ``type``, ``len``...) reaches it. Why each
step:

* the tests are parsed and compiled, and the functions the harness needs bound, before the
  solution's code runs: a solution that replaces ``exec`` or ``compile`` replaces them for itself;
* the tests run in a fresh namespace: the solution's definitions (not its dunders, and not a name
  that shadows a builtin, e.g. ``abs = lambda x: 0``) with a copy of the builtins from before;
* the comparisons of an ``assert`` are type-strict (``strict_asserts`` rewrites them into calls of
  ``compare``): an object whose ``__eq__`` always answers True no longer equals an ``int``; numbers
  of the built-in types (bool, int, float, complex) compare by value as Python does.

Out of reach of any of this: a solution that walks the interpreter's frames or objects to the harness
itself, or leaves a thread or a hook running into the tests, targets the harness (code.py's module
docstring: what the verdict's protocol still checks).
"""

from __future__ import annotations

import ast
from typing import Any

COMPARE_NAME = "__nexrl_compare__"  # the name the rewritten asserts call ``compare`` by

_NUMBERS = (bool, int, float, complex)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_OPS: dict[type[ast.cmpop], str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
}


def _one_of(kind: type, kinds: tuple[type, ...]) -> bool:
    """``kind`` is exactly one of ``kinds`` (by identity: a metaclass's ``__eq__`` is not asked)."""
    return any(kind is k for k in kinds)


def _plain(value: Any) -> bool:
    """A value whose ``==`` is Python's own: built-in scalars and tuples/frozensets of them."""
    kind = type(value)
    if _one_of(kind, _SCALARS):
        return True
    if kind is tuple or kind is frozenset:
        return all(_plain(item) for item in value)
    return False


def strict_equal(a: Any, b: Any) -> bool:
    """``a == b`` where both are of the same type (numbers: any built-in numeric type), containers
    compared item by item the same way; ``False`` for values of different types."""
    kind = type(a)
    if _one_of(kind, _NUMBERS) and _one_of(type(b), _NUMBERS):
        return bool(a == b)
    if kind is not type(b):
        return False
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    if kind is dict:
        plain_a, plain_b = all(_plain(k) for k in a), all(_plain(k) for k in b)
        if plain_a and plain_b:
            return a.keys() == b.keys() and all(strict_equal(value, b[key]) for key, value in a.items())
        return plain_a is plain_b and bool(a == b)
    if kind is set or kind is frozenset:
        plain_a, plain_b = all(_plain(x) for x in a), all(_plain(x) for x in b)
        return plain_a is plain_b and bool(a == b)
    return bool(a == b)


def _holds(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        return strict_equal(a, b)
    if op == "!=":
        return not strict_equal(a, b)
    if op == "in" or op == "not in":
        kind = type(b)
        if kind is list or kind is tuple or kind is set or kind is frozenset or kind is dict:
            found = any(strict_equal(a, item) for item in b)
        elif kind is str or kind is bytes:
            found = type(a) is kind and a in b
        else:
            found = a in b  # another container decides for itself
        return found if op == "in" else not found
    if not (_one_of(type(a), _NUMBERS) and _one_of(type(b), _NUMBERS)) and type(a) is not type(b):
        return False  # an ordering across types: only numbers
    if op == "<":
        return bool(a < b)
    if op == "<=":
        return bool(a <= b)
    if op == ">":
        return bool(a > b)
    return bool(a >= b)


def compare(ops: tuple[str, ...], left: Any, *rights: Any) -> bool:
    """A chained comparison ``left op0 rights[0] op1 rights[1] ...``, each link type-strict."""
    for op, right in zip(ops, rights):
        if not _holds(op, left, right):
            return False
        left = right
    return True


class _StrictComparisons(ast.NodeTransformer):
    """Every comparison (==, !=, <, <=, >, >=, in, not in) becomes a ``compare`` call."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        ops = [_OPS.get(type(op)) for op in node.ops]
        if any(op is None for op in ops):
            return node  # ``is``/``is not`` in the chain: identity is already strict
        names = ast.Tuple([ast.Constant(op) for op in ops], ast.Load())
        call = ast.Call(ast.Name(COMPARE_NAME, ast.Load()), [names, node.left, *node.comparators], [])
        return ast.copy_location(call, node)


class _StrictAsserts(ast.NodeTransformer):
    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        node.test = _StrictComparisons().visit(node.test)
        return node


def strict_asserts(source: str, filename: str) -> ast.Module:
    """``source`` parsed, the comparisons inside its ``assert`` statements made type-strict."""
    tree = _StrictAsserts().visit(ast.parse(source, filename))
    return ast.fix_missing_locations(tree)


def _read(name: str) -> str:
    with open(name) as f:
        return f.read()


def main(down: int, up: int) -> None:
    """Run solution.py, tell the supervisor (``L``), read its nonce, run tests.py, send it back."""
    import builtins
    import os
    import sys
    import traceback

    write, read, exit_now, print_exc = os.write, os.read, os._exit, traceback.print_exc
    settrace, setprofile, stderr = sys.settrace, sys.setprofile, sys.stderr
    own = globals()["__builtins__"]  # in the sandbox: this namespace's copy, taken before the solution ran
    before = dict(own if isinstance(own, dict) else vars(own))

    def run(code: Any, scope: dict[str, Any], name: str) -> None:
        try:
            exec(code, scope)
        except SystemExit as exc:
            print(f"{name} exited (SystemExit({exc.code!r})) before the tests finished", file=stderr)
            exit_now(1)
        except BaseException:
            print_exc()
            exit_now(1)

    tests = compile(strict_asserts(_read("tests.py"), "tests.py"), "tests.py", "exec")
    solution = compile(_read("solution.py"), "solution.py", "exec")
    solution_scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    run(solution, solution_scope, "solution.py")
    write(up, b"L")
    nonce = read(down, 64)
    settrace(None)
    setprofile(None)
    scope: dict[str, Any] = {
        name: value
        for name, value in solution_scope.items()
        if type(name) is str and not name.startswith("__") and name not in before
    }
    scope.update({"__name__": "__main__", "__builtins__": dict(before), COMPARE_NAME: compare})
    run(tests, scope, "tests.py")
    write(up, b"P" + nonce)
    exit_now(0)
