"""A collective that times out ends the job promptly: NCCL's settings (unit) and a gloo job (torchrun)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from d9d.mesh import NCCL_ENVIRONMENT_DEFAULTS, apply_nccl_defaults

JOB = Path(__file__).resolve().parent / "collective_timeout_job.py"
DUMP_WAIT = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def test_defaults_tear_down_and_shorten_the_watchdogs_wait() -> None:
    environ: dict[str, str] = {}

    applied = apply_nccl_defaults(environ)

    assert environ == applied == {ERROR_HANDLING: "1", DUMP_WAIT: NCCL_ENVIRONMENT_DEFAULTS[DUMP_WAIT]}
    # torch's watchdog sleeps 4x the dump wait between catching a timeout and ending the process:
    # 60 s at torch's own default (15 000 ms); d9d's default keeps that within 5 s.
    assert 4 * int(environ[DUMP_WAIT]) <= 5_000


def test_a_users_values_win() -> None:
    environ = {DUMP_WAIT: "30000", ERROR_HANDLING: "3", "OTHER": "x"}

    applied = apply_nccl_defaults(environ)

    assert applied == {}
    assert environ == {DUMP_WAIT: "30000", ERROR_HANDLING: "3", "OTHER": "x"}


def test_a_collective_one_rank_skips_ends_the_job_through_the_timeout() -> None:
    # gloo raises in the waiting rank after its 2 s timeout; its exit makes torchrun end the rank
    # that sleeps for an hour. Only the outcome is checked, not how fast the machine got there.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(JOB),
    ]
    # The sleeper sleeps 3600 s: a run that ends within the 600 s below was ended, not waited for.
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    output = result.stdout + result.stderr

    assert result.returncode != 0, output[-3000:]
    assert "JOB rank 0 enters the collective alone" in output
    assert "returned without its peer" not in output
    assert "timed out" in output.lower() or "timeout" in output.lower(), output[-3000:]
