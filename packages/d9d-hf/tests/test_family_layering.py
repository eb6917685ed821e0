"""The layering of d9d.hf: the core imports no family, and only the dispatch module names them all."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import d9d.hf

SOURCE = Path(d9d.hf.__file__).parent
FAMILIES = ("qwen3", "llama", "qwen2", "mistral", "granite", "olmo2", "phi3", "gemma3")
_IMPORT = re.compile(r"^\s*(?:from|import)\s+d9d\.hf\.(\w+)", re.MULTILINE)


def _imported_subpackages(path: Path) -> set[str]:
    return set(_IMPORT.findall(path.read_text()))


def test_the_core_imports_no_family() -> None:
    for path in (SOURCE / "_decoder").glob("*.py"):
        assert not _imported_subpackages(path) & set(FAMILIES), path.name


def test_only_the_dispatch_module_and_the_package_import_families() -> None:
    importers = {
        path.relative_to(SOURCE).as_posix()
        for path in SOURCE.rglob("*.py")
        for family in FAMILIES
        if family in _imported_subpackages(path) and path.parent.name != family
    }
    assert importers == {"_families.py", "__init__.py"}


def test_a_family_imports_no_other_family_nor_the_shared_layer() -> None:
    allowed = {"_decoder", "_head", "_rope_parameters"}
    for family in FAMILIES:
        for path in (SOURCE / family).glob("*.py"):
            imported = _imported_subpackages(path) - {family}
            assert imported <= allowed, f"{family}/{path.name}"


def _module_name(path: Path) -> str:
    parts = ("d9d", "hf", *path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    nodes: list[ast.AST] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """The d9d.hf modules ``path`` imports when it runs: at module level or inside a function.

    ``from d9d.hf.x import y`` names ``d9d.hf.x.y`` when that is a module, else ``d9d.hf.x``.
    """
    imported: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("d9d.hf"):
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names if alias.name.startswith("d9d.hf"))
    return imported & modules


def test_no_import_circle() -> None:
    """No d9d.hf module imports one that imports it back, directly or through others."""
    paths = {_module_name(path): path for path in SOURCE.rglob("*.py")}
    graph = {name: _imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert circles == [], "\n".join(" -> ".join(circle) for circle in circles)
