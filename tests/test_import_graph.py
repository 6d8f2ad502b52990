"""No import circle between the files of ``nexrl_hpc``.

The graph is built from the source with ``ast``, file by file: every ``import``/``from`` statement
counts, at module level and inside functions alike (an import deferred into a function is still an
arrow between the two files), except those under ``if TYPE_CHECKING:`` (never executed: they exist
for the type checker). ``from pkg import name`` points at ``pkg/name.py`` when that file exists,
otherwise at ``pkg/__init__.py``; the implicit import of a module's parent packages is not an arrow.
A circle is a strongly connected component of more than one file (or a file importing itself).

The same graph with folders as nodes (each top-level file of the package, e.g. ``controller.py``,
its own node) is checked against the declared layering ``LAYERS``: an import from a lower floor
to a higher one runs against it. ``config/`` is the ground floor and imports no other folder.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "nexrl_hpc"
ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    "config",
    "types",
    "core",
    "rpc",
    "runtime",
    "checkpoint",
    "models",
    "tracking",
    "data",
    "rewards",
    "agents",
    "hub",
    "tasks",
    "weight_sync",
    "scheduler",
    "inference",
    "scoring",
    "pool",
    "algorithm",
    "trainer",
    "validate",
    "rollout",
    "run_health",
    "assembly",
    "reference_step",
    "membership",
    "controller",
    "launcher",
    "api",
    "__init__",
]
"""The floors of the package, bottom to top: a folder (or top-level file) imports only from the
floors below it. ``assembly`` composes the rooms (their config checks, the role registry) for the
controller; the launcher starts the controller; ``__init__`` is the package's own ``__init__.py``."""

MAX_IMPORTS_AGAINST_LAYERS = 5


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in files)
                continue
            base = _resolve_base(module, is_package, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in files:
                    targets.add(f"{base}.{alias.name}")
                elif base in files:
                    targets.add(base)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: strongly connected components of more than one module, or a module that
    imports itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(frozenset(component))
    return found


def _package_cycles() -> list[frozenset[str]]:
    return cycles(import_graph(module_files()))


def test_the_graph_sees_module_and_function_level_imports() -> None:
    files = module_files()
    graph = import_graph(files)
    # a module-level import, one inside a function (the factories import on demand), and one only
    # for the type checker (not an arrow)
    assert "nexrl_hpc.trainer.parallel" in graph["nexrl_hpc.trainer.policy_trainer"]
    assert "nexrl_hpc.trainer.deepspeed_strategy" in graph["nexrl_hpc.trainer.strategy_factory"]
    assert "nexrl_hpc.trainer.policy_trainer" in graph["nexrl_hpc.trainer.factory"]
    assert "nexrl_hpc.trainer.parallel" not in graph["nexrl_hpc.trainer.loss_sums"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"a"}, "b": set()}) == [frozenset({"a"})]


def test_no_import_circle_in_the_package() -> None:
    assert [sorted(c) for c in _package_cycles()] == []


def test_no_file_of_the_package_is_over_500_lines() -> None:
    """Small modules with one job each: a file that grows past 500 lines is split by what it does."""
    long = {
        name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long


def floor(module: str) -> str:
    """The node of ``module`` in the folder graph: its folder under the package, or the stem of a
    top-level file (``__init__`` for the package's own ``__init__.py``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def imports_against_layers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import from a floor of ``LAYERS`` to a higher one."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted((a, b) for a, targets in graph.items() for b in targets if rank[floor(a)] < rank[floor(b)])


def test_every_folder_has_its_floor() -> None:
    files = module_files()
    assert {floor(m) for m in files} - set(LAYERS) == set(), "add the new folder to LAYERS"


def test_few_imports_run_against_the_layering() -> None:
    files = module_files()
    against = imports_against_layers(import_graph(files))
    assert len(against) <= MAX_IMPORTS_AGAINST_LAYERS, "imports against LAYERS:\n" + "\n".join(
        f"  {a} ({floor(a)}) -> {b} ({floor(b)})" for a, b in against
    )


def test_config_imports_no_other_folder() -> None:
    files = module_files()
    graph = import_graph(files)
    outside = sorted(
        (a, b)
        for a, targets in graph.items()
        if floor(a) == "config"
        for b in targets
        if floor(b) != "config"
    )
    assert outside == []


def test_the_schema_imports_alone() -> None:
    """A fresh interpreter that imports the schema loads no module of another folder of the package."""
    code = (
        "import json, sys, nexrl_hpc.config.schema; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'nexrl_hpc')))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    assert "nexrl_hpc.config.schema" in loaded
    assert [m for m in loaded if m != "nexrl_hpc" and not m.startswith("nexrl_hpc.config")] == []
