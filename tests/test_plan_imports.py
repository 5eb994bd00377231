"""The planning package's modules import each other without a cycle (every import counts: module
level, inside functions and under TYPE_CHECKING), and never import torch or the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import datapipe.plan

PLAN_DIR = Path(datapipe.plan.__file__).resolve().parent
PACKAGE = "datapipe.plan"


def imported_modules(path: Path) -> set[str]:
    """Every module name an `import` / `from ... import` statement anywhere in the file names
    (for `from pkg import name`, also `pkg.name`, which may be a submodule)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def plan_graph() -> dict[str, set[str]]:
    """Module -> the modules of datapipe.plan it imports."""
    modules = {p.stem: p for p in PLAN_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for mod in imported_modules(path):
            parts = mod.split(".")
            if parts[:2] == ["datapipe", "plan"] and len(parts) > 2 and parts[2] in modules:
                deps.add(parts[2])
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_cycles() -> None:
    """The checker itself: a cycle through three modules and a self-free acyclic graph."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_plan_package_has_no_import_cycle() -> None:
    graph = plan_graph()
    assert {"planner", "config", "hdp", "static"} <= graph.keys()
    assert "config" in graph["hdp"] and "hdp" in graph["planner"]  # the graph sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_plan_package_imports_neither_torch_nor_trainer() -> None:
    for path in PLAN_DIR.glob("*.py"):
        roots = {m.split(".")[0] for m in imported_modules(path)}
        assert not roots & {"torch", "trainer"}, path.name
