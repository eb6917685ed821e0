"""Metric trackers behind one protocol: none, and a local JSON-lines file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from d9d.loop.config._trackers import AimTrackerConfig, TensorBoardTrackerConfig, WandbTrackerConfig
from d9d.loop.config._trainer import JsonlTrackerConfig, NoTrackerConfig, TrackerConfig
from d9d.loop.observability._trackers_aim import AimTracker
from d9d.loop.observability._trackers_tensorboard import TensorBoardTracker
from d9d.loop.observability._trackers_wandb import WandbTracker


class Tracker(Protocol):
    """Receives the metrics of logged steps (called on the main rank only)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records ``metrics`` for ``step``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (e.g. a run id to continue)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned."""
        ...

    def on_resume(self, step: int) -> None:
        """Called when a run resumes at ``step``: forget anything recorded for it or later."""
        ...

    def close(self) -> None:
        """Flushes and releases resources."""
        ...


class NoTracker:
    """Tracks nothing."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        del step, metrics

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state

    def on_resume(self, step: int) -> None:
        del step

    def close(self) -> None:
        pass


class JsonlTracker:
    """Appends ``{"step": ..., **metrics}`` lines to a file.

    On resume, lines of steps at or after the resumed step are dropped, so the file never holds a
    step twice.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        with self._path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state

    def on_resume(self, step: int) -> None:
        """Drops records of ``step`` and later (called when resuming at ``step``)."""
        if not self._path.exists():
            return
        kept = [
            line for line in self._path.read_text().splitlines() if line and json.loads(line)["step"] < step
        ]
        self._path.write_text("".join(f"{line}\n" for line in kept))

    def close(self) -> None:
        pass


def build_tracker(config: TrackerConfig, *, metadata: Mapping[str, Any] | None = None) -> Tracker:
    """Builds the tracker a config names; ``metadata`` (config, versions, ...) goes to those that keep it.

    Raises:
        MissingExtraError: If the tracker's optional extra is not installed.
    """
    metadata = metadata or {}
    match config:
        case NoTrackerConfig():
            return NoTracker()
        case JsonlTrackerConfig():
            return JsonlTracker(config.path)
        case TensorBoardTrackerConfig():
            return TensorBoardTracker(config, metadata=metadata)
        case WandbTrackerConfig():
            return WandbTracker(config, metadata=metadata)
        case AimTrackerConfig():
            return AimTracker(config, metadata=metadata)
