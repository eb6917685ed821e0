"""No import cycle between d9d-pipeline's modules, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[1] / "src" / "d9d" / "pipeline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(_SOURCE.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("d9d.pipeline"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("d9d.pipeline"))
    return found


def test_no_import_cycles() -> None:
    graph = {_module_name(p): _imports(p) for p in _SOURCE.rglob("*.py") if p.name != "__init__.py"}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in trail:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt in graph:
                visit(nxt, [*trail, nxt])

    for module in sorted(graph):
        visit(module, [module])
    assert not cycles, f"import cycles: {cycles[:3]}"
