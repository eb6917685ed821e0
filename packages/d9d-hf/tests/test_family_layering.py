"""The layering of d9d.hf: the core imports no family, and only the dispatch module names them all."""

from __future__ import annotations

import re
from pathlib import Path

import d9d.hf

SOURCE = Path(d9d.hf.__file__).parent
FAMILIES = ("qwen3", "llama", "qwen2")
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
            if (family, path.name) == ("qwen3", "__init__.py"):
                # d9d.hf.qwen3.Qwen3ModelProvider, the provider's earlier name, resolved on first use
                imported -= {"_provider"}
            assert imported <= allowed, f"{family}/{path.name}"
