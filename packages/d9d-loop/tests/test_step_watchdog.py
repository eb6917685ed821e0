"""A hung step ends the process with an error naming the step and rank."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

from d9d.loop.observability._step_watchdog import StepWatchdog


def _hang(stderr_path: str, disarm: bool) -> None:
    sys.stderr = open(stderr_path, "w")  # noqa: SIM115 (the process ends with os._exit)
    dog = StepWatchdog(rank=3)
    dog.arm(7, 0.3)
    if disarm:
        dog.disarm()
        dog.arm(8, None)
        time.sleep(1.0)  # a watchdog still armed would fire in here (on a busy machine: maybe later)
        os._exit(0)
    while True:  # hung for good: only the watchdog ends this, however long the machine takes
        time.sleep(1.0)


def _run(tmp_path: Path, *, disarm: bool) -> tuple[int | None, str]:
    stderr_path = tmp_path / "stderr.txt"
    process = multiprocessing.get_context("fork").Process(target=_hang, args=(str(stderr_path), disarm))
    process.start()
    process.join(timeout=240)
    if process.exitcode is None:
        process.kill()
    return process.exitcode, stderr_path.read_text() if stderr_path.exists() else ""


def test_hung_step_exits_with_step_and_rank(tmp_path: Path) -> None:
    code, stderr = _run(tmp_path, disarm=False)
    assert code == 124
    assert "step 7 did not finish within 0 s on rank 3" in stderr
    assert "Stacks of rank 3" in stderr


def test_disarmed_watchdog_stays_quiet(tmp_path: Path) -> None:
    code, stderr = _run(tmp_path, disarm=True)
    assert code == 0
    assert stderr == ""
