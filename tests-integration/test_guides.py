"""Every guide's code runs: each ```python block of a guide is marked runnable or illustrative.

A block preceded by ``<!-- runnable -->`` is executed; the runnable blocks of one guide run in
order as one script (later blocks may use names from earlier ones), in a Python process of its own
on CPU, from an empty working directory: forked from a plain interpreter that has only imported
torch (see guide_runner.py), so each guide does not pay that import again. A block that cannot run
here (it needs GPUs, torchrun or a download) is preceded by ``<!-- illustrative: <why> -->``
instead, so no block is skipped silently.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
RUNNER = Path(__file__).resolve().parent / "guide_runner.py"
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


def test_blocks_are_found_with_their_markers() -> None:
    text = (
        "<!-- runnable -->\n```python\nx = 1\n```\n\n"
        "<!-- illustrative: needs GPUs -->\n```python\ny = 2\n```\n\n"
        "```bash\nls\n```\n"
    )
    assert runnable_blocks(text) == ["x = 1\n"]
    with pytest.raises(ValueError, match="z = 3"):
        runnable_blocks("```python\nz = 3\n```\n")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """guide_runner.py in a plain interpreter, started once for every guide."""
    # As a reader runs a guide: without the d9d pytest plugin's zygote variable, run_distributed
    # forks ranks from the script itself.
    env = {k: v for k, v in os.environ.items() if k != "D9D_TESTING_ZYGOTE"}
    process = subprocess.Popen(
        [sys.executable, str(RUNNER)],
        cwd=tmp_path_factory.mktemp("runner"),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a guide that hangs: its whole process group is ended
    )
    yield process
    assert process.stdin is not None
    process.stdin.close()
    process.wait(timeout=60)


def _run_guide(runner: subprocess.Popen[str], script: Path, timeout_s: float) -> tuple[int, str, str]:
    assert runner.stdin is not None and runner.stdout is not None
    stdout, stderr = script.with_suffix(".out"), script.with_suffix(".err")
    request = {"script": str(script), "stdout": str(stdout), "stderr": str(stderr)}
    runner.stdin.write(json.dumps(request) + "\n")
    runner.stdin.flush()
    ready, _, _ = select.select([runner.stdout], [], [], timeout_s)
    if not ready:
        os.killpg(runner.pid, signal.SIGKILL)
        raise AssertionError(f"{script} did not finish within {timeout_s:.0f} s")
    line = runner.stdout.readline()
    assert line, f"the guide runner ended (status {runner.poll()})"
    return json.loads(line)["returncode"], stdout.read_text(), stderr.read_text()


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_code_runs(guide: str, tmp_path: Path, runner: subprocess.Popen[str]) -> None:
    blocks = runnable_blocks((DOCS / guide).read_text())
    assert blocks, f"{guide} has no runnable block"
    script = tmp_path / "guide.py"
    script.write_text("\n\n".join(blocks))
    returncode, stdout, stderr = _run_guide(runner, script, timeout_s=240)
    assert returncode == 0, f"{guide}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
