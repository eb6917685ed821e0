"""Runs an example script's ``__main__`` inside the test process, for checks that end before any work.

A fresh interpreter spends seconds importing torch, transformers and d9d before the script reads
its arguments; the test process has them imported already. The script runs as ``python SCRIPT
ARGS`` would run it: as ``__main__``, with ``sys.argv`` set and its own directory first on
``sys.path``. Runs that train still start the script in a fresh process (the example tests do);
one that starts a process group here fails the test. (A group another test left open is caught
before this test starts, by the repository's conftest.)
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch.distributed as dist


def run_script_in_process(script: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit status and stderr of ``python script *args``, run inside this process."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    capsys.readouterr()  # only the script's own output below
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        if dist.is_initialized():  # it got as far as training: leave no process group behind
            dist.destroy_process_group()
            pytest.fail(f"{script.name} started a process group in the test process; expected an early exit")
    return code, capsys.readouterr().err
