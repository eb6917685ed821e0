"""Where a rollback goes: the newest checkpoint, then older ones while the run keeps failing.

Resume restores the data position and every random generator, so reloading the same checkpoint
replays the same steps and fails the same way. A rollback that fails again before the run passed
the step that failed last time therefore goes to the checkpoint before the one it went to.
"""

from __future__ import annotations


class RollbackWalk:
    """Remembers the last rollback: the checkpoint it went to and the furthest step that failed."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None  # (checkpoint step, furthest failed step)

    def older_than(self, failed_step: int) -> int | None:
        """Only checkpoints of fewer steps than this may be loaded (None: the newest may).

        Args:
            failed_step: Steps done when this rollback was called for (the failed one included).
        """
        if self._last is None or failed_step > self._last[1]:
            return None  # the run passed the last failure: a new failure, the newest checkpoint
        return self._last[0]

    def moved(self, *, failed_step: int, checkpoint_step: int) -> None:
        """Records that the rollback for ``failed_step`` loaded the checkpoint of ``checkpoint_step``."""
        again = self._last is not None and failed_step <= self._last[1]
        furthest = max(failed_step, self._last[1]) if self._last is not None and again else failed_step
        self._last = (checkpoint_step, furthest)
