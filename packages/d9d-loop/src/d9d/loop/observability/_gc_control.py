"""Garbage collection at fixed steps instead of whenever allocation counts trigger it."""

from __future__ import annotations

import gc

from d9d.loop.config._observability import GarbageCollectionConfig


class GarbageCollection:
    """Turns automatic collection off while training and collects every ``every_steps`` steps.

    Automatic collection is restored at ``close()`` if it was on before training.
    """

    def __init__(self, config: GarbageCollectionConfig) -> None:
        self._config = config
        self._was_enabled: bool | None = None  # None: not started

    def step_started(self) -> None:
        """Turns automatic collection off (once)."""
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()  # start from a clean heap

    def step_finished(self, step: int) -> None:
        """Collects after every ``every_steps``-th step (``step`` is 0-based)."""
        if (step + 1) % self._config.every_steps == 0:
            gc.collect(self._config.generation)

    def close(self) -> None:
        """Restores automatic collection as it was before training."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
