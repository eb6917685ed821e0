"""A hung step ends the process with an error naming the step and rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_hung_step_exits_with_step_and_rank() -> None:
    script = textwrap.dedent(
        """
        import time
        from d9d.loop._step_watchdog import StepWatchdog
        dog = StepWatchdog(rank=3)
        dog.arm(7, 0.3)
        time.sleep(30)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 124
    assert "step 7 did not finish within 0 s on rank 3" in result.stderr
    assert "rank 3" in result.stderr


def test_disarmed_watchdog_stays_quiet() -> None:
    script = textwrap.dedent(
        """
        import time
        from d9d.loop._step_watchdog import StepWatchdog
        dog = StepWatchdog(rank=0)
        dog.arm(1, 0.2)
        dog.disarm()
        dog.arm(2, None)
        time.sleep(0.5)
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "ok"
