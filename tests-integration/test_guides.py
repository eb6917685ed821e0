"""Every guide's code runs: each ```python block of a guide is marked runnable or illustrative.

A block preceded by ``<!-- runnable -->`` is executed; the runnable blocks of one guide run in
order as one script (later blocks may use names from earlier ones), in a Python process of its own
on CPU, from an empty working directory: forked from a plain interpreter that has imported torch
and the d9d modules the guides import (see script_runner.py), so each guide does not pay those
imports again (its own import lines still run and bind the names). A block that cannot run
here (it needs GPUs, torchrun or a download) is preceded by ``<!-- illustrative: <why> -->``
instead, so no block is skipped silently.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from script_runner import run_script

DOCS = Path(__file__).resolve().parents[1] / "docs"
GUIDES = [
    "installation.md",
    "writing-a-model.md",
    "extending.md",
    "choosing-parallelism.md",
    "adding-a-model-family.md",
    "model-heads.md",
    "model-design.md",
]
_BLOCK = re.compile(r"^(?P<marker><!-- [^\n]*-->\n)?```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def runnable_blocks(markdown: str) -> list[str]:
    """The code of the guide's runnable blocks; raises when a python block carries no marker."""
    blocks: list[str] = []
    for match in _BLOCK.finditer(markdown):
        marker = (match["marker"] or "").strip()
        if marker == "<!-- runnable -->":
            blocks.append(match["code"])
        elif not re.fullmatch(r"<!-- illustrative: .+ -->", marker):
            first_line = match["code"].splitlines()[0] if match["code"] else ""
            raise ValueError(f"python block starting {first_line!r} is neither runnable nor illustrative")
    return blocks


def d9d_imports(code: str) -> tuple[str, ...]:
    """The d9d modules a script imports (absolute imports only), for the runner to import once."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module)
    return tuple(sorted(name for name in names if name.split(".")[0] == "d9d"))


def test_d9d_imports_lists_the_d9d_modules_a_script_imports() -> None:
    code = "import os\nimport d9d.loop\nfrom d9d.mesh.testing import run_distributed\nfrom . import x\n"
    assert d9d_imports(code) == ("d9d.loop", "d9d.mesh.testing")


def test_blocks_are_found_with_their_markers() -> None:
    text = (
        "<!-- runnable -->\n```python\nx = 1\n```\n\n"
        "<!-- illustrative: needs GPUs -->\n```python\ny = 2\n```\n\n"
        "```bash\nls\n```\n"
    )
    assert runnable_blocks(text) == ["x = 1\n"]
    with pytest.raises(ValueError, match="z = 3"):
        runnable_blocks("```python\nz = 3\n```\n")


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_code_runs(guide: str, tmp_path: Path, torch_runner: subprocess.Popen[str]) -> None:
    blocks = runnable_blocks((DOCS / guide).read_text())
    assert blocks, f"{guide} has no runnable block"
    script = tmp_path / "guide.py"
    code = "\n\n".join(blocks)
    script.write_text(code)
    # As a reader runs the guide: a plain Python process from an empty directory (see script_runner);
    # the d9d modules it imports are imported once in the runner, not once per guide.
    result = run_script(torch_runner, script, cwd=tmp_path, timeout_s=240, preload=d9d_imports(code))
    assert result.returncode == 0, f"{guide}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
