"""Importing d9d.parallel compiles nothing: every process that imports it (a CPU job, a tool, each
rank of a launch) would otherwise pay for loading Inductor before it runs a single op."""

from __future__ import annotations

import subprocess
import sys

_PROBE = "import sys, d9d.parallel; print('torch._inductor.compile_fx' in sys.modules)"


def test_importing_d9d_parallel_loads_no_inductor_compiler() -> None:
    # A fresh interpreter: this test process has long imported everything. The FP8 expert casts
    # called torch.compile at import, which loads Inductor's compiler (seconds per process).
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False", "importing d9d.parallel loaded torch._inductor.compile_fx"
