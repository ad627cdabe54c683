"""The project's module import graph, read from the source with ``ast`` (nothing imported).

Every ``import`` and ``from ... import`` counts, at module level and inside functions
alike (a function-level import is still a dependency, only a later one), relative ones
resolved; those under ``if TYPE_CHECKING:`` do not (they never run). An edge goes to the
most specific project module named: ``from kvpilot.engine.core import scheduler`` is an
edge to ``kvpilot.engine.core.scheduler``, ``from kvpilot.engine import LLM`` one to
``kvpilot.engine``; parent packages run by an import are not edges of their own.
"""

from __future__ import annotations

import ast
from collections import deque
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> import name (setup.py's FOLDERS)
FOLDERS = {"engine": "kvpilot.engine", "kernels": "kvpilot.kernels", "operator": "kvpilot.operator",
           "contract": "kvpilot.contract"}


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the project's folders."""
    modules = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([name, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import node outside ``if TYPE_CHECKING:`` bodies."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    targets = set()
    for name in names:
        while name and name not in known:      # ``import a.b.c`` of a non-module attribute path
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (itself excluded)."""
    modules = project_modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            edges |= _targets(node, module, is_package, known)
        edges.discard(module)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest import path from ``start`` back to itself inside ``within``."""
    parents: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & within):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return []


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """One shortest cycle through each module of each strongly connected component,
    duplicates dropped: every module caught in a cycle appears in one listed here."""
    graph = import_graph() if graph is None else graph
    listed, seen = [], set()
    for component in strongly_connected(graph):
        members = set(component)
        for module in component:
            cycle = shortest_cycle(graph, module, members)
            key = frozenset(pairwise(cycle))
            if key not in seen:
                seen.add(key)
                listed.append(cycle)
    return listed
