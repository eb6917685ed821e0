"""Ends a job whose step hangs, with an error naming the step and the rank."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading


class StepWatchdog:
    """A background timer armed at the start of each step and disarmed at its end.

    If a step outlives its timeout (a hung collective, a deadlocked data worker), the watchdog
    prints which step and rank hung with every thread's stack, and exits the process with code
    124 so that the launcher tears the job down instead of waiting forever.
    """

    def __init__(self, *, rank: int) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self, step: int, timeout_s: float | None) -> None:
        """Starts watching ``step``; ``None`` watches nothing."""
        self.disarm()
        if timeout_s is None:
            return
        timer = threading.Timer(timeout_s, self._expire, args=(step, timeout_s))
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def disarm(self) -> None:
        """Stops watching the current step."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _expire(self, step: int, timeout_s: float) -> None:
        sys.stderr.write(
            f"d9d: step {step} did not finish within {timeout_s:.0f} s on rank {self._rank}; "
            f"ending the job. Stacks of rank {self._rank}:\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(124)
